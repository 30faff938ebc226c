"""Validated means applicable: every duration a policy implies is range-checked, with
the error at the exact key; semantic warnings, and --strict making them errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gearshift.cli.policy_cmds import policy
from gearshift.common.engines import ENGINE_NAMES
from gearshift.policies.backtest import run_backtest
from gearshift.policies.loader import PolicyError, load_policy, policy_mode
from gearshift.policies.trace import read_trace

EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"
TRACES = Path(__file__).parent / "traces"
DEFAULT = (EXAMPLES / "default.yaml").read_text()
INTERVAL_LINE = DEFAULT.splitlines().index("  interval: 15m") + 1


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as err:
        load_policy(text, "p.yaml")
    return err.value.problems


@pytest.mark.parametrize("value", ["1000000000d", "1.0e+300", "8d", "0.5s"])
def test_an_interval_that_cannot_be_scheduled_is_refused_at_its_key(value: str) -> None:
    [line] = problems(DEFAULT.replace("interval: 15m", f"interval: {value}"))
    assert line.startswith(f"p.yaml:{INTERVAL_LINE}: spec.interval: expected a duration from 1s to 7d")


def test_a_maintenance_window_too_long_for_a_date_is_refused() -> None:
    text = DEFAULT.replace("    maxConcurrentMigrations: 2", "    maxConcurrentMigrations: 2\n"
                           "    maintenanceWindows: [{cron: '0 2 * * *', duration: 99999999d}]")
    [line] = problems(text)
    assert "spec.guardrails.maintenanceWindows[0].duration: expected a duration from 1s to 31d" in line


@pytest.mark.parametrize(("key", "value"), [("horizon: 7d", "horizon: 100000d"),
                                            ("longWindow: 7d", "longWindow: 1e300"),
                                            ("minDwell: 24h", "minDwell: 9999999w")])
def test_windows_horizons_and_dwell_are_bounded(key: str, value: str) -> None:
    found = problems(DEFAULT.replace(key, value))
    assert found and all("expected a duration" in p for p in found)


def test_a_bounded_maintenance_window_still_backtests() -> None:
    text = DEFAULT.replace("    maxConcurrentMigrations: 2", "    maxConcurrentMigrations: 2\n"
                           "    maintenanceWindows: [{cron: '0 2 * * *', duration: 31d}]")
    result = run_backtest(load_policy(text), read_trace(TRACES / "steady-70b.jsonl.gz"))
    assert result["summary"]["cost_usd"] > 0


def test_a_misspelled_or_bad_interval_is_reported_at_interval_not_spec() -> None:
    [typo] = problems(DEFAULT.replace("interval: 15m", "intervl: 15m"))
    assert "spec.intervl: unknown key" in typo and "did you mean 'interval'?" in typo
    [banana] = problems(DEFAULT.replace("interval: 15m", "interval: banana"))
    assert banana.startswith(f"p.yaml:{INTERVAL_LINE}: spec.interval: expected a duration like")
    assert "'spec'" not in typo + banana


THRESHOLD = """\
    - name: busy
      kind: threshold
      prefer: tensorrt-llm
      when:
        - {signal: rps_current, gt: 10}
        - {signal: rps_current, lt: 5}
        - {signal: rps_peak, ge: .nan}
"""


def with_rule(rule: str, extra: str = "") -> str:
    text = DEFAULT.replace("  rules:\n", "  rules:\n" + rule)
    return text.replace("    order: [vllm, tensorrt-llm]   # ties go to the first",
                        "    order: [vllm, tensorrt-llm]\n" + extra)


def test_contradictions_nan_and_no_engine_left_are_warnings_and_strict_errors() -> None:
    text = with_rule(THRESHOLD, f"    exclude: [{', '.join(ENGINE_NAMES)}]")
    p = load_policy(text, "p.yaml")
    joined = "\n".join(p.warnings)
    assert "spec.rules[0].when: the conditions on 'rps_current' can never all hold (gt 10 and lt 5)" in joined
    assert "spec.rules[0].when[2].ge: NaN never compares true" in joined
    assert "spec.rules[0].prefer: prefers 'tensorrt-llm', which preferences.exclude excludes" in joined
    assert "spec.preferences.exclude: excludes every engine" in joined
    with pytest.raises(PolicyError) as err:
        load_policy(text, "p.yaml", strict=True)
    assert len(err.value.problems) == 4
    assert load_policy(DEFAULT).warnings == ()


def test_validate_prints_warnings_and_strict_fails(tmp_path: Path) -> None:
    f = tmp_path / "warn.yaml"
    f.write_text(with_rule(THRESHOLD))
    runner = CliRunner()
    ok = runner.invoke(policy, ["validate", str(f)])
    assert ok.exit_code == 0 and "warning:" in ok.output and "2 warnings" in ok.output
    strict = runner.invoke(policy, ["validate", "--strict", str(f)])
    assert strict.exit_code == 1 and "can never all hold" in strict.output


def test_validate_refuses_dev_zero_and_binary_files_in_one_line(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(policy, ["validate", "/dev/zero"])
    assert out.exit_code == 1 and "larger than 262144 bytes" in out.output
    blob = tmp_path / "blob.yaml"
    blob.write_bytes(bytes(range(256)) * 4)
    out = runner.invoke(policy, ["validate", str(blob)])
    assert out.exit_code == 1 and "not UTF-8 text" in out.output
    assert "Traceback" not in out.output


def test_policy_mode_reads_stored_text_without_validating_it() -> None:
    assert policy_mode(DEFAULT) == "auto"
    assert policy_mode(DEFAULT.replace("interval: 15m", "interval: 1000000000d")) == "auto"
    assert policy_mode(DEFAULT.replace("  mode: auto\n", "")) == "dry-run"
    assert policy_mode(": : :") == ""


def test_a_key_with_brackets_is_an_unknown_key_not_a_crash() -> None:
    # Found by `make fuzz`: pydantic's location tags look like ``literal[...]``.
    found = problems("zz[::\n")
    assert any("zz[" in p and "unknown key" in p for p in found)


@pytest.mark.parametrize(("cron", "fires"), [("0 0 31 2 *", False), ("0 0 30,31 2 *", False), ("0 0 31 4,6 *", False),
                                             ("0 0 29 2 *", True), ("0 0 31 1-3 *", True),
                                             ("0 0 31 2 1", True)])
def test_a_maintenance_window_that_never_opens_is_refused(cron: str, fires: bool) -> None:
    text = DEFAULT.replace("    maxConcurrentMigrations: 2", "    maxConcurrentMigrations: 2\n"
                           f"    maintenanceWindows: [{{cron: '{cron}', duration: 1h}}]")
    if fires:
        assert load_policy(text).windows
    else:
        [line] = problems(text)
        assert "maintenanceWindows[0].cron: expected a crontab that fires" in line
