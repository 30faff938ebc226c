"""deploy/examples/agent-emulated.yaml, the README's quickstart agent: emulated GPUs and
engines, a plaintext controller on loopback; it loads as shipped."""

from __future__ import annotations

import re
from pathlib import Path

from gearshift.agents.config import load_agent_config
from gearshift.common.engines import ENGINE_NAMES

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "deploy" / "examples" / "agent-emulated.yaml"


def test_the_emulated_example_loads_as_a_loopback_plaintext_agent() -> None:
    cfg = load_agent_config(EXAMPLE)
    assert cfg.controller == "127.0.0.1:50051" and cfg.tls is None and not cfg.enrols
    assert cfg.gpus.source == "emulated" and cfg.gpus.emulated is not None
    assert set(cfg.engines) == set(ENGINE_NAMES)
    for name in ENGINE_NAMES:
        eng = cfg.engine(name)
        # `gearshift emulate`, emulating the release the config reports.
        assert eng.executable[:4] == ["gearshift", "emulate", "--flavor", name], eng
        assert eng.executable[-1] == "--"
        version = eng.executable[eng.executable.index("--engine-version") + 1]
        assert version == eng.version
    indices = {i for d in cfg.deployments for i in d.gpu_indices}
    assert cfg.deployments and indices <= set(range(cfg.gpus.emulated.count))
    assert EXAMPLE.parent not in cfg.workdir.parents  # its state is not written into deploy/


def test_the_readme_quickstart_runs_the_emulated_example() -> None:
    readme = (REPO / "README.md").read_text()
    agents = re.findall(r"^gearshift agent --config (\S+)", readme, re.MULTILINE)
    assert agents and agents[0] == "deploy/examples/agent-emulated.yaml", agents
