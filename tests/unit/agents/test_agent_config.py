"""The agent's config file: the shipped example loads; bad input names field and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from gearshift.agents.config import load_agent_config, parse_agent_config
from gearshift.common.engines import ENGINE_NAMES
from gearshift.common.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def test_shipped_example_loads() -> None:
    # The systemd unit gives the CA ($GEARSHIFT_TLS_CA): the agent enrols.
    cfg = load_agent_config(REPO / "deploy" / "examples" / "agent.yaml",
                            defaults={"tls": {"ca": "/run/credentials/ca.pem"}})
    assert cfg.host_id == "gpu-node-01" and cfg.enrols
    assert cfg.enrol_controller == "controller.internal:50052"
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


@pytest.mark.parametrize(("data", "needle"), [
    ({"tls": {"ca": "ca.pem"}}, "give enrol_controller"),
    ({"enrol_controller": "c:50052"}, "enrol_controller needs tls with a CA"),
    ({"tls": {"ca": "ca.pem", "cert": "a.pem", "key": "a-key.pem"},
      "enrol_controller": "c:50052"}, "a pre-made certificate needs no enrolment"),
    ({"tls": {"ca": "ca.pem", "cert": "a.pem"}}, "give both cert and key"),
    ({"tls": {"ca": "ca.pem"}, "enrol_controller": "nohost"}, "HOST:PORT"),
])
def test_enrolment_settings_are_checked(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_agent_config(data)


def test_bootstrap_token_sources(tmp_path: Path) -> None:
    from gearshift.agents.enrolment import load_bootstrap_token

    token = tmp_path / "t"
    token.write_text("0a1b2c3d.secret\n")
    assert load_bootstrap_token(token, {}) == "0a1b2c3d.secret"
    assert load_bootstrap_token(None, {"GEARSHIFT_BOOTSTRAP_TOKEN_FILE": str(token)}) \
        == "0a1b2c3d.secret"
    assert load_bootstrap_token(None, {"GEARSHIFT_BOOTSTRAP_TOKEN": "x.y"}) == "x.y"
    with pytest.raises(ConfigError, match="no valid certificate and no bootstrap token"):
        load_bootstrap_token(None, {})
    token.write_text("none\n")  # the systemd unit's default once the file is gone
    with pytest.raises(ConfigError, match="says 'none' and this host has no valid certificate"):
        load_bootstrap_token(token, {})
    with pytest.raises(ConfigError, match="cannot read"):
        load_bootstrap_token(tmp_path / "missing", {})
