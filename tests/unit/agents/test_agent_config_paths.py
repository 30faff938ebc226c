"""Relative paths in an agent config file are taken from the file's directory, wherever
the agent runs from; paths from the command line or the environment stay relative to
the current directory."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from gearshift.agents.config import AgentConfig, load_agent_config


def _relative_config() -> dict[str, Any]:
    return {
        "host_id": "gpu-node-02",
        "workdir": "./agent-02",
        "command_journal": "journal/commands.jsonl",
        "tls": {"ca": "tls/ca.pem", "cert": "tls/agent.pem", "key": "tls/agent-key.pem"},
        "bootstrap_token_file": "bootstrap.token",
        "containers": {"model_cache": "cache/hf", "model_dirs": ["models", "/srv/models"],
                       "secret_env_files": {"HF_TOKEN": "secrets/hf.token"}},
    }


def test_relative_paths_are_taken_from_the_config_files_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    etc = tmp_path / "etc" / "gearshift"
    etc.mkdir(parents=True)
    (etc / "agent.yaml").write_text(yaml.safe_dump(_relative_config()))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    # Named relative to the current directory, as `--config ../etc/gearshift/agent.yaml`.
    cfg = load_agent_config(Path("../etc/gearshift/agent.yaml"))

    assert cfg.workdir == etc / "agent-02"
    assert cfg.command_journal == etc / "journal" / "commands.jsonl"
    assert cfg.tls is not None
    assert (cfg.tls.ca, cfg.tls.cert, cfg.tls.key) == (
        etc / "tls" / "ca.pem", etc / "tls" / "agent.pem", etc / "tls" / "agent-key.pem")
    assert cfg.bootstrap_token_file == etc / "bootstrap.token"
    assert cfg.containers is not None
    assert cfg.containers.model_cache == etc / "cache" / "hf"
    assert cfg.containers.model_dirs == [etc / "models", Path("/srv/models")]  # absolute kept
    assert cfg.containers.secret_env_files == {"HF_TOKEN": etc / "secrets" / "hf.token"}


def test_command_line_and_environment_paths_stay_relative_to_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "agent.yaml"
    path.write_text(yaml.safe_dump({"host_id": "h", "enrol_controller": "127.0.0.1:50052"}))
    monkeypatch.chdir(tmp_path)
    cfg = load_agent_config(path, {"workdir": Path("run/agent"),
                                   "bootstrap_token_file": Path("boot.token")},
                            defaults={"tls": {"ca": "certs/ca.pem"}})  # as $GEARSHIFT_TLS_CA
    assert cfg.workdir == Path("run/agent")
    assert cfg.bootstrap_token_file == Path("boot.token")
    assert cfg.tls is not None and cfg.tls.ca == Path("certs/ca.pem")


def _path_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted field name, shape) of every Path-typed field, nested models included."""
    for name, field in model.model_fields.items():
        yield from _shapes(field.annotation, prefix + name)


def _shapes(annotation: Any, where: str) -> Iterator[tuple[str, str]]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            yield from _shapes(arg, where)
    elif annotation is Path:
        yield where, "path"
    elif origin is list and args[0] is Path:
        yield where, "list"
    elif origin is dict and args[1] is Path:
        yield where, "dict"
    elif origin is list and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        yield from _path_fields(args[0], where + ".0.")
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield from _path_fields(annotation, where + ".")


def test_every_path_field_of_the_schema_is_covered(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Path field added to the schema later is resolved too (or this test says which)."""
    fields = dict(_path_fields(AgentConfig))
    assert {"workdir", "command_journal", "bootstrap_token_file", "tls.ca", "tls.cert",
            "tls.key", "containers.model_cache", "containers.model_dirs",
            "containers.secret_env_files"} <= set(fields)
    data: dict[str, Any] = {}
    for dotted, shape in fields.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = {"path": f"rel/{leaf}", "list": [f"rel/{leaf}"],
                      "dict": {"X": f"rel/{leaf}"}}[shape]
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    cfg = load_agent_config(path)
    for dotted, shape in fields.items():
        value: Any = cfg
        for part in dotted.split("."):
            value = getattr(value, part)
        values = ([value] if shape == "path" else list(value) if shape == "list"
                  else list(value.values()))
        assert values and all(v == tmp_path / "conf" / "rel" / dotted.rsplit(".", 1)[-1]
                              for v in values), (dotted, value)
