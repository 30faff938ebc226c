"""Policy loading: shipped examples load; every error names file, line, key, expected and
found (+ did you mean); the schema is published; fuzzed input never crashes the loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gearshift.common.engines import ENGINE_NAMES
from gearshift.common.errors import InvalidArgument
from gearshift.policies.loader import PolicyError, load_policy, load_policy_file, policy_json_schema
from gearshift.policies.rules import RULE_KINDS
from gearshift.policies.signals import SIGNALS

EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"


@pytest.mark.parametrize("name", ["default", "seed-framework", "sla-first", "approval-gated"])
def test_shipped_examples_load(name: str) -> None:
    p = load_policy_file(str(EXAMPLES / f"{name}.yaml"))
    assert p.name == name
    assert p.version == f"{name}@{p.digest[:12]}"


def test_digest_is_stable_and_tracks_content(policy_yaml) -> None:
    a = load_policy(policy_yaml())
    assert load_policy(policy_yaml() + "\n# a comment\n").digest == a.digest
    assert load_policy(policy_yaml("  guardrails: {minDwell: 2h}\n")).digest != a.digest
    with pytest.raises(Exception):  # noqa: B017 - frozen dataclass / pydantic model
        a.doc.spec.mode = "dry-run"  # type: ignore[misc]


def _problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as err:
        load_policy(text, source="p.yaml")
    assert isinstance(err.value, InvalidArgument)
    return err.value.problems


def test_unknown_keys_name_line_path_known_keys_and_a_close_match(policy_yaml) -> None:
    text = policy_yaml("  guardrails:\n    minDwel: 24h\n")
    [problem] = _problems(text)
    assert problem.startswith("p.yaml:11: spec.guardrails.minDwel: unknown key")
    assert "did you mean 'minDwell'?" in problem
    assert "maxConcurrentMigrations" in problem


def test_bad_values_say_expected_and_found(policy_yaml) -> None:
    problems = _problems(policy_yaml("  guardrails:\n    cooldown: forever\n    hysteresis: -1\n")
                         .replace("mode: auto", "mode: automatic"))
    assert problems[0] == ("p.yaml:6: spec.mode: expected 'dry-run', 'approve' or 'auto', "
                           "found 'automatic' (did you mean 'auto'?)")
    assert problems[1].startswith("p.yaml:11: spec.guardrails.cooldown: expected a duration")
    assert "found 'forever'" in problems[1]
    assert problems[2].startswith("p.yaml:12: spec.guardrails.hysteresis: expected")
    assert "found -1" in problems[2]


def test_rule_kinds_and_signals_are_checked_against_the_registries(policy_yaml) -> None:
    rules = ("    - {name: a, kind: treshold, prefer: vllm, when: [{signal: rps_peak, gt: 1}]}\n"
             "    - name: b\n      kind: threshold\n      prefer: vllm\n"
             "      when:\n        - {signal: rps_sustaned, gt: 100}\n"
             "    - {name: c, kind: threshold, prefer: vllm, when: [{signal: nvidia, gt: 1}]}\n"
             "    - {name: d, kind: expected-savings, params: {minNetSavings: 3}}\n"
             "    - {name: d, kind: static}\n")
    problems = _problems(policy_yaml(rules=rules))
    text = "\n".join(problems)
    assert "p.yaml:8: spec.rules[0].kind: expected one of " + ", ".join(RULE_KINDS) in text
    assert "found 'treshold' (did you mean 'threshold'?)" in text
    assert "p.yaml:13: spec.rules[1].when[0].signal: expected a registered signal, found " \
           "'rps_sustaned' (did you mean 'rps_sustained'?)" in text
    assert "p.yaml:14: spec.rules[2].when[0].gt: expected a bool comparison (eq, ne) for signal " \
           "'nvidia', found gt: 1.0" in text
    assert "p.yaml:15: spec.rules[3].params.minNetSavings: unknown key" in text
    assert "did you mean 'minNetSavingsUsd'?" in text
    assert "p.yaml:16: spec.rules[4].name: expected a unique rule name, found 'd' again" in text
    assert f"p.yaml:16: spec.rules[4]: expected 'prefer: {'|'.join(ENGINE_NAMES)}'" in text


def test_cross_field_checks(policy_yaml) -> None:
    spec = ("  signals: {window: 7d, longWindow: 1d}\n"
            "  guardrails:\n    maintenanceWindows:\n      - {cron: '61 * * *', duration: 1h}\n")
    problems = _problems(policy_yaml(spec))
    assert any(p.startswith("p.yaml:10: spec.signals.longWindow: expected at least the window")
               for p in problems)
    assert any(p.startswith("p.yaml:13: spec.guardrails.maintenanceWindows[0].cron: expected a "
                            "five-field crontab") for p in problems)


@pytest.mark.parametrize(("text", "fragment"), [
    ("", "expected a mapping"),
    ("- a\n- b\n", "expected a mapping"),
    ("a: [1, 2\n", "not valid YAML"),
    ("a: 1\na: 2\n", "a: duplicate key"),
    ("apiVersion: gearshift.dev/v2\n", "apiVersion: expected 'gearshift.dev/v1'"),
    ("{1: 2}\n", "expected a string key"),
    ("a: &x [*x]\n", "too large or too deeply nested"),
])
def test_broken_documents_fail_clearly(text: str, fragment: str) -> None:
    assert fragment in "\n".join(_problems(text))


def test_json_schema_lists_rule_kinds_and_signals() -> None:
    schema = policy_json_schema()
    assert schema["properties"]["apiVersion"]["const"] == "gearshift.dev/v1"
    assert schema["$defs"]["Rule"]["properties"]["kind"]["enum"] == list(RULE_KINDS)
    assert schema["$defs"]["Condition"]["properties"]["signal"]["enum"] == list(SIGNALS)
    assert schema["$defs"]["Guardrails"]["additionalProperties"] is False


def test_maintenance_windows_open_at_the_cron_time_for_their_duration(policy_yaml) -> None:
    from datetime import UTC, datetime
    p = load_policy(policy_yaml("  guardrails:\n    maintenanceWindows:\n"
                                "      - {cron: '0 2 * * mon-fri', duration: 2h}\n"))
    monday = datetime(2026, 3, 2, tzinfo=UTC).timestamp()  # a Monday
    assert not p.in_maintenance_window(monday + 1 * 3600)
    assert p.in_maintenance_window(monday + 2 * 3600)
    assert p.in_maintenance_window(monday + 3.9 * 3600)
    assert not p.in_maintenance_window(monday + 4.1 * 3600)
    assert not p.in_maintenance_window(monday + 5 * 86400 + 2.5 * 3600)  # Saturday


_yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True)
    | st.text(max_size=20) | st.sampled_from(["24h", "7d", "vllm", "tensorrt-llm", "threshold",
                                              "expected-savings", "rps_sustained", "0 2 * * *"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["name", "kind", "prefer", "when", "signal", "gt", "eq", "params", "mode",
                         "rules", "guardrails", "minDwell", "cost", "horizon", "x"]) | st.text(max_size=8),
        children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=_yaml_values)
def test_fuzzed_specs_load_or_fail_with_a_clear_error(spec) -> None:
    doc = {"apiVersion": "gearshift.dev/v1", "kind": "EnginePolicy", "metadata": {"name": "f"},
           "spec": spec}
    text = yaml.safe_dump(doc)
    try:
        load_policy(text, source="fuzz.yaml")
    except PolicyError as exc:
        assert exc.problems and all(p.startswith("fuzz.yaml:") for p in exc.problems)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=300))
def test_fuzzed_text_loads_or_fails_with_a_clear_error(text: str) -> None:
    try:
        load_policy(text, source="fuzz.yaml")
    except PolicyError as exc:
        assert all(p.startswith("fuzz.yaml") for p in exc.problems)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_mutated_default_policy_loads_or_fails_clearly(data) -> None:
    text = (EXAMPLES / "default.yaml").read_text()
    i = data.draw(st.integers(0, len(text) - 1))
    j = data.draw(st.integers(i, min(len(text), i + 10)))
    text = text[:i] + data.draw(st.text(max_size=10)) + text[j:]
    try:
        load_policy(text, source="m.yaml")
    except PolicyError as exc:
        assert all(p.startswith("m.yaml") for p in exc.problems)
