"""The metric names that the alert rules and the dashboard query, read from their PromQL.

Not a PromQL parser: it drops string literals, label matchers, range and subquery
brackets and the label lists of `by`/`without`/`on`/`ignoring`/`group_*`, and keeps the
identifiers that are neither functions (followed by a parenthesis) nor keywords. promtool
checks the same expressions' syntax (tests/unit/test_prometheus_rules.py and
test_grafana_dashboard.py), so what reaches this is valid PromQL.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gearshift.json"

KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on",
                      "ignoring", "group_left", "group_right", "inf", "nan", "atan2"})
# Grafana's interval variables, replaced by a fixed window where PromQL is checked
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "6h"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
PROMETHEUS_OWN = frozenset({"up"})  # written by Prometheus for each target, not exported


def metric_names(expr: str) -> set[str]:
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w:.$])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", s):
        if m.group(2) is None and m.group(1).lower() not in KEYWORDS:
            names.add(m.group(1))
    return names


def rule_exprs(path: Path = RULES) -> list[str]:
    doc = yaml.safe_load(path.read_text())
    return [str(r["expr"]) for g in doc["groups"] for r in g["rules"]]


def dashboard_exprs(path: Path = DASHBOARD) -> list[str]:
    dash = json.loads(path.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def with_fixed_windows(expr: str) -> str:
    for var, window in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, window)
    return expr


def exported(name: str, families: set[str]) -> bool:
    """Whether `name` as a query uses it is among the names a process exports (from its
    `# TYPE` lines and samples): a histogram's series count for the histogram."""
    if name in families:
        return True
    return any(name.endswith(sfx) and name[: -len(sfx)] in families
               for sfx in HISTOGRAM_SUFFIXES)
