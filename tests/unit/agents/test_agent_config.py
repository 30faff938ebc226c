"""The agent's config file: the shipped example loads; bad input names field and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from gearshift.agents.config import load_agent_config, parse_agent_config
from gearshift.common.engines import ENGINE_NAMES
from gearshift.common.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def test_shipped_example_loads() -> None:
    cfg = load_agent_config(REPO / "deploy" / "examples" / "agent.yaml")
    assert cfg.host_id == "gpu-node-01"
    assert cfg.engine("tensorrt-llm").executable == ["trtllm-serve"]
    assert cfg.deployments[0].gpu_indices == [0, 1, 2, 3]


def test_defaults_fill_engine_executables() -> None:
    cfg = parse_agent_config({"host_id": "h"})
    assert cfg.engine("vllm").executable == ["vllm"]


@pytest.mark.parametrize("data,needles", [
    ({"report_interval_s": 0}, ["report_interval_s", "found 0"]),
    ({"controller": "nohost"}, ["controller", "HOST:PORT", "'nohost'"]),
    ({"engines": {"tgi": {}}}, ["unknown engine 'tgi'", ", ".join(ENGINE_NAMES)]),
    ({"gpus": {"source": "magic"}}, ["gpus.source", "'magic'"]),
    ({"deployments": [{"deployment_id": "a", "model": "m", "engine": "tgi"}]},
     ["deployments.0.engine", "'tgi'"]),
    ({"deployments": [{"deployment_id": "a", "model": "m", "engine": "vllm"},
                      {"deployment_id": "a", "model": "n", "engine": "vllm"}]},
     ["duplicate deployment_id a"]),
    ({"colour": 1}, ["colour: unknown key"]),
])
def test_bad_config_names_field_and_value(data: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_agent_config(data, "agent.yaml")
    for needle in needles:
        assert needle in err.value.message


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_agent_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_agent_config(bad)
    bad.write_text("key: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_agent_config(bad)


def _refused(path: Path) -> str:
    with pytest.raises(ConfigError) as err:
        load_agent_config(path)
    return err.value.message


def test_binary_deep_huge_and_bombed_configs_are_one_line_errors(tmp_path: Path) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)) * 8)
    assert "not UTF-8 text" in _refused(binary)
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 3000 + "]" * 3000 + "\n")
    assert "nested more than 32 levels deep" in _refused(deep)
    deep_map = tmp_path / "deep-map.yaml"
    deep_map.write_text("".join(f"{' ' * i}k{i}:\n" for i in range(300)))
    assert "nested more than" in _refused(deep_map)
    bomb = tmp_path / "bomb.yaml"
    rows = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    rows += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb.write_text("\n".join(rows) + "\n")
    assert "YAML nodes" in _refused(bomb)
    assert "larger than" in _refused(Path("/dev/zero"))
    for message in (_refused(binary), _refused(deep), _refused(bomb)):
        assert "\n" not in message


def test_emulated_gpus_need_their_block(tmp_path: Path) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text("gpus: {source: emulated}\n")
    message = _refused(f)
    assert "gpus: source 'emulated' needs an 'emulated' block" in message
    f.write_text("gpus: {source: emulated, emulated: {count: 2}}\n")
    assert load_agent_config(f).gpus.emulated is not None
