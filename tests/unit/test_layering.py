"""The package layers, checked on every module's imports (module- and function-level).

Rules, with no exceptions list:
- the decision core (`policies`) imports no server (`controller`), wire (`gearshift.v1`,
  `grpc`), host (`agents`), `gateway`, `cli` or development-harness (`devfleet`) code, and
  nothing it imports from `common` may reach the wire either;
- `agents` and `gateway` import no `controller`, `cli` or harness code;
- `controller` imports no `agents`, `cli` or harness code;
- `common` imports none of the other gearshift packages;
- the harness package (`devfleet`) is imported only by `cli` (and tests and benchmarks,
  which are not packages);
- inside `controller`, its parts stack: `store` and `ha` at the bottom, then `ingest`
  (what hosts report), `moves` (migrations), `decisions` (the policy loop), and `api` and
  `enrolment` on top; a part imports no part above it, and none imports the composition
  root (`controller.server`, `controller.term`), which alone assembles the parts.
The packages are read from pyproject.toml's `package-dir`, so a new package is walked too.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

CORE = "gearshift.policies"
SERVER = "gearshift.controller"
WIRE = ("gearshift.v1", "grpc")
HOST = "gearshift.agents"
GATEWAY = "gearshift.gateway"
CLI = "gearshift.cli"
HARNESS = "gearshift.devfleet"
COMMON = "gearshift.common"
# The controller's parts (controller/<part>/) and its composition root.
API = f"{SERVER}.api"
DECISIONS = f"{SERVER}.decisions"
ENROLMENT = f"{SERVER}.enrolment"
HA = f"{SERVER}.ha"
INGEST = f"{SERVER}.ingest"
MOVES = f"{SERVER}.moves"
STORE = f"{SERVER}.store"
ROOT_MODULES = (f"{SERVER}.server", f"{SERVER}.term")

# Importing package -> the module prefixes it must not import.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    CORE: (SERVER, *WIRE, HOST, GATEWAY, CLI, HARNESS),
    HOST: (SERVER, CLI, HARNESS),
    GATEWAY: (SERVER, CLI, HARNESS),
    SERVER: (HOST, CLI, HARNESS),
    COMMON: (CORE, SERVER, HOST, GATEWAY, CLI, HARNESS),
    INGEST: (DECISIONS, MOVES, ENROLMENT, *ROOT_MODULES),
    MOVES: (DECISIONS, API, ENROLMENT, *ROOT_MODULES),
    DECISIONS: (API, ENROLMENT, HA, *ROOT_MODULES),
    HA: (INGEST, MOVES, DECISIONS, ENROLMENT, *ROOT_MODULES),
    API: ROOT_MODULES,
    STORE: (API, DECISIONS, *ROOT_MODULES),
    ENROLMENT: (INGEST, MOVES, DECISIONS, *ROOT_MODULES),
}
HARNESS_IMPORTERS = (CLI, HARNESS)


@dataclass(frozen=True)
class Edge:
    module: str     # the importing module
    imported: str   # the module it names
    where: str      # file:line

    def __str__(self) -> str:
        return f"{self.where}: {self.module} imports {self.imported}"


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """gearshift package name -> its directory, from pyproject.toml (setuptools package-dir)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: root / path for name, path in mapping.items() if name.startswith("gearshift.")}


def _module_name(package: str, base: Path, path: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from … import` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    anchor = module.split(".")
    anchor = anchor if is_package else anchor[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def imports_of(source: str, module: str, *, is_package: bool = False,
               filename: str = "<source>") -> Iterator[tuple[str, int]]:
    """Every module `source` imports, anywhere in it (functions and branches included).
    `from a import b` yields `a` and `a.b` (b may be a submodule)."""
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            yield base, node.lineno
            for alias in node.names:
                if alias.name != "*":
                    yield f"{base}.{alias.name}", node.lineno


def walk_edges(packages: dict[str, Path]) -> list[Edge]:
    """Every (module, imported module) edge in the given packages' sources."""
    edges: list[Edge] = []
    for package, base in sorted(packages.items()):
        if not base.is_dir():
            continue
        nested = [d for name, d in packages.items() if name != package and d != base
                  and base in d.parents]
        for path in sorted(base.rglob("*.py")):
            if any(d in path.parents for d in nested) or ".venv" in path.parts:
                continue  # a nested package is walked under its own name
            module = _module_name(package, base, path)
            for imported, line in imports_of(path.read_text(), module,
                                             is_package=path.name == "__init__.py",
                                             filename=str(path)):
                edges.append(Edge(module, imported, f"{path.relative_to(base.parent)}:{line}"))
    return edges


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(edges: list[Edge]) -> list[str]:
    """The edges that break a rule of the module docstring, each with the rule it breaks."""
    found: list[str] = []
    for edge in edges:
        for owner, banned in FORBIDDEN.items():
            if _within(edge.module, owner):
                found += [f"{edge} ({owner} must not import {b})"
                          for b in banned if _within(edge.imported, b)]
        if _within(edge.imported, HARNESS) and not any(
                _within(edge.module, p) for p in HARNESS_IMPORTERS):
            found.append(f"{edge} (only {CLI}, tests and benchmarks may import {HARNESS})")
    found += _core_reaches_wire(edges)
    return sorted(set(found))


def _core_reaches_wire(edges: list[Edge]) -> list[str]:
    """Core modules that reach wire code through another gearshift module (e.g. `common`)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.module, set()).add(edge.imported)
    found = []
    for start in sorted(m for m in graph if _within(m, CORE)):
        seen, stack, parent = {start}, [start], {start: ""}
        while stack:
            here = stack.pop()
            for nxt in sorted(graph.get(here, ())):
                if nxt in seen:
                    continue
                seen.add(nxt)
                parent[nxt] = here
                if any(_within(nxt, w) for w in WIRE) and here != start:
                    path = [nxt]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    found.append(f"{start} reaches wire code: {' -> '.join(reversed(path))}")
                elif nxt in graph:
                    stack.append(nxt)
    return found


def test_no_module_imports_across_a_forbidden_edge() -> None:
    packages = package_dirs()
    assert {CORE, SERVER, HOST, GATEWAY, CLI, COMMON} <= set(packages)
    edges = walk_edges(packages)
    assert len(edges) > 500  # the walk really read the tree
    broken = violations(edges)
    assert not broken, "forbidden imports:\n  " + "\n  ".join(broken)


def test_function_level_and_relative_imports_are_seen() -> None:
    source = ("import os\n"
              "def f():\n"
              "    from gearshift.controller.store.database import Store\n"
              "    if True:\n"
              "        import grpc.aio\n"
              "from . import spec\n"
              "from ..agents import daemon\n")
    got = {m for m, _ in imports_of(source, "gearshift.policies.core")}
    assert {"os", "gearshift.controller.store.database", "gearshift.controller.store.database.Store", "grpc.aio",
            "gearshift.policies.spec", "gearshift.agents.daemon"} <= got


@pytest.mark.parametrize(("module", "imported", "rule"), [
    ("gearshift.policies.core", "gearshift.controller.errors", "must not import gearshift.controller"),
    ("gearshift.policies.core", "grpc", "must not import grpc"),
    ("gearshift.policies.x", "gearshift.v1.agent_pb2", "must not import gearshift.v1"),
    ("gearshift.agents.daemon", "gearshift.controller.endpoints", "must not import gearshift.controller"),
    ("gearshift.gateway.server", "gearshift.cli.client", "must not import gearshift.cli"),
    ("gearshift.controller.moves.placement", "gearshift.agents.runtimes.spec", "must not import gearshift.agents"),
    ("gearshift.common.spec", "gearshift.policies.trace", "must not import gearshift.policies"),
    ("gearshift.controller.server", "gearshift.devfleet.local", "must not import gearshift.devfleet"),
    ("gearshift.common.x", "gearshift.devfleet", "only gearshift.cli, tests and benchmarks"),
    ("gearshift.controller.moves.orchestrator", "gearshift.controller.decisions.policy_loop",
     "must not import gearshift.controller.decisions"),
    ("gearshift.controller.ingest.fleet", "gearshift.controller.moves.machine",
     "must not import gearshift.controller.moves"),
    ("gearshift.controller.decisions.policy_loop", "gearshift.controller.api.control_actions",
     "must not import gearshift.controller.api"),
    ("gearshift.controller.api.control_service", "gearshift.controller.server",
     "must not import gearshift.controller.server"),
])
def test_each_rule_reports_its_edge(module: str, imported: str, rule: str) -> None:
    broken = violations([Edge(module, imported, "x.py:1")])
    assert any(rule in b for b in broken), broken


def test_allowed_edges_pass_and_the_core_may_not_reach_wire_through_common() -> None:
    allowed = [Edge("gearshift.cli.demo", "gearshift.devfleet.local", "a:1"),
               Edge("gearshift.controller.x", "gearshift.common.errors", "b:1"),
               Edge("gearshift.policies.core", "gearshift.common.engines", "c:1")]
    assert violations(allowed) == []
    through = [Edge("gearshift.policies.core", "gearshift.common.endpoints", "d:1"),
               Edge("gearshift.common.endpoints", "grpc", "e:1")]
    assert violations(through) == [
        "gearshift.policies.core reaches wire code: "
        "gearshift.policies.core -> gearshift.common.endpoints -> grpc"]


def test_package_dirs_come_from_pyproject(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "gearshift.devfleet" = "devfleet", "other" = "x" }\n')
    (tmp_path / "devfleet").mkdir()
    (tmp_path / "devfleet" / "fleet.py").write_text(
        "def up():\n    from gearshift.controller import server\n")
    packages = package_dirs(tmp_path)
    assert packages == {"gearshift.devfleet": tmp_path / "devfleet"}
    edges = walk_edges(packages)
    assert Edge("gearshift.devfleet.fleet", "gearshift.controller", "devfleet/fleet.py:2") in edges
