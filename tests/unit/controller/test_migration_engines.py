"""A model moves between any two engines of the catalog: the target's spec, deployment id,
backend, drain timeout and build step all follow the target's catalog entry, through
every phase of the same orchestrator the engine switch tests use."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from gearshift.common.engines import ENGINE_NAMES, engine_entry
from gearshift.common.spec import DeploymentSpec
from gearshift.controller.moves.store import MigrationPhase
from tests.unit.controller.test_orchestrator import Harness, make, phase_is  # noqa: F401

PAIRS = list(itertools.permutations(ENGINE_NAMES, 2))


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_a_move_between_two_engines_follows_the_catalog(
        make: Callable[..., Harness], source: str, target: str) -> None:  # noqa: F811
    h = make(trtllm_backend="tensorrt", drain_grace_s=20.0)
    for engine in ENGINE_NAMES:
        h.agents.latency[engine] = (0.45, 0.04)
    h.agents.run("h1", "src", source, (0,))
    h.restart()
    mid = h.orch.create("llama", source, target).id
    row = h.until(phase_is(MigrationPhase.DONE, MigrationPhase.ROLLED_BACK), mid, limit=90)
    assert row.phase is MigrationPhase.DONE, row.status_message
    entry = engine_entry(target)
    [started] = [c.start.spec for _, c in h.agents.sent if c.WhichOneof("action") == "start"]
    spec = DeploymentSpec.from_proto(started)  # valid for the target engine
    assert spec.engine == target and spec.backend == entry.backend_for("tensorrt")
    assert f"-{entry.launch.deployment_tag}-" in spec.deployment_id
    assert spec.shutdown_timeout_s == (20.0 if entry.drains_gracefully else 0.0)
    actions = [c.WhichOneof("action") for _, c in h.agents.sent]
    assert ("build" in actions) == entry.needs_build(spec.backend)
    assert actions[-2:] == ["drain", "stop"]
    assert h.weights() == {spec.deployment_id: (1.0, False)}
