"""`gearshift policy validate|schema|backtest` through click's runner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def test_backtest_puts_the_collector_settings_back(tmp_path: Path, monkeypatch: Any) -> None:
    """The backtest freezes the collector's old objects and raises its young threshold
    while it runs; the process gets its settings back, also when the replay fails."""
    import gc
    import gzip

    from gearshift.cli.policy_cmds import BACKTEST_GC_YOUNG
    from gearshift.policies import backtest as replay

    # The settings each replay starts under: read as it starts, not from a collection,
    # which a small replay may not trigger at the raised threshold.
    seen: list[tuple[tuple[int, int, int], int]] = []
    simulate = replay.simulate

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append((gc.get_threshold(), gc.get_freeze_count()))
        return simulate(*args, **kwargs)

    monkeypatch.setattr(replay, "simulate", watched)

    raw = gzip.decompress((TRACES / "steady-70b.jsonl.gz").read_bytes()).decode().splitlines()
    traffic = json.loads(raw[1])
    traffic["rps"] = 1e300  # the cost model cannot price it: the replay raises
    unpriceable = tmp_path / "huge.jsonl"
    unpriceable.write_text("\n".join([raw[0], json.dumps(traffic), *raw[2:]]) + "\n")

    def backtest(trace: Path) -> int:
        out = CliRunner().invoke(policy, ["backtest", str(EXAMPLES / "default.yaml"),
                                          "--trace", str(trace), "-o", "json", "--blind"])
        return out.exit_code

    assert gc.get_freeze_count() == 0  # (nothing of the test process is frozen)
    before = (gc.get_threshold(), gc.get_freeze_count())
    for trace, code in ((TRACES / "steady-70b.jsonl.gz", 0), (unpriceable, 1)):
        assert backtest(trace) == code
        assert (gc.get_threshold(), gc.get_freeze_count()) == before
    # Objects another owner froze (a controller's collector settings) stay frozen.
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert backtest(unpriceable) == 1
        # still frozen (less what was freed meanwhile: a frozen object can be)
        assert gc.get_freeze_count() > 0.9 * frozen
    finally:
        gc.unfreeze()
    # every replay ran with the backtest's settings: young collections at its threshold,
    # the objects made before it frozen
    assert len(seen) == 3
    young = (BACKTEST_GC_YOUNG, *before[0][1:])
    assert young != before[0]
    assert all(t == young and frozen > 0 for t, frozen in seen)
