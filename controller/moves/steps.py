"""The migration state machine: one step function per phase (docs/migrations.md).

`PhaseSteps.step` takes at most the next step of one move: place its targets
(`pending`), build TensorRT engines (`building`), start the early targets
(`starting`), watch them interval by interval (`warming`, `canary`, `promoting`),
retire the sources and start the late targets (`draining`), or put traffic back
on the sources (`rolling_back`). A `Failed` raised by any step rolls the move back.
It is composed of the ledger (`controller.moves.ledger`: saves and checked
transitions) and the agent commands (`controller.moves.commands`).
"""

from __future__ import annotations

from typing import Any

from gearshift.common.engines import engine_entry
from gearshift.controller.ingest.fleet import FleetState
from gearshift.controller.moves.canary import analyze
from gearshift.controller.moves.commands import (
    BROKEN_PHASES,
    FAILED_COMMAND_PHASES,
    READY,
    AgentCommands,
    Failed,
    OrchestratorSettings,
    deployment_phase_name,
    spec_proto,
)
from gearshift.controller.moves.ledger import MigrationLedger
from gearshift.controller.moves.machine import MigrationKind, MigrationPhase, TrialOutcome
from gearshift.controller.moves.placement import fleet_view, place_targets
from gearshift.controller.moves.store import MigrationRepository, MigrationRow
from gearshift.v1 import agent_pb2

P = MigrationPhase


class PhaseSteps:
    """The step function of each phase; `MigrationOrchestrator.tick` calls `step`."""

    def __init__(self, repo: MigrationRepository, fleet: FleetState, ledger: MigrationLedger,
                 commands: AgentCommands, settings: OrchestratorSettings) -> None:
        self._repo = repo
        self._fleet = fleet
        self._ledger = ledger
        self._cmd = commands
        self.settings = settings

    def step(self, row: MigrationRow) -> None:
        handler = {P.PENDING: self._pending, P.PULLING: self._pulling,
                   P.BUILDING: self._building,
                   P.STARTING: self._starting, P.WARMING: self._watch,
                   P.CANARY: self._watch, P.PROMOTING: self._watch,
                   P.DRAINING: self._draining, P.ROLLING_BACK: self._rolling_back}[row.phase]
        try:
            handler(row)
        except Failed as failed:
            self._ledger.go(row, P.ROLLING_BACK, failed.message)

    def _pending(self, row: MigrationRow) -> None:
        targets = place_targets(row, fleet_view(self._fleet, row, self._repo.rows(active_only=True)),
                                self.settings)
        row.target_specs = targets
        row.target_deployment_ids = [t["spec"]["deployment_id"] for t in targets]
        summary = ", ".join(
            f"{t['spec']['deployment_id']} on {t['host_id']} "
            + (f"replacing {t['replaces']}" + (" (late)" if t["late"] else "")
               if t["replaces"] else "surge") for t in targets)
        pulls = sorted(h for h in {t["host_id"] for t in targets}
                       if self._cmd.engine_image(h, row.to_engine))
        if pulls:
            self._ledger.go(row, P.PULLING, f"placed: {summary}; pulling the "
                                            f"{row.to_engine} image on {', '.join(pulls)}")
            return
        self._ledger.go(row, self._after_pull(row), f"placed: {summary}")

    def _after_pull(self, row: MigrationRow) -> MigrationPhase:
        target = engine_entry(row.to_engine)
        build = target.needs_build(target.backend_for(self.settings.trtllm_backend))
        return P.BUILDING if build else P.STARTING

    def _pulling(self, row: MigrationRow) -> None:
        """Each target host that runs the target engine from an image pulls it before any
        target starts, so that the move's window leaves out the download (a host program
        has nothing to pull: its agent answers at once)."""
        cmds = self._repo.commands(row.id)
        by_host = {t["host_id"]: t["spec"] for t in reversed(row.target_specs)}
        done, said = True, []
        for host_id in sorted(by_host):
            known = self._cmd.send(row, cmds, "prepare", host_id, host_id, agent_pb2.Command(
                prepare=agent_pb2.PrepareDeployment(spec=spec_proto(by_host[host_id]))))
            if known.phase in FAILED_COMMAND_PHASES:
                raise Failed(f"image pull on {host_id} {known.phase}: {known.message}")
            done = done and known.phase == "succeeded"
            said.append(f"{host_id}: {known.message}")
        if done:
            self._ledger.go(row, self._after_pull(row), "; ".join(said))
        elif self._ledger.elapsed_s(row) > self.settings.pull_timeout_s:
            raise Failed(f"image pull did not finish within {self.settings.pull_timeout_s:.0f} s"
                         f" ({'; '.join(said)})")

    def _building(self, row: MigrationRow) -> None:
        cmds = self._repo.commands(row.id)
        by_host = {t["host_id"]: t["spec"] for t in reversed(row.target_specs)}
        done = True
        for host_id in sorted(by_host):
            known = self._cmd.send(row, cmds, "build", host_id, host_id, agent_pb2.Command(
                build=agent_pb2.BuildEngine(spec=spec_proto(by_host[host_id]))))
            if known.phase in FAILED_COMMAND_PHASES:
                raise Failed(f"engine build on {host_id} {known.phase}: {known.message}")
            done = done and known.phase == "succeeded"
        if done:
            self._ledger.go(row, P.STARTING, f"engine built on {', '.join(sorted(by_host))}")
        elif self._ledger.elapsed_s(row) > self.settings.build_timeout_s:
            raise Failed(f"engine build did not finish within {self.settings.build_timeout_s:.0f} s")

    def _starting(self, row: MigrationRow) -> None:
        cmds = self._repo.commands(row.id)
        ready: dict[str, agent_pb2.DeploymentReport] = {}
        for t in row.target_specs:
            if t["late"]:
                continue
            host = t["host_id"]
            if t["replaces"] and not self._cmd.retire(row, cmds, t["replaces"], host):
                continue
            dep = self._cmd.start(row, cmds, "start", str(t["replica"]), host, t["spec"])
            if dep is not None:
                ready[dep.deployment_id] = dep
        early = [t for t in row.target_specs if not t["late"]]
        if len(ready) == len(early):
            row.target_restarts = {i: d.restarts for i, d in ready.items()}
            self._ledger.go(row, P.WARMING, f"{len(ready)} target replica(s) ready; warming "
                                     f"for {self.settings.warm_intervals} interval(s)")
        elif self._ledger.elapsed_s(row) > self.settings.command_timeout_s:
            raise Failed(f"target replicas not ready within {self.settings.command_timeout_s:.0f} s"
                         f" ({len(ready)} of {len(early)} ready)")

    def _candidates(self, row: MigrationRow, include_late: bool = False
                    ) -> list[tuple[str, agent_pb2.DeploymentReport]]:
        """The running targets; a missing, crashed or unhealthy one fails the move."""
        out = []
        for t in row.target_specs:
            if t["late"] and not include_late:
                continue
            dep_id, host = t["spec"]["deployment_id"], t["host_id"]
            dep = self._cmd.dep(host, dep_id)
            if dep is None:
                raise Failed(f"target {dep_id} disappeared from host {host}")
            if dep.phase in BROKEN_PHASES:
                raise Failed(f"target {dep_id} on {host} is {BROKEN_PHASES[dep.phase]}"
                             + (f": {dep.message}" if dep.message else ""))
            before = row.target_restarts.get(dep_id, dep.restarts)
            if dep.restarts > before:
                raise Failed(f"target {dep_id} on {host} crashed (restarts {before} -> "
                             f"{dep.restarts})")
            out.append((host, dep))
        return out

    def _fresh_interval(self, row: MigrationRow, deps: list[tuple[str, Any]]) -> bool:
        """True (and marked) once every candidate reported since the last counted interval."""
        stamps = [self._fleet.hosts[h].deployment_ts.get(d.deployment_id, 0.0) for h, d in deps]
        if not stamps or (row.observed_report_s is not None
                          and min(stamps) <= row.observed_report_s):
            return False
        row.observed_report_s = max(stamps)
        return True

    def _watch(self, row: MigrationRow) -> None:
        """Warming, canary and promoting: the candidate is watched interval by interval."""
        cands = self._candidates(row)
        if not self._fresh_interval(row, cands):
            return
        s = self.settings
        if row.phase is P.WARMING:
            row.healthy_intervals += 1
            if row.healthy_intervals < s.warm_intervals:
                self._ledger.save(row)
                return
            row.canary_step = 0
            row.error_marks = {d.deployment_id: d.errors_total for _h, d in cands}
            self._ledger.go(row, P.CANARY, self._step_note(row))
            return
        if row.phase is P.PROMOTING:
            self._ledger.go(row, P.DRAINING, "target served all traffic for one interval; draining "
                                      f"{len(row.source_deployment_ids)} source replica(s)")
            return
        self._analyze(row, cands)

    def _step_note(self, row: MigrationRow) -> str:
        share = row.canary_steps[row.canary_step]
        return f"canary step {row.canary_step + 1}/{len(row.canary_steps)}: target takes {share:.0%}"

    def _analyze(self, row: MigrationRow, cands: list[tuple[str, Any]]) -> None:
        s = self.settings
        sources = set(row.source_deployment_ids)
        baseline = [d for _h, d, _ts in self._fleet.deployments_of(row.model)
                    if d.deployment_id in sources and d.phase == READY]
        interval = max(self._fleet.hosts[h].interval_s for h, _d in cands)
        verdict = analyze([d for _h, d in cands], baseline, s.sla_for(row.model), s.tolerance,
                          errors_before=row.error_marks, interval_s=interval)
        row.error_marks = {d.deployment_id: d.errors_total for _h, d in cands}
        where = f"canary step {row.canary_step + 1}/{len(row.canary_steps)}"
        figures = {**verdict.figures, "step": row.canary_step + 1,
                   "share": row.canary_steps[row.canary_step]}
        row.last_figures = figures
        if verdict.outcome == "no_data":
            row.no_data_intervals += 1
            note = f"{where} paused: no data ({verdict.reasons[0]})"
            first = row.status_message != note
            row.status_message = note
            self._ledger.save(row, note if first else None, figures)
        elif verdict.outcome == "fail":
            row.failed_checks += 1
            msg = (f"{where}: failed check {row.failed_checks}/{s.max_failed_checks}: "
                   + "; ".join(verdict.reasons))
            if row.failed_checks >= s.max_failed_checks:
                self._ledger.go(row, P.ROLLING_BACK, msg, figures)
            else:
                self._ledger.save(row, msg, figures)
        else:
            row.healthy_intervals += 1
            row.status_message = ""
            if row.healthy_intervals < s.analysis_intervals:
                self._ledger.save(row)
            elif row.canary_step + 1 < len(row.canary_steps):
                row.canary_step += 1
                row.healthy_intervals = 0
                self._ledger.save(row, self._step_note(row), figures)
            elif row.kind is MigrationKind.TRIAL:
                row.trial_outcome = TrialOutcome.MEASURED
                row.reason = (f"trial complete: {row.to_engine} served "
                              f"{row.canary_steps[-1]:.0%} of traffic within the SLA for "
                              f"{s.analysis_intervals} interval(s)")
                self._ledger.go(row, P.ROLLING_BACK, row.reason, figures)
            else:
                self._ledger.go(row, P.PROMOTING, f"{where} passed; target takes all traffic", figures)

    def _draining(self, row: MigrationRow) -> None:
        # After promotion the target is what serves: a crash now is ridden out (its agent
        # restarts it) rather than rolled back, since the source is already leaving.
        for t in row.target_specs:
            if t["late"]:
                continue
            dep = self._cmd.dep(t["host_id"], t["spec"]["deployment_id"])
            if dep is None:
                raise Failed(f"target {t['spec']['deployment_id']} disappeared from host "
                             f"{t['host_id']}")
            if dep.phase != READY:
                row.target_restarts[dep.deployment_id] = dep.restarts
                note = (f"waiting: target {dep.deployment_id} is "
                        f"{BROKEN_PHASES.get(dep.phase, deployment_phase_name(dep.phase))}; its agent "
                        "restarts it")
                first = row.status_message != note
                row.status_message = note
                self._ledger.save(row, note if first else None)
                return
        cmds = self._repo.commands(row.id)
        late = [t for t in row.target_specs if t["late"]]
        replaced_late = {t["replaces"] for t in late}
        done = True
        for src in row.source_specs:
            dep_id = src["spec"]["deployment_id"]
            if dep_id not in replaced_late and not self._cmd.retire(row, cmds, dep_id, src["host_id"]):
                done = False
        for t in late:  # one by one: retire its source, start it, wait until ready
            if not self._cmd.retire(row, cmds, t["replaces"], t["host_id"]):
                done = False
                break
            dep = self._cmd.start(row, cmds, "start", str(t["replica"]), t["host_id"], t["spec"])
            if dep is None:
                done = False
                break
            row.target_restarts.setdefault(dep.deployment_id, dep.restarts)
        if done:
            self._ledger.go(row, P.DONE, f"{row.model} serves on {row.to_engine} "
                                  f"({len(row.target_specs)} replica(s)); sources stopped")

    def _rolling_back(self, row: MigrationRow) -> None:
        cmds = self._repo.commands(row.id)
        retired = [self._cmd.retire(row, cmds, t["spec"]["deployment_id"], t["host_id"],
                                f"{row.id}:start:{t['replica']}") for t in row.target_specs]
        if not all(retired):
            return  # sources are restored only once the targets freed their GPUs
        done = True
        notes = []
        for src in row.source_specs:
            dep_id, host = src["spec"]["deployment_id"], src["host_id"]
            if not any(cid.endswith(f":{dep_id}") and c.kind in ("drain", "stop")
                       for cid, c in cmds.items()):
                continue  # never touched by this move
            dep = self._cmd.dep(host, dep_id)
            if dep is not None and dep.phase == READY:
                continue
            if dep is not None and dep.phase == agent_pb2.DEPLOYMENT_PHASE_DRAINING and (
                    f"{row.id}:restore:{dep_id}" not in cmds):
                done = False  # still leaving; restore once it has stopped
                continue
            try:
                if self._cmd.start(row, cmds, "restore", dep_id, host, src["spec"]) is None:
                    done = False
            except Failed as failed:
                notes.append(f"source {dep_id} not restored: {failed.message}")
        if done:
            final = P.ABORTED if row.abort_requested else P.ROLLED_BACK
            if not row.abort_requested and row.trial_outcome is TrialOutcome.MEASURED:
                final = P.DONE  # a trial that measured what it came for is done
            if notes:
                row.reason = f"{row.reason}; {'; '.join(notes)}"
            self._ledger.go(row, final, f"traffic back on {row.from_engine}: {row.reason}")

