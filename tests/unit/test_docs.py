"""The design lives in docs/: code cites it there, and the index lists what is cited."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
SOURCES = ("agents", "bench", "cli", "controller", "devfleet", "gateway", "policies", "scripts",
           "tests")
CITED = re.compile(r"docs/([a-z0-9-]+\.md)")


def _sources() -> list[Path]:
    return [p for d in SOURCES for p in (ROOT / d).rglob("*.py")] + [ROOT / "README.md"]


def test_no_comment_cites_a_design_document_outside_the_repository() -> None:
    stale = [f"{p.relative_to(ROOT)}:{i}" for p in _sources()
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "DESIGN §" in line and p.name != "test_docs.py"]
    assert stale == []


def test_every_cited_document_is_in_the_index() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    listed = set(re.findall(r"\]\(([a-z0-9-]+\.md)\)", index))
    cited = {m for p in _sources() for m in CITED.findall(p.read_text())}
    assert cited and cited <= listed, cited - listed
    for name in ("architecture.md", "decisions.md", "migrations.md", "cost-model.md"):
        assert name in listed and (ROOT / "docs" / name).is_file()
