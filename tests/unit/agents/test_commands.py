"""Controller commands on the agent: a re-sent id runs once; an older epoch is refused."""

from __future__ import annotations

import asyncio

from gearshift.agents.commands import CommandExecutor
from gearshift.v1 import agent_pb2


def _stop(cid: str, epoch: int) -> agent_pb2.Command:
    return agent_pb2.Command(command_id=cid, epoch=epoch,
                             stop=agent_pb2.StopDeployment(deployment_id="d1"))


async def test_resent_command_runs_once_and_stale_epoch_is_rejected() -> None:
    results: list[agent_pb2.CommandResult] = []
    runs: list[str] = []

    async def stop(cmd: agent_pb2.Command, progress) -> str:  # type: ignore[no-untyped-def]
        runs.append(cmd.command_id)
        progress(0.5, "halfway")
        return "stopped"

    ex = CommandExecutor(results.append, {"stop": stop})
    ex.submit(_stop("c1", epoch=3))
    await asyncio.sleep(0.01)
    ex.submit(_stop("c1", epoch=3))   # re-sent after a reconnect
    await asyncio.sleep(0.01)
    assert runs == ["c1"]
    phases = [r.phase for r in results if r.command_id == "c1"]
    assert phases[:3] == [agent_pb2.COMMAND_PHASE_ACCEPTED, agent_pb2.COMMAND_PHASE_RUNNING,
                          agent_pb2.COMMAND_PHASE_SUCCEEDED]
    assert phases[-1] == agent_pb2.COMMAND_PHASE_SUCCEEDED  # the re-send answered with the result

    ex.submit(_stop("c2", epoch=2))   # from a deposed controller
    await asyncio.sleep(0.01)
    assert runs == ["c1"]
    assert results[-1].phase == agent_pb2.COMMAND_PHASE_REJECTED
    assert "stale epoch 2" in results[-1].message


async def test_failing_and_unknown_commands_report_why() -> None:
    results: list[agent_pb2.CommandResult] = []

    async def boom(cmd: agent_pb2.Command, progress) -> str:  # type: ignore[no-untyped-def]
        raise RuntimeError("no free GPU")

    ex = CommandExecutor(results.append, {"stop": boom})
    ex.submit(_stop("c1", 1))
    await asyncio.sleep(0.01)
    assert results[-1].phase == agent_pb2.COMMAND_PHASE_FAILED and "no free GPU" in results[-1].message
    ex.submit(agent_pb2.Command(command_id="c2", epoch=1,
                                drain=agent_pb2.DrainDeployment(deployment_id="d")))
    assert results[-1].phase == agent_pb2.COMMAND_PHASE_REJECTED
    assert "unsupported command action 'drain'" in results[-1].message
    await ex.close()
