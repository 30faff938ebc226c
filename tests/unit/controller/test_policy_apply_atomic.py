"""A policy apply is one transaction: the stored version and its activation commit
together, so a crash between them cannot leave a version that was never active (a
kill -9 during `policy apply` once did, when they were two commits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gearshift.controller.decisions import store as decision_store
from gearshift.controller.decisions.store import DecisionStore
from gearshift.controller.store.database import Store
from gearshift.controller.store.tables import SETTING_ACTIVE_POLICY_VERSION, SettingRow
from gearshift.controller.store.upserts import upsert


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store.open(f"sqlite:///{tmp_path / 'gs.db'}")
    yield s
    s.close()


def test_the_version_and_its_activation_commit_together(store: Any) -> None:
    decisions = DecisionStore(store.engine)
    version = decisions.add_active_policy_version("p", "kind: EnginePolicy\n", "ops")
    assert store.get_setting(SETTING_ACTIVE_POLICY_VERSION) == version
    assert [r.version for r in decisions.list_policy_versions()] == [version]


def test_a_failure_before_the_commit_leaves_neither(store: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    decisions = DecisionStore(store.engine)
    first = decisions.add_active_policy_version("p", "a: 1\n", "ops")

    def crash_on_activation(conn: Any, model: Any, rows: Any, *args: Any) -> Any:
        if model is SettingRow:
            raise sa.exc.OperationalError("UPDATE settings", {}, Exception("disk I/O error"))
        return upsert(conn, model, rows, *args)

    monkeypatch.setattr(decision_store, "upsert", crash_on_activation)
    with pytest.raises(sa.exc.OperationalError):
        decisions.add_active_policy_version("p", "a: 2\n", "ops")
    monkeypatch.undo()
    assert [r.version for r in decisions.list_policy_versions()] == [first]
    assert store.get_setting(SETTING_ACTIVE_POLICY_VERSION) == first
