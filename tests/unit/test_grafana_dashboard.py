"""deploy/grafana/gearshift.json: a datasource variable every query uses, unique panel
ids, refIds on targets, the fleet, decision and migration rows, and PromQL that parses
(promtool checks every expression as a recording rule)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from promql_names import DASHBOARD, dashboard_exprs, metric_names, with_fixed_windows

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _dash() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dash()["panels"] if p["type"] != "row"]


def test_a_datasource_variable_of_type_datasource() -> None:
    variables = {v["name"]: v for v in _dash()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


def test_every_panel_and_target_queries_the_variable() -> None:
    for p in _panels():
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE, p["title"]


def test_panel_ids_are_unique_and_targets_have_unique_ref_ids() -> None:
    ids = [p["id"] for p in _dash()["panels"]]
    assert all(isinstance(i, int) and i > 0 for i in ids)
    assert len(ids) == len(set(ids))
    for p in _panels():
        refs = [t["refId"] for t in p["targets"]]
        assert all(refs) and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_rows_for_the_fleet_decisions_and_migrations() -> None:
    rows = {p["title"] for p in _dash()["panels"] if p["type"] == "row"}
    assert {"Fleet", "Decisions", "Migrations"} <= rows
    names = set().union(*map(metric_names, dashboard_exprs()))
    for needed in ("gearshift_controller_hosts", "gearshift_controller_decisions_total",
                   "gearshift_controller_migrations_in_flight",
                   "gearshift_controller_migration_duration_seconds_bucket"):
        assert needed in names


def test_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for p in _dash()["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                 for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, p["title"]
        taken |= cells


def test_promtool_parses_every_expression(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: it comes with Debian's `prometheus` package, "
                    "which `make test` installs when apt-get can (as root)")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": with_fixed_windows(e)}
        for i, e in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "dashboard-exprs.yaml"
    path.write_text(yaml.safe_dump(rules))
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (model) (rate(a_total{reason=~"x|y"}[5m])) / sum by (model) (rate(b_total[5m]))',
     {"a_total", "b_total"}),
    ("histogram_quantile(0.99, sum by (le, k) (rate(h_seconds_bucket[$__rate_interval])))",
     {"h_seconds_bucket"}),
    ("(sum(g) or vector(0)) < 1", {"g"}),
    ('absent(up{job="c"})', {"up"}),
    ("max(x) / 60 > 1e3", {"x"}),
])
def test_metric_names_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names
