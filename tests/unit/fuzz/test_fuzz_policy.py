"""Property tests on the policy loader and `policy apply`: any text gives a policy or
a `PolicyError`, a policy that loads can be scheduled and evaluated for maintenance
windows, and a refused apply changes nothing."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from apscheduler.triggers.interval import IntervalTrigger
from hypothesis import given
from hypothesis import strategies as st

from fuzz_settings import FUZZ
from gearshift.common.errors import GearshiftError
from gearshift.controller.decisions.policy_loop import PolicyLoop
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.ingest.rate_history import RateHistory
from gearshift.controller.store.database import Store
from gearshift.policies.loader import PolicyError, load_policy

DEFAULT = (Path(__file__).parents[3] / "policies" / "examples" / "default.yaml").read_text()

DURATIONS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.tuples(st.floats(min_value=0, max_value=1e20, allow_nan=False),
              st.sampled_from("smhdw")).map(lambda t: f"{t[0]:g}{t[1]}"),
    st.sampled_from(["banana", "", "~", "[]", "{}", "-1s", "1e400", ".nan", "0x10", "1_000d"]),
)
SCALARS = st.one_of(DURATIONS, st.text(max_size=20).map(repr), st.booleans().map(str))
KEYS = ["interval: 15m", "window: 24h", "longWindow: 7d", "revisionWindow: 14d",
        "minHistory: 1h", "minDwell: 24h", "cooldown: 1h", "horizon: 7d", "hysteresis: 0.5",
        "maxConcurrentMigrations: 2", "sustainedQuantile: 0.1", "mode: auto"]


def mutated(key: str, value: str) -> str:
    return DEFAULT.replace(key, f"{key.split(':')[0]}: {value}")


def check_loaded(text: str) -> None:
    try:
        policy = load_policy(text, "fuzz.yaml")
    except PolicyError as err:
        assert err.problems and all(p.startswith("fuzz.yaml:") for p in err.problems)
        return
    spec = policy.doc.spec
    IntervalTrigger(seconds=spec.interval)  # what the controller schedules
    for t in (0.0, 1.7e9, 4.1e9):
        policy.in_maintenance_window(t)
    assert math.isfinite(spec.cost.horizon) and math.isfinite(spec.signals.long_window)


@FUZZ
@given(key=st.sampled_from(KEYS), value=SCALARS)
def test_any_value_at_any_key_loads_or_is_a_policy_error(key: str, value: str) -> None:
    check_loaded(mutated(key, value))


@FUZZ
@given(text=st.text(max_size=400))
def test_any_text_loads_or_is_a_policy_error(text: str) -> None:
    check_loaded(text)


@FUZZ
@given(cut=st.integers(min_value=0, max_value=len(DEFAULT)), junk=st.text(max_size=30))
def test_a_damaged_example_loads_or_is_a_policy_error(cut: int, junk: str) -> None:
    check_loaded(DEFAULT[:cut] + junk + DEFAULT[cut:])


@FUZZ
@given(window=DURATIONS, cron=st.sampled_from(["0 2 * * *", "* * * * *", "0 0 29 2 *",
                                                "0 0 31 4 *", "61 * * * *", "x"]))
def test_maintenance_windows_load_and_evaluate_or_are_refused(window: str, cron: str) -> None:
    check_loaded(DEFAULT.replace("    maxConcurrentMigrations: 2",
                                 "    maxConcurrentMigrations: 2\n    maintenanceWindows:\n"
                                 f"      - {{cron: '{cron}', duration: {window}}}"))


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[PolicyLoop]:
    store = Store.open(f"sqlite:///{tmp_path / 'fuzz.db'}")
    fleet = FleetState()
    loop = PolicyLoop(store, DecisionStore(store.engine), fleet, RateHistory(60.0),
                      paused=lambda: False, clock=lambda: 0.0)
    loop.policies.apply(DEFAULT, "default.yaml", "fuzz", "")
    yield loop
    store.close()


@FUZZ
@given(key=st.sampled_from(KEYS), value=SCALARS)
def test_a_refused_apply_changes_nothing(loop: PolicyLoop, key: str, value: str) -> None:
    before = (loop.policies.active(), len(loop.decisions.list_policy_versions()))
    try:
        loop.policies.apply(mutated(key, value), "fuzz.yaml", "fuzz", "")
    except GearshiftError:
        assert (loop.policies.active(), len(loop.decisions.list_policy_versions())) == before
        return
    active = loop.policies.active()
    assert active is not None
    IntervalTrigger(seconds=active[1].doc.spec.interval)
    loop.policies.restore(1)  # back to the example for the next example
