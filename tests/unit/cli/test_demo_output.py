"""The demo's printed lines: long ones wrap at word boundaries (never cut mid-word), and
once the fleet is up it prints the CLI commands that watch it, with the real address.
No fleet runs here (`make demo` and tests/integration/test_demo.py run the whole demo)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console

from gearshift.cli import demo as demo_module
from gearshift.cli.demo import DEMO_WIDTH_CHARS, demo_console, print_watch_commands
from gearshift.devfleet.scenario import step_line
from gearshift.v1 import control_pb2

ADDR = "127.0.0.1:45678"
LONG_MESSAGE = ("canary step 2/2 held: candidate ttft p99 0.412 s against baseline 0.388 s and "
                "the SLA 0.400 s; itl p99 0.021 s within 0.200 s; errors 0 of 312 requests; "
                "waiting for 2 healthy analysis intervals [as 0.18: outside the version table]")


def recording(width: int) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, highlight=False, color_system=None), buf


def test_long_step_line_wraps_at_words_and_keeps_the_whole_message() -> None:
    console, buf = recording(60)
    m = control_pb2.Migration(id="mig-7", model="mistral-7b", from_engine="vllm",
                              to_engine="tensorrt-llm", kind="engine_switch")
    step = control_pb2.MigrationStep(at=Timestamp(), from_phase="canary", to_phase="canary",
                                     message=LONG_MESSAGE)
    console.print(step_line("  12.5s", m, step))
    lines = buf.getvalue().splitlines()
    assert len(lines) > 2 and all(len(line) <= 60 for line in lines)
    printed = [w for line in lines for w in line.split()]
    # Every word whole (none split across lines), the message to its end, brackets as written.
    assert set(LONG_MESSAGE.split()) <= set(printed)
    assert " ".join(printed).endswith(LONG_MESSAGE)


def test_demo_console_follows_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    # Into a file or pipe: the demo's fixed width (lines wrap there, at words).
    assert demo_console(file=io.StringIO()).width == DEMO_WIDTH_CHARS
    # On a terminal: its own width, so the terminal never cuts a longer line mid-word.
    monkeypatch.setenv("COLUMNS", "90")
    assert demo_console(file=io.StringIO(), force_terminal=True).width == 90


def test_watch_commands_name_the_controller_and_stay_whole() -> None:
    console, buf = recording(40)  # narrower than a command: still one line each
    print_watch_commands(console, ADDR)
    lines = buf.getvalue().splitlines()
    for what in ("fleet deployments", "decisions list", "migrations list"):
        assert f"  gearshift --controller {ADDR} {what}" in lines


def test_demo_prints_the_watch_commands_once_the_fleet_is_up(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`gearshift demo` itself: after `start_demo_fleet`, before the scenario runs, the
    commands with the controller's real address (the fleet's parts replaced by fakes)."""

    class FakeFleet:
        def __init__(self, workdir: Path, **_: Any) -> None:
            self.workdir, self.controller_addr = workdir, ADDR

        def stop(self) -> None:
            pass

    async def no_scenario(*_: Any) -> Any:
        raise RuntimeError("scenario not run in this test")

    monkeypatch.setattr(demo_module, "LocalFleet", FakeFleet)
    monkeypatch.setattr(demo_module, "start_demo_fleet", lambda *_: ())
    monkeypatch.setattr(demo_module, "run_scenario", no_scenario)
    out = CliRunner().invoke(demo_module.demo, ["--workdir", str(tmp_path)])
    assert isinstance(out.exception, RuntimeError)
    assert f"gearshift --controller {ADDR} fleet deployments" in out.output
    assert f"gearshift --controller {ADDR} migrations list" in out.output
