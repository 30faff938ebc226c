"""What an agent names is bounded and printable, and counted: a 1 MB model name,
terminal escape sequences (ESC, OSC 52, OSC 8) and NUL are refused naming the field;
a host naming too many distinct models is refused; the CLI's tables escape what they
show, and an agent takes control characters out of its free-text messages."""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from gearshift.agents.daemon import printable
from gearshift.cli import output
from gearshift.common.errors import InvalidArgument
from gearshift.common.spec import DeploymentSpec
from gearshift.controller.api.validation import (
    MAX_MODEL_LEN,
    MAX_MODELS_PER_HOST,
    check_hello,
    check_report,
)
from gearshift.v1 import agent_pb2

ESCAPES = ["\x1b[2J", "\x1b]52;c;cm0gLXJmIC8=\x07", "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\",
           "a\x00b", "\x9b31m", "line\nbreak"]


def report(**fields: str) -> agent_pb2.Report:
    r = agent_pb2.Report(seq=1, interval_s=10.0)
    r.deployments.add(**{"deployment_id": "d1", "engine": "vllm", "model": "m", **fields})
    return r


@pytest.mark.parametrize("field", ["model", "revision", "source", "served_model_name",
                                   "deployment_id", "message", "backend"])
@pytest.mark.parametrize("bad", ESCAPES)
def test_control_characters_in_a_name_are_refused_naming_the_field(field: str, bad: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_report(report(**{field: f"qwen{bad}"}))
    assert err.value.message.startswith(f"report.deployments[0].{field}: expected up to ")
    assert "control character" in err.value.message


@pytest.mark.parametrize(("field", "size"), [("model", 1_000_000), ("revision", 129),
                                             ("source", 1025), ("deployment_id", 129),
                                             ("message", 2049)])
def test_oversized_names_are_refused_naming_the_field(field: str, size: int) -> None:
    with pytest.raises(InvalidArgument) as err:
        check_report(report(**{field: "x" * size}))
    assert err.value.message.startswith(f"report.deployments[0].{field}: expected up to ")
    assert len(err.value.message) < 400


def test_names_as_engines_serve_them_pass() -> None:
    check_report(report(model="meta-llama/Llama-3.3-70B-Instruct", revision="r" * 128,
                        source="/models/llama-3.3-70b@main", served_model_name="m" * MAX_MODEL_LEN,
                        message="engine exited with code 2; restarting in 30 s"))


def test_a_host_naming_too_many_distinct_models_is_refused() -> None:
    r = agent_pb2.Report(seq=1, interval_s=10.0)
    for i in range(MAX_MODELS_PER_HOST + 1):
        r.deployments.add(deployment_id=f"d{i}", engine="vllm", model=f"m{i}")
    with pytest.raises(InvalidArgument, match=f"at most {MAX_MODELS_PER_HOST} distinct models"):
        check_report(r)
    r.deployments.pop()
    check_report(r)


def test_labels_with_escapes_are_refused() -> None:
    hello = agent_pb2.Hello(host_id="h", protocol_version=agent_pb2.PROTOCOL_VERSION_1)
    hello.labels["zone"] = "a\x1b]52;c;x\x07"
    with pytest.raises(InvalidArgument, match=r"hello\.labels\['zone'\]: .* printable"):
        check_hello(hello)


def test_a_deployment_spec_refuses_control_characters_in_its_model() -> None:
    with pytest.raises(InvalidArgument, match="model must be up to 256 printable"):
        DeploymentSpec(deployment_id="d1", model="m\x1b[2J", engine="vllm")


def test_cli_tables_show_escapes_not_control_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(output, "Console", lambda width: Console(file=out, width=width,
                                                                  force_terminal=True))
    output.print_table("models", ["model"], [["m\x1b]52;c;x\x07"], ["n\x00"]])
    shown = out.getvalue()
    assert "\x07" not in shown and "\x00" not in shown and "]52;" in shown
    assert "\\x1b]52;c;x\\x07" in shown


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_name_is_either_refused_naming_the_field_or_printable(name: str) -> None:
    try:
        check_report(report(model=name or "m"))
    except InvalidArgument as err:
        assert err.message.startswith("report.deployments[0].model: "), err.message
    else:
        assert output.escape_controls(name) == name and len(name) <= MAX_MODEL_LEN


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=3000))
def test_an_agents_message_is_always_acceptable(text: str) -> None:
    msg = printable(text, 2000)
    assert len(msg) <= 2000
    check_report(report(message=msg))


def test_the_fleet_refuses_a_report_past_its_distinct_models_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gearshift.common.errors import ResourceExhausted
    from gearshift.controller.ingest import fleet as fleet_module
    from gearshift.controller.ingest.fleet import FleetState

    monkeypatch.setattr(fleet_module, "MAX_FLEET_MODELS", 3)
    fleet = FleetState()
    fleet.hello(agent_pb2.Hello(host_id="h1", protocol_version=agent_pb2.PROTOCOL_VERSION_1), 10)
    first = agent_pb2.Report(seq=1, interval_s=10.0)
    for i in range(3):
        first.deployments.add(deployment_id=f"d{i}", engine="vllm", model=f"m{i}")
    fleet.check_models(first)
    fleet.report("h1", first)
    fleet.check_models(first)  # the same models again: nothing new
    more = agent_pb2.Report(seq=2, interval_s=10.0)
    more.deployments.add(deployment_id="d9", engine="vllm", model="m9")
    with pytest.raises(ResourceExhausted, match="at most 3 distinct models"):
        fleet.check_models(more)
