"""A stored policy can never leave a controller unable to lead or to accept the next
`policy apply`: real controller processes, restarted over the same SQLite store,
driven by the real CLI."""

from __future__ import annotations

from pathlib import Path

from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.store.database import Store, default_sqlite_url
from gearshift.controller.store.tables import SETTING_ACTIVE_POLICY_VERSION
from gearshift.devfleet.local_fleet import LocalFleet
from integration.helpers import gearshift, gearshift_json

REPO = Path(__file__).resolve().parents[2]
GOOD = (REPO / "policies" / "examples" / "default.yaml").read_text()
UNSCHEDULABLE = GOOD.replace("interval: 15m", "interval: 1000000000d")


def test_apply_refuses_what_cannot_be_scheduled_and_stores_nothing(fleet: LocalFleet,
                                                                    tmp_path: Path) -> None:
    fleet.start_controller()
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text(UNSCHEDULABLE)
    gearshift(fleet, "policy", "apply", str(good))
    refused = gearshift(fleet, "policy", "apply", str(bad), check=False)
    assert refused.returncode == 2, refused.stderr
    assert "spec.interval: expected a duration from 1s to 7d" in refused.stderr
    assert "Traceback" not in refused.stderr + refused.stdout
    [only] = gearshift_json(fleet, "policy", "history")
    assert only["version"] == 1 and only["active"] and only["mode"] == "auto"


def test_a_stored_version_that_cannot_load_never_stops_the_controller(fleet: LocalFleet,
                                                                       tmp_path: Path) -> None:
    fleet.start_controller()
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    gearshift(fleet, "policy", "apply", str(good))
    fleet.procs.pop("controller").terminate()
    # What an older release with looser checks stored and made active.
    store = Store.open(default_sqlite_url(fleet.workdir / "data"))
    version = DecisionStore(store.engine).add_policy_version("default", UNSCHEDULABLE, "older-release", "")
    store.set_setting(SETTING_ACTIVE_POLICY_VERSION, version)
    store.close()

    log = fleet.workdir / "controller.log"
    before = log.stat().st_size
    fleet.start_controller()  # restarted over the same store: it leads and serves
    history = gearshift(fleet, "policy", "history")
    assert "auto" in history.stdout and "older-release" in history.stdout
    shown = gearshift(fleet, "policy", "show", "--version", str(version))
    assert "mode auto" in shown.stdout
    restored = gearshift(fleet, "policy", "apply", "--version", "1")
    assert "applied version 1 (default, auto)" in restored.stdout
    assert gearshift_json(fleet, "policy", "show")["version"] == 1
    restarted = log.read_bytes()[before:].decode(errors="replace")
    assert "cannot be used; apply another" in restarted and "no longer leads" not in restarted
