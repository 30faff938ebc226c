"""The alert rules (deploy/prometheus/rules.yaml): promtool checks them and runs their unit
tests (deploy/prometheus/tests/*.yaml), every alert has a test that fires it and one that
shows it silent, and every alert carries a severity and a runbook section that exists."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.gateway.metrics import CLIENT_ERROR_REASONS, UPSTREAM_ERROR_REASONS

ROOT = Path(__file__).parents[2]
PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "rules.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
SEVERITIES = {"critical", "warning", "info"}


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed: it comes with Debian's `prometheus` package, "
                    "which `make test` installs when apt-get can (as root)")
    return found


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _test_files() -> list[Path]:
    files = sorted((PROM / "tests").glob("*.yaml"))
    assert files, "no promtool test files in deploy/prometheus/tests"
    return files


def _cases() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(test group, alert_rule_test entry) of every promtool test file."""
    out = []
    for f in _test_files():
        doc = yaml.safe_load(f.read_text())
        assert [(f.parent / r).resolve() for r in doc["rule_files"]] == [RULES.resolve()], f
        for group in doc["tests"]:
            out.extend((group, case) for case in group.get("alert_rule_test", []))
    return out


def test_promtool_checks_the_rules() -> None:
    run = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in run.stdout + run.stderr


def _check_config(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`promtool check config`. Debian's promtool is built without Kubernetes service
    discovery (it refuses `kubernetes_sd_configs` as an unknown field): there, a copy
    with empty static targets in its place is checked, which still checks everything
    else (relabelling, rule files) of the file."""
    run = subprocess.run([_promtool(), "check", "config", str(path)],
                         capture_output=True, text=True, timeout=120)
    if "field kubernetes_sd_configs not found" not in run.stdout + run.stderr:
        return run
    doc = yaml.safe_load(path.read_text())
    for job in doc["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["static_configs"] = [{"targets": []}]
    copy = tmp_path / path.name
    copy.write_text(yaml.safe_dump(doc))
    shutil.copy(RULES, tmp_path / RULES.name)
    return subprocess.run([_promtool(), "check", "config", str(copy)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("config", ["prometheus.yml", "kubernetes.yml"])
def test_the_prometheus_configs_load_the_rules_and_name_the_jobs(config: str,
                                                                 tmp_path: Path) -> None:
    """The example (static targets) and the Kubernetes one (pods discovered): both valid,
    loading rules.yaml, with every job name the alerts use."""
    run = _check_config(PROM / config, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = yaml.safe_load((PROM / config).read_text())
    assert doc["rule_files"] == ["rules.yaml"]
    jobs = {j["job_name"] for j in doc["scrape_configs"]}
    named = set(re.findall(r'job="([a-z-]+)"', RULES.read_text()))
    assert named and named <= jobs


def test_a_broken_config_is_refused(tmp_path: Path) -> None:
    """The check above can fail, Kubernetes discovery or not."""
    doc = yaml.safe_load((PROM / "kubernetes.yml").read_text())
    doc["scrape_configs"][0]["relabel_configs"][0]["action"] = "kep"
    bad = tmp_path / "src" / "kubernetes.yml"
    bad.parent.mkdir()
    bad.write_text(yaml.safe_dump(doc))
    shutil.copy(RULES, bad.parent / RULES.name)
    assert _check_config(bad, tmp_path).returncode != 0


def test_promtool_unit_tests_pass() -> None:
    run = subprocess.run([_promtool(), "test", "rules", *map(str, _test_files())],
                         capture_output=True, text=True, timeout=300, cwd=PROM)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_alert_has_a_firing_and_a_silent_test() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for _group, case in _cases():
        (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - firing == set(), "alerts without a test that fires them"
    assert names - silent == set(), "alerts without a test that shows them silent"
    assert (firing | silent) - names == set(), "tests of alerts that do not exist"


def test_the_gateway_alert_is_tested_silent_on_every_client_error() -> None:
    seen: set[str] = set()
    for group, case in _cases():
        if case["alertname"] == "GearshiftGatewayUpstreamErrors" and not case["exp_alerts"]:
            for s in group["input_series"]:
                seen.update(re.findall(r'reason="([a-z_0-9]+)"', s["series"]))
    assert seen >= CLIENT_ERROR_REASONS


def test_the_gateway_alert_matches_exactly_the_upstream_reasons() -> None:
    rule = next(a for a in _alerts() if a["alert"] == "GearshiftGatewayUpstreamErrors")
    matched = re.search(r'gearshift_gateway_errors_total\{reason=~"([^"]+)"\}', rule["expr"])
    assert matched is not None, rule["expr"]
    assert set(matched.group(1).split("|")) == UPSTREAM_ERROR_REASONS


def test_the_proxy_emits_only_classified_reasons() -> None:
    """Every reason the gateway counts is either the client's or upstream (a new reason
    must be classified, and so reach the alert or be left out of it on purpose)."""
    tree = ast.parse((ROOT / "gateway" / "proxy.py").read_text())
    emitted = {call.args[1].value for call in ast.walk(tree)
               if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
               and call.func.attr == "error" and len(call.args) == 2
               and isinstance(call.args[1], ast.Constant)}
    assert emitted == CLIENT_ERROR_REASONS | UPSTREAM_ERROR_REASONS
    assert not CLIENT_ERROR_REASONS & UPSTREAM_ERROR_REASONS


def _anchors(markdown: str) -> set[str]:
    """GitHub-style anchors of the markdown's headings."""
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.MULTILINE)}


def test_every_alert_has_a_severity_annotations_and_a_runbook_section() -> None:
    anchors = _anchors(RUNBOOKS.read_text())
    for alert in _alerts():
        name = alert["alert"]
        assert alert.get("labels", {}).get("severity") in SEVERITIES, name
        notes = alert.get("annotations", {})
        assert notes.get("summary") and notes.get("description"), name
        assert notes.get("runbook_url") == f"docs/runbooks.md#{name.lower()}", name
        assert name.lower() in anchors, f"docs/runbooks.md has no section {name}"
