"""Migration orchestrator: every phase of a move, rollbacks, pauses, restarts, capacity.

The fleet is a real `FleetState` fed with Hello/Report messages; the agents are
a small in-test stand-in behind the `send_command` seam that records every
command and applies it to the deployments it reports (the real agents are
exercised by the integration tests). One `cycle()` is one report interval.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa

from gearshift.common.engines import ENGINE_NAMES
from gearshift.common.errors import FailedPrecondition, InvalidArgument, NotFound
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.metrics import ControllerMetrics
from gearshift.controller.moves.canary import Sla
from gearshift.controller.moves.ledger import MigrationLedger
from gearshift.controller.moves.machine import IllegalTransition, MigrationKind, TrialOutcome
from gearshift.controller.moves.orchestrator import MigrationOrchestrator, OrchestratorSettings
from gearshift.controller.moves.store import MigrationPhase, MigrationRepository, MigrationRow
from gearshift.controller.store.database import Store
from gearshift.v1 import agent_pb2

P = MigrationPhase
READY = agent_pb2.DEPLOYMENT_PHASE_READY
INTERVAL_S = 1.0
SETTINGS = OrchestratorSettings(canary_steps=(0.1, 0.25, 0.5), analysis_intervals=2,
                                warm_intervals=1, max_failed_checks=2,
                                sla_for=lambda _m: Sla(ttft_p99_s=1.0, itl_p99_s=0.2))


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Agents:
    """Stand-in agents: execute commands on the next cycle, report their deployments."""

    gpus: dict[str, int]
    latency: dict[str, tuple[float, float] | None] = field(default_factory=lambda: {
        "vllm": (0.5, 0.05), "tensorrt-llm": (0.45, 0.04)})
    deps: dict[str, dict[str, agent_pb2.DeploymentReport]] = field(default_factory=dict)
    sent: list[tuple[str, agent_pb2.Command]] = field(default_factory=list)
    inbox: list[tuple[str, agent_pb2.Command]] = field(default_factory=list)
    silent: set[str] = field(default_factory=set)  # hosts that stopped reporting
    fail: dict[str, str] = field(default_factory=dict)  # action -> failure message
    drop: set[str] = field(default_factory=set)  # actions received and never answered
    seq: int = 0

    def send(self, host_id: str, cmd: agent_pb2.Command) -> bool:
        if host_id in self.silent:
            return False
        self.sent.append((host_id, cmd))
        self.inbox.append((host_id, cmd))
        return True

    def run(self, host_id: str, dep_id: str, engine: str, gpus: tuple[int, ...],
            revision: str = "r1") -> None:
        self.deps.setdefault(host_id, {})[dep_id] = agent_pb2.DeploymentReport(
            deployment_id=dep_id, engine=engine, model="llama", revision=revision, phase=READY,
            endpoint=f"http://{host_id}/{dep_id}", gpu_indices=list(gpus), request_rate=10.0)

    def execute(self, orch: MigrationOrchestrator) -> None:
        inbox, self.inbox = self.inbox, []
        for host_id, cmd in inbox:
            deps = self.deps.setdefault(host_id, {})
            action = cmd.WhichOneof("action")
            if action in self.drop:
                continue
            if action in self.fail:
                orch.on_command_result(host_id, agent_pb2.CommandResult(
                    command_id=cmd.command_id, phase=agent_pb2.COMMAND_PHASE_FAILED,
                    message=self.fail[action]))
                continue
            if action == "start":
                spec = cmd.start.spec
                self.run(host_id, spec.deployment_id, spec.engine, tuple(spec.gpu_indices),
                         spec.revision)
            elif action == "drain" and cmd.drain.deployment_id in deps:
                deps[cmd.drain.deployment_id].phase = agent_pb2.DEPLOYMENT_PHASE_STOPPED
            elif action == "stop":
                deps.pop(cmd.stop.deployment_id, None)
            orch.on_command_result(host_id, agent_pb2.CommandResult(
                command_id=cmd.command_id, phase=agent_pb2.COMMAND_PHASE_SUCCEEDED))

    def report(self, fleet: FleetState) -> None:
        self.seq += 1
        for host_id in self.gpus:
            if host_id in self.silent:
                continue
            for dep in self.deps.get(host_id, {}).values():
                lat = self.latency.get(dep.engine)
                dep.ClearField("ttft")
                dep.ClearField("itl")
                if lat is not None:
                    dep.ttft.present, dep.ttft.p99_s = True, lat[0]
                    dep.itl.present, dep.itl.p99_s = True, lat[1]
            fleet.report(host_id, agent_pb2.Report(
                seq=self.seq, interval_s=INTERVAL_S,
                deployments=list(self.deps.get(host_id, {}).values())))


class Harness:
    def __init__(self, tmp_path: Path, gpus: dict[str, int],
                 sources: list[tuple[str, str, tuple[int, ...]]],
                 settings: OrchestratorSettings = SETTINGS,
                 images: dict[str, str] | None = None) -> None:
        self.images = images or {}  # engines that run from images on every host
        self.url = f"sqlite:///{tmp_path / 'gs.db'}"
        self.store = Store.open(self.url)
        self.engine = sa.create_engine(self.url)
        self.repo = MigrationRepository(self.engine)
        self.clock = Clock()
        self.settings = settings
        self.agents = Agents(gpus=gpus)
        for host_id, dep_id, gpu in sources:
            self.agents.run(host_id, dep_id, "vllm", gpu)
        self.transitions: list[tuple[str, str]] = []
        self.metrics = ControllerMetrics()
        self.epoch = 0
        self.restart()

    def restart(self) -> None:
        """A controller (re)start: new fleet state, agents say hello and report."""
        self.epoch += 1
        self.fleet = FleetState(clock=self.clock)
        for host_id, n in self.agents.gpus.items():
            self.fleet.hello(agent_pb2.Hello(
                host_id=host_id, gpus=[agent_pb2.GpuInfo(index=i) for i in range(n)],
                engines=[agent_pb2.EngineInstall(engine=e, image=self.images.get(e, ""))
                         for e in ENGINE_NAMES]),
                INTERVAL_S)
        self.agents.report(self.fleet)
        self.orch = MigrationOrchestrator(
            self.repo, self.fleet, self.agents.send, epoch=self.epoch, clock=self.clock,
            settings=self.settings,
            on_transition=self._transition, on_created=self.metrics.migration_created)
        self.orch.install()

    def _transition(self, row: MigrationRow, before: MigrationPhase, to: MigrationPhase,
                    message: str) -> None:
        self.transitions.append((before.value, to.value))
        self.metrics.migration_transition(row, before, to, message)

    def metric(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def cycle(self) -> None:
        self.clock.t += INTERVAL_S
        self.agents.execute(self.orch)
        self.agents.report(self.fleet)
        self.orch.tick()

    def until(self, done: Callable[[MigrationRow], bool], mid: str, limit: int = 60) -> MigrationRow:
        for _ in range(limit):
            row = self.orch.get(mid)
            if done(row):
                return row
            self.cycle()
        raise AssertionError(f"not reached in {limit} cycles: {self.orch.get(mid)}")

    def weights(self) -> dict[str, tuple[float, bool]]:
        table = self.fleet.routing_table()
        return {e.deployment_id: (round(e.weight, 3), e.leaving)
                for m in table.models for e in m.endpoints}

    def commands(self) -> list[tuple[str, str]]:
        return [(h, c.command_id) for h, c in self.agents.sent]

    def close(self) -> None:
        self.engine.dispose()
        self.store.close()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def _make(gpus: dict[str, int] | None = None,
              sources: list[tuple[str, str, tuple[int, ...]]] | None = None,
              images: dict[str, str] | None = None, **overrides: object) -> Harness:
        settings = OrchestratorSettings(**{**SETTINGS.__dict__, **overrides})  # type: ignore[arg-type]
        h = Harness(tmp_path, gpus or {"h1": 2}, sources or [("h1", "src", (0,))], settings,
                    images)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.close()


def phase_is(*phases: MigrationPhase) -> Callable[[MigrationRow], bool]:
    return lambda row: row.phase in phases


def at_step(k: int) -> Callable[[MigrationRow], bool]:
    return lambda row: row.phase is P.CANARY and row.canary_step == k


def test_full_move_vllm_to_tensorrt_through_every_phase(make: Callable[..., Harness]) -> None:
    h = make(trtllm_backend="tensorrt")
    row = h.orch.create("llama", "vllm", "tensorrt-llm", decision_id="d-1")
    mid = row.id
    h.until(phase_is(P.WARMING), mid)
    tgt = h.orch.get(mid).target_deployment_ids[0]
    assert h.weights() == {"src": (1.0, False), tgt: (0.0, False)}  # no traffic before canary
    for k, share in enumerate((0.1, 0.25, 0.5)):
        h.until(at_step(k), mid)
        assert h.weights() == {"src": (round(1 - share, 3), False), tgt: (share, False)}
    h.until(phase_is(P.PROMOTING), mid)
    assert h.weights() == {"src": (0.0, False), tgt: (1.0, False)}
    row = h.until(phase_is(P.DONE), mid)
    assert h.weights() == {tgt: (1.0, False)}
    assert [s.to_phase for s in h.orch.steps(mid) if s.from_phase != s.to_phase] == [
        "pending", "building", "starting", "warming", "canary", "promoting", "draining", "done"]
    assert row.finished_at is not None and row.decision_id == "d-1"
    assert h.transitions[-1] == ("draining", "done")
    assert h.commands() == [("h1", f"{mid}:build:h1"), ("h1", f"{mid}:start:0"),
                            ("h1", f"{mid}:drain:src"), ("h1", f"{mid}:stop:src")]
    start = h.agents.sent[1][1]
    assert start.epoch == 1 and start.start.spec.engine == "tensorrt-llm"
    assert list(start.start.spec.gpu_indices) == [1] and start.start.spec.backend == "tensorrt"
    assert not h.orch.list(active_only=True) and h.orch.list()[0].id == mid


def test_no_data_pauses_the_canary_without_failing(make: Callable[..., Harness]) -> None:
    h = make()
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(0), mid)
    h.agents.latency["tensorrt-llm"] = None
    for _ in range(6):
        h.cycle()
    row = h.orch.get(mid)
    assert (row.phase, row.canary_step, row.failed_checks) == (P.CANARY, 0, 0)
    assert row.no_data_intervals >= 5 and "no data" in row.status_message
    assert h.weights()[row.target_deployment_ids[0]] == (0.1, False)
    h.agents.latency["tensorrt-llm"] = (0.45, 0.04)
    assert h.until(phase_is(P.DONE, P.ROLLED_BACK), mid).phase is P.DONE


def test_failing_canary_rolls_back_with_the_numbers(make: Callable[..., Harness]) -> None:
    h = make()
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(1), mid)
    h.agents.latency["tensorrt-llm"] = (2.0, 0.04)
    row = h.until(phase_is(P.ROLLED_BACK), mid)
    assert "canary step 2/3: failed check 2/2" in row.reason
    assert "candidate TTFT p99 2.000 s exceeds the SLA 1.000 s" in row.reason
    assert row.failed_checks == 2 and row.last_figures["candidate_ttft_p99_s"] == 2.0
    assert h.weights() == {"src": (1.0, False)}  # target stopped, all traffic on the source
    assert not any(":drain:src" in c or ":stop:src" in c for _h, c in h.commands())
    assert h.transitions[-2:] == [("canary", "rolling_back"), ("rolling_back", "rolled_back")]


def test_rolling_back_sends_no_traffic_to_the_target(make: Callable[..., Harness]) -> None:
    h = make(max_failed_checks=1)
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(0), mid)
    h.agents.latency["tensorrt-llm"] = (0.45, 0.9)
    h.until(phase_is(P.ROLLING_BACK), mid)
    tgt = h.orch.get(mid).target_deployment_ids[0]
    assert h.weights() == {"src": (1.0, False), tgt: (0.0, True)}


def test_candidate_crash_rolls_back(make: Callable[..., Harness]) -> None:
    h = make()
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(0), mid)
    tgt = h.orch.get(mid).target_deployment_ids[0]
    h.agents.deps["h1"][tgt].restarts = 1
    row = h.until(phase_is(P.ROLLED_BACK), mid)
    assert f"target {tgt} on h1 crashed (restarts 0 -> 1)" in row.reason
    assert h.weights() == {"src": (1.0, False)}


def test_restarted_controller_resumes_without_new_command_ids(
        make: Callable[..., Harness]) -> None:
    h = make(trtllm_backend="tensorrt")
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(1), mid)
    sent_before = h.commands()
    h.restart()  # new FleetState and orchestrator over the same database
    assert h.orch.get(mid).canary_step == 1
    tgt = h.orch.get(mid).target_deployment_ids[0]
    assert h.weights() == {"src": (0.75, False), tgt: (0.25, False)}
    h.until(phase_is(P.DONE), mid)
    ids = [c for _h, c in h.commands()]
    assert len(ids) == len(set(ids)), "a command id was sent twice"
    assert h.commands()[:len(sent_before)] == sent_before
    assert ids[len(sent_before):] == [f"{mid}:drain:src", f"{mid}:stop:src"]
    assert {c.epoch for _h, c in h.agents.sent[len(sent_before):]} == {2}


def test_abort_rolls_back_then_ends_aborted(make: Callable[..., Harness]) -> None:
    h = make()
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(0), mid)
    assert h.orch.abort(mid, "operator said so").phase is P.ROLLING_BACK
    row = h.until(phase_is(P.ABORTED), mid)
    assert row.reason == "aborted: operator said so"
    assert h.weights() == {"src": (1.0, False)}
    with pytest.raises(FailedPrecondition, match="already aborted"):
        h.orch.abort(mid, "again")
    with pytest.raises(NotFound, match="m-nope"):
        h.orch.abort("m-nope", "x")


def test_create_refuses_bad_requests(make: Callable[..., Harness]) -> None:
    h = make()
    first = h.orch.create("llama", "vllm", "tensorrt-llm")
    with pytest.raises(FailedPrecondition, match=f"already has an active migration {first.id}"):
        h.orch.create("llama", "vllm", "tensorrt-llm")
    with pytest.raises(InvalidArgument, match="both 'vllm'"):
        h.orch.create("other", "vllm", "vllm")
    with pytest.raises(InvalidArgument, match="'other' has no ready deployment on vllm"):
        h.orch.create("other", "vllm", "tensorrt-llm")
    with pytest.raises(InvalidArgument, match="'tgi' is not one of"):
        h.orch.create("other", "vllm", "tgi")
    with pytest.raises(InvalidArgument, match="target_revision"):
        h.orch.create("other", "vllm", "vllm", kind="revision_rollout")


def test_unreachable_host_pauses_and_then_resumes(make: Callable[..., Harness]) -> None:
    h = make()
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(0), mid)
    sent = len(h.agents.sent)
    h.agents.silent.add("h1")
    for _ in range(8):
        h.cycle()
    row = h.orch.get(mid)
    assert (row.phase, row.canary_step, row.failed_checks) == (P.CANARY, 0, 0)
    assert "host h1 is unreachable" in row.status_message
    assert len(h.agents.sent) == sent  # nothing drained or stopped because of "unknown"
    h.agents.silent.clear()
    assert h.until(phase_is(P.DONE, P.ROLLED_BACK), mid).phase is P.DONE


def test_replace_replica_by_replica_when_no_gpu_is_free(make: Callable[..., Harness]) -> None:
    h = make(gpus={"h1": 1, "h2": 1}, sources=[("h1", "s1", (0,)), ("h2", "s2", (0,))])
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(0), mid)
    row = h.orch.get(mid)
    t0, t1 = row.target_deployment_ids
    assert [(t["host_id"], t["replaces"], t["late"]) for t in row.target_specs] == [
        ("h1", "s1", False), ("h2", "s2", True)]
    assert h.weights() == {"s2": (0.9, False), t0: (0.1, False)}  # s2 keeps serving
    h.until(phase_is(P.DONE), mid)
    assert h.weights() == {t0: (0.5, False), t1: (0.5, False)}
    ids = [c.removeprefix(f"{mid}:") for _h, c in h.commands()]
    assert ids == ["drain:s1", "stop:s1", "start:0", "drain:s2", "stop:s2", "start:1"]


def test_no_capacity_and_min_available_waits_in_pending(make: Callable[..., Harness]) -> None:
    h = make(gpus={"h1": 1})
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    for _ in range(3):
        h.cycle()
    row = h.orch.get(mid)
    assert row.phase is P.PENDING and "min_available=1" in row.status_message
    assert h.agents.sent == [] and h.weights() == {"src": (1.0, False)}


def test_rollback_after_replacing_restores_the_source(make: Callable[..., Harness]) -> None:
    h = make(gpus={"h1": 1, "h2": 1}, sources=[("h1", "s1", (0,)), ("h2", "s2", (0,))])
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(0), mid)
    h.orch.abort(mid, "changed my mind")
    row = h.until(phase_is(P.ABORTED), mid)
    assert row.reason == "aborted: changed my mind"
    assert h.weights() == {"s1": (0.5, False), "s2": (0.5, False)}
    ids = [c.removeprefix(f"{mid}:") for _h, c in h.commands()]
    assert ids[3:] == [f"drain:{row.target_deployment_ids[0]}",
                       f"stop:{row.target_deployment_ids[0]}", "restore:s1"]


def test_failed_engine_build_rolls_back(make: Callable[..., Harness]) -> None:
    h = make(trtllm_backend="tensorrt")
    h.agents.fail["build"] = "engine builds are not supported by this agent version"
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    row = h.until(phase_is(P.ROLLED_BACK), mid)
    assert row.reason == ("engine build on h1 failed: engine builds are not supported by this "
                          "agent version")
    assert h.weights() == {"src": (1.0, False)}


def test_failed_start_rolls_back_with_the_agents_message(make: Callable[..., Harness]) -> None:
    h = make()
    h.agents.fail["start"] = "out of memory"
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    row = h.until(phase_is(P.ROLLED_BACK), mid)
    assert row.reason == f"start of {row.target_deployment_ids[0]} on h1 failed: out of memory"


TRT_IMAGE = {"tensorrt-llm": "nvcr.io/nvidia/tensorrt-llm/release:1.2.0"}


def test_a_target_that_runs_from_an_image_is_pulled_before_it_starts(
        make: Callable[..., Harness]) -> None:
    h = make(images=TRT_IMAGE)
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(phase_is(P.DONE), mid)
    assert h.transitions[:3] == [("pending", "pulling"), ("pulling", "starting"),
                                 ("starting", "warming")]
    actions = [c.WhichOneof("action") for _h, c in h.agents.sent]
    assert actions.index("prepare") < actions.index("start")
    [prepare] = [c for _h, c in h.agents.sent if c.WhichOneof("action") == "prepare"]
    assert prepare.prepare.spec.engine == "tensorrt-llm"


def test_a_move_to_a_host_program_has_no_pulling_phase(make: Callable[..., Harness]) -> None:
    h = make(images={"vllm": "docker.io/vllm/vllm-openai:v0.11.0"})  # the source's only
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(phase_is(P.DONE), mid)
    assert ("pending", "starting") in h.transitions
    assert all(c.WhichOneof("action") != "prepare" for _h, c in h.agents.sent)


def test_a_failed_pull_rolls_back_with_the_runtimes_message(
        make: Callable[..., Harness]) -> None:
    h = make(images=TRT_IMAGE)
    h.agents.fail["prepare"] = "podman: pull x: manifest unknown"
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    row = h.until(phase_is(P.ROLLED_BACK), mid)
    assert row.reason == "image pull on h1 failed: podman: pull x: manifest unknown"
    assert all(c.WhichOneof("action") != "start" for _h, c in h.agents.sent)
    assert h.weights() == {"src": (1.0, False)}


def test_a_pull_past_its_own_deadline_rolls_back(make: Callable[..., Harness]) -> None:
    h = make(images=TRT_IMAGE, pull_timeout_s=5.0, command_timeout_s=600.0)
    h.agents.drop.add("prepare")
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    row = h.until(phase_is(P.ROLLED_BACK), mid)
    assert row.reason.startswith("image pull did not finish within 5 s"), row.reason


def test_target_never_ready_rolls_back_after_the_timeout(make: Callable[..., Harness]) -> None:
    h = make(command_timeout_s=5.0)
    h.agents.drop.add("start")
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    row = h.until(phase_is(P.ROLLED_BACK), mid)
    assert row.reason == "target replicas not ready within 5 s (0 of 1 ready)"
    tgt = row.target_deployment_ids[0]
    assert (f"{mid}:stop:{tgt}" in [c for _h, c in h.commands()])  # in case it comes up late


def test_revision_rollout_moves_to_the_new_revision(make: Callable[..., Harness]) -> None:
    h = make()
    mid = h.orch.create("llama", "vllm", "vllm", kind="revision_rollout",
                        target_revision="r2").id
    row = h.until(phase_is(P.DONE), mid)
    (dep,) = h.agents.deps["h1"].values()
    assert (dep.deployment_id, dep.engine, dep.revision) == (
        row.target_deployment_ids[0], "vllm", "r2")


@pytest.mark.parametrize("phase,word", [(agent_pb2.DEPLOYMENT_PHASE_STARTING, "starting"),
                                        (agent_pb2.DEPLOYMENT_PHASE_BUILDING, "building")])
def test_draining_waits_for_a_target_that_is_not_ready_naming_its_phase(
        make: Callable[..., Harness], phase: int, word: str) -> None:
    h = make()
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(phase_is(P.DRAINING), mid)
    tgt = h.orch.get(mid).target_deployment_ids[0]
    h.agents.deps["h1"][tgt].phase = phase  # e.g. restarted by its agent meanwhile
    h.agents.report(h.fleet)
    h.orch.tick()
    row = h.orch.get(mid)
    assert row.phase is P.DRAINING
    assert f"target {tgt} is {word}; its agent restarts it" in row.status_message


def test_trial_measures_the_target_then_ends_done_on_the_source(
        make: Callable[..., Harness]) -> None:
    h = make()
    row = h.orch.create("llama", "vllm", "tensorrt-llm", kind="trial", trial_share=0.2)
    assert row.kind is MigrationKind.TRIAL and row.canary_steps == [0.2]
    tgt = h.until(at_step(0), row.id).target_deployment_ids[0]
    assert h.weights()[tgt] == (0.2, False)
    end = h.until(phase_is(P.DONE, P.ROLLED_BACK, P.ABORTED), row.id)
    assert (end.phase, end.trial_outcome) == (P.DONE, TrialOutcome.MEASURED)
    assert h.weights() == {"src": (1.0, False)}  # back on the source, which never left
    assert h.transitions[-2:] == [("canary", "rolling_back"), ("rolling_back", "done")]


def test_trial_that_fails_its_checks_ends_rolled_back_as_failed(
        make: Callable[..., Harness]) -> None:
    h = make()
    row = h.orch.create("llama", "vllm", "tensorrt-llm", kind="trial", trial_share=0.2)
    h.until(at_step(0), row.id)
    h.agents.latency["tensorrt-llm"] = (2.0, 0.04)
    end = h.until(phase_is(P.DONE, P.ROLLED_BACK, P.ABORTED), row.id)
    assert (end.phase, end.trial_outcome) == (P.ROLLED_BACK, TrialOutcome.FAILED)


def test_an_illegal_transition_raises_and_saves_nothing(make: Callable[..., Harness]) -> None:
    h = make()
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(0), mid)
    ledger = MigrationLedger(h.repo, h.clock)
    row = h.orch.get(mid)
    with pytest.raises(IllegalTransition, match=r"illegal transition canary -> done; from canary "
                                                r"only promoting, rolling_back"):
        ledger.go(row, P.DONE, "skipping the promotion")
    stored = h.orch.get(mid)
    assert stored.phase is P.CANARY
    assert [s.to_phase for s in h.orch.steps(mid)][-1] == "canary"
    # An engine switch never ends `done` from a rollback: only a measured trial does.
    h.orch.abort(mid, "test")
    with pytest.raises(IllegalTransition, match="only a trial that measured its target"):
        ledger.go(h.orch.get(mid), P.DONE, "pretending it moved")
    assert h.orch.get(mid).phase is P.ROLLING_BACK


def test_metrics_count_a_move_its_phases_its_end_and_its_duration(
        make: Callable[..., Harness]) -> None:
    h = make()
    started_at = h.clock.t
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    kind = "engine_switch"
    assert h.metric("gearshift_controller_migrations_started_total", kind=kind) == 1
    assert h.metric("gearshift_controller_migrations_ended_total", kind=kind,
                    result="done") == 0  # exported before the first end
    row = h.until(phase_is(P.DONE), mid)
    for phase in ("starting", "warming", "canary", "promoting", "draining", "done"):
        assert h.metric("gearshift_controller_migration_transitions_total", kind=kind,
                        phase=phase) == 1, phase
    assert h.metric("gearshift_controller_migrations_ended_total", kind=kind, result="done") == 1
    assert h.metric("gearshift_controller_migrations_ended_total", kind=kind,
                    result="rolled_back") == 0
    assert h.metric("gearshift_controller_migration_duration_seconds_count", kind=kind,
                    result="done") == 1
    assert row.finished_at is not None
    assert h.metric("gearshift_controller_migration_duration_seconds_sum", kind=kind,
                    result="done") == pytest.approx(row.finished_at.timestamp() - started_at)


def test_metrics_count_a_rollback_by_its_result(make: Callable[..., Harness]) -> None:
    h = make()
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.until(at_step(0), mid)
    h.agents.latency["tensorrt-llm"] = (2.0, 0.04)
    h.until(phase_is(P.ROLLED_BACK), mid)
    assert h.metric("gearshift_controller_migrations_ended_total", kind="engine_switch",
                    result="rolled_back") == 1
    assert h.metric("gearshift_controller_migrations_ended_total", kind="engine_switch",
                    result="done") == 0
    assert h.metric("gearshift_controller_migration_transitions_total", kind="engine_switch",
                    phase="rolling_back") == 1


def test_a_move_waiting_past_its_phase_deadline_is_stuck(make: Callable[..., Harness]) -> None:
    h = make(gpus={"h1": 1}, stuck_after_s=10.0)  # no free GPU: waits in pending
    mid = h.orch.create("llama", "vllm", "tensorrt-llm").id
    h.cycle()
    [row] = h.orch.active()
    assert row.id == mid and row.phase is P.PENDING and not h.orch.stuck(row)
    for _ in range(10):
        h.cycle()
    [row] = h.orch.active()
    assert row.phase is P.PENDING and h.orch.stuck(row)  # reported, nothing done about it
    assert h.agents.sent == []
    settings = h.orch.settings
    assert settings.phase_deadline_s(P.PENDING) == 10.0
    assert settings.phase_deadline_s(P.BUILDING) == settings.build_timeout_s + 10.0
    with pytest.raises(InvalidArgument, match="stuck_after_s"):
        make(stuck_after_s=0.0)
