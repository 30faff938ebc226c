"""What the daemons take from the environment: the CLI's variables (its certificate,
token and controller, as the README exports them on an admin machine) never reach an
agent's or a controller's config; a daemon's own variables do, and an error about a
value that came from one names the variable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

import gearshift.agents.daemon
from gearshift.agents.config import AgentConfig
from gearshift.cli.daemons import agent, controller

# The README's "Run on real hosts", step 2, on the admin machine.
CLI_ENV = {"GEARSHIFT_TLS_CA": "certs/ca.pem", "GEARSHIFT_TLS_CERT": "certs/cli.pem",
           "GEARSHIFT_TLS_KEY": "certs/cli-key.pem", "GEARSHIFT_TOKEN_FILE": "certs/admin.token",
           "GEARSHIFT_CONTROLLER": "controller.internal:50051"}


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[AgentConfig]:
    """The configs the `agent` command would run (the agent itself is not started)."""
    configs: list[AgentConfig] = []

    async def record(cfg: AgentConfig) -> None:
        configs.append(cfg)

    monkeypatch.setattr(gearshift.agents.daemon, "run_agent", record)
    return configs


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for name in list(os.environ):
        if name.startswith("GEARSHIFT_"):
            monkeypatch.delenv(name)


def _agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any],
           env: dict[str, str], *args: str) -> Result:
    _clean_env(monkeypatch)
    (tmp_path / "certs").mkdir(exist_ok=True)
    (tmp_path / "certs" / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    return CliRunner().invoke(agent, ["--config", str(path), *args], env=env)


ENROLS = {"host_id": "gpu-node-01", "controller": "10.0.0.10:50051",
          "enrol_controller": "10.0.0.10:50052", "workdir": "/var/lib/gearshift/agent"}


def test_the_clis_certificate_and_controller_never_reach_the_agent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list[AgentConfig]) -> None:
    # deploy/examples/agent.yaml's shape (enrols; the CA from the environment), started
    # from the shell that exported the CLI's TLS files and controller.
    result = _agent(tmp_path, monkeypatch, ENROLS, CLI_ENV)
    assert result.exit_code == 0, result.output
    [cfg] = started
    assert cfg.tls is not None and cfg.tls.ca == Path("certs/ca.pem")  # the CA: the agent's too
    assert cfg.tls.cert is None and cfg.tls.key is None  # not cli.pem
    assert cfg.enrols and cfg.controller == "10.0.0.10:50051"  # the file's, not $GEARSHIFT_CONTROLLER


def test_a_tls_error_from_the_environment_names_the_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list[AgentConfig]) -> None:
    plaintext = {"host_id": "h", "controller": "127.0.0.1:50051"}  # no tls:, no enrolment
    result = _agent(tmp_path, monkeypatch, plaintext, {"GEARSHIFT_TLS_CA": "certs/ca.pem"})
    assert result.exit_code != 0 and not started
    assert "$GEARSHIFT_TLS_CA" in result.output, result.output
    assert "enrol_controller" in result.output

    missing = _agent(tmp_path, monkeypatch, ENROLS, {"GEARSHIFT_TLS_CA": "nowhere/ca.pem"})
    assert missing.exit_code != 0 and not started
    assert "$GEARSHIFT_TLS_CA" in missing.output and "nowhere/ca.pem" in missing.output


def test_the_files_tls_wins_and_the_environment_is_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list[AgentConfig]) -> None:
    own = {**ENROLS, "tls": {"ca": "/etc/gearshift/tls/ca.pem"}}
    result = _agent(tmp_path, monkeypatch, own, CLI_ENV)
    assert result.exit_code == 0, result.output
    assert started[0].tls is not None
    assert started[0].tls.ca == Path("/etc/gearshift/tls/ca.pem") and started[0].tls.cert is None


@pytest.mark.parametrize("var,value,field", [
    ("GEARSHIFT_METRICS_LISTEN", "nonsense", "metrics_listen"),
    ("GEARSHIFT_ENROL_CONTROLLER", "no-port", "enrol_controller"),
])
def test_an_agent_setting_from_the_environment_names_its_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list[AgentConfig],
        var: str, value: str, field: str) -> None:
    result = _agent(tmp_path, monkeypatch, {"host_id": "h"}, {var: value})
    assert result.exit_code != 0 and not started
    assert field in result.output and f"${var}" in result.output, result.output


def test_the_systemd_units_variables_still_reach_the_agent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, started: list[AgentConfig]) -> None:
    # deploy/systemd/gearshift-agent.service: the CA and the token file; k8s: bind host.
    result = _agent(tmp_path, monkeypatch, ENROLS, {
        "GEARSHIFT_TLS_CA": "/run/credentials/gearshift-agent.service/ca.pem",
        "GEARSHIFT_BOOTSTRAP_TOKEN_FILE": "/run/credentials/gearshift-agent.service/bootstrap.token",
        "GEARSHIFT_BIND_HOST": "10.1.2.3"}, "--workdir", str(tmp_path / "state"))
    # The CA named by the unit is not there in this test: the check names the variable.
    assert "$GEARSHIFT_TLS_CA" in result.output
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    result = CliRunner().invoke(agent, ["--config", str(tmp_path / "agent.yaml")], env={
        "GEARSHIFT_TLS_CA": str(ca), "GEARSHIFT_BOOTSTRAP_TOKEN_FILE": "/run/boot.token",
        "GEARSHIFT_BIND_HOST": "10.1.2.3"})
    assert result.exit_code == 0, result.output
    [cfg] = started
    assert cfg.tls is not None and cfg.tls.ca == ca and cfg.enrols
    assert cfg.bootstrap_token_file == Path("/run/boot.token") and cfg.bind_host == "10.1.2.3"


@pytest.fixture
def controller_runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import gearshift.controller.server
    configs: list[Any] = []

    async def record(cfg: Any, ready_file: Path | None = None) -> None:
        configs.append(cfg)

    monkeypatch.setattr(gearshift.controller.server, "run_controller", record)
    return configs


def test_the_controller_takes_none_of_the_clis_variables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, controller_runs: list[Any]) -> None:
    _clean_env(monkeypatch)
    result = CliRunner().invoke(controller, ["--data-dir", str(tmp_path / "data"),
                                             "--event-loop", "asyncio"], env=CLI_ENV)
    assert result.exit_code == 0, result.output
    [cfg] = controller_runs
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.tokens_file) == (None, None, None, None)


def test_a_controller_setting_from_the_environment_names_its_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, controller_runs: list[Any]) -> None:
    _clean_env(monkeypatch)
    result = CliRunner().invoke(controller, ["--data-dir", str(tmp_path / "data"),
                                             "--event-loop", "asyncio"],
                                env={"GEARSHIFT_TLS_SERVER_CERT": "certs/controller.pem"})
    assert result.exit_code != 0 and not controller_runs
    assert "--tls-cert" in result.output and "$GEARSHIFT_TLS_SERVER_CERT" in result.output, \
        result.output
