"""`gearshift policy validate|schema|backtest` through click's runner."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from gearshift.cli.policy_cmds import policy

TRACES = Path(__file__).parent / "traces"
EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"


def test_validate_reports_versions_and_problems(tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(policy, ["validate", str(EXAMPLES / "default.yaml")])
    assert ok.exit_code == 0 and "ok (default@" in ok.output
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "default.yaml").read_text().replace("minDwell", "minDwel"))
    out = runner.invoke(policy, ["validate", str(bad)])
    assert out.exit_code == 1
    assert f"{bad}:" in out.output and "did you mean 'minDwell'?" in out.output
    assert "Traceback" not in out.output


def test_schema_prints_json() -> None:
    out = CliRunner().invoke(policy, ["schema"])
    assert out.exit_code == 0
    assert json.loads(out.output)["properties"]["kind"]["const"] == "EnginePolicy"


def test_backtest_json_text_and_compare() -> None:
    runner = CliRunner()
    args = ["backtest", str(EXAMPLES / "default.yaml"), "--trace", str(TRACES / "steady-70b.jsonl.gz")]
    out = runner.invoke(policy, [*args, "-o", "json"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.output)
    assert r["trace"] == "steady-70b" and r["models"]["llama-70b"]["switches"]
    text = runner.invoke(policy, [*args, "--compare", str(EXAMPLES / "sla-first.yaml")])
    assert text.exit_code == 0, text.output
    assert "default on trace steady-70b" in text.output and "compared with sla-first" in text.output


def test_backtest_errors_are_clean(tmp_path: Path) -> None:
    broken = tmp_path / "t.jsonl"
    broken.write_text('{"kind":"header"}\n')
    out = CliRunner().invoke(policy, ["backtest", str(EXAMPLES / "default.yaml"), "--trace", str(broken)])
    assert out.exit_code == 1 and f"{broken}:1: version" in out.output
    assert "Traceback" not in out.output
