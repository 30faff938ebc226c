"""Where the real captured engine outputs are: `../shared/fixtures/engine-metrics`
beside the repository when present (the source), else the copy in tests/fixtures."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SHARED = REPO.parent / "shared" / "fixtures" / "engine-metrics"
ENGINE_METRICS = _SHARED if _SHARED.is_dir() else REPO / "tests" / "fixtures" / "engine-metrics"
