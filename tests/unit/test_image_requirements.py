"""The images' pinned dependencies (deploy/images/requirements.txt) are exact pins, cover
every runtime dependency of pyproject.toml, and satisfy its ranges."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "deploy" / "images" / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"not an exact pin: {line}"
        pins[_norm(req.name)] = spec.version
    return pins


def test_every_runtime_dependency_is_pinned_within_its_range() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = _pins()
    for raw in project["project"]["dependencies"]:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({"sys_platform": "linux"}):
            continue
        name = _norm(req.name)
        assert name in pins, f"{req.name} is not pinned in deploy/images/requirements.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"{req.name}=={pins[name]} is outside pyproject.toml's {req.specifier}"


def test_the_build_backend_is_pinned_within_its_range() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    pins = _pins()
    for raw in project["build-system"]["requires"]:
        req = Requirement(raw)
        assert req.specifier.contains(pins[_norm(req.name)]), (raw, pins[_norm(req.name)])
