"""Execution of controller commands on the agent: idempotent and fenced.

A command id that was seen before is a no-op that re-sends the last result
(so a command re-sent after a reconnect runs once). A command whose fencing
epoch is older than the newest epoch seen (in a command or in a controller's
welcome) is rejected. With a journal file, every command that runs is appended
to it as one JSON line (id, epoch, action, time): an audit of what ran, once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path

from gearshift.v1 import agent_pb2

log = logging.getLogger(__name__)

REMEMBERED_COMMANDS = 4096

Emit = Callable[[agent_pb2.CommandResult], None]
Handler = Callable[[agent_pb2.Command, Callable[[float, str], None]], Awaitable[str]]


class CommandExecutor:
    def __init__(self, emit: Emit, handlers: dict[str, Handler],
                 journal: Path | None = None) -> None:
        self._emit = emit
        self._journal = journal
        self._handlers = handlers
        self.max_epoch = 0
        self._results: OrderedDict[str, agent_pb2.CommandResult] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.executed = 0

    def _record(self, result: agent_pb2.CommandResult) -> None:
        self._results[result.command_id] = result
        self._results.move_to_end(result.command_id)
        while len(self._results) > REMEMBERED_COMMANDS:
            self._results.popitem(last=False)
        self._emit(result)

    def observe_epoch(self, epoch: int) -> None:
        """A controller leads with `epoch`: commands of older epochs are stale from now on."""
        self.max_epoch = max(self.max_epoch, epoch)

    def _log_run(self, cmd: agent_pb2.Command) -> None:
        if self._journal is None:
            return
        line = json.dumps({"command_id": cmd.command_id, "epoch": cmd.epoch,
                           "action": cmd.WhichOneof("action"), "ts": time.time()})
        try:
            with self._journal.open("a") as f:
                f.write(line + "\n")
        except OSError as exc:
            log.warning("command journal %s: cannot write: %s", self._journal, exc)

    def submit(self, cmd: agent_pb2.Command) -> None:
        if not cmd.command_id:
            log.warning("ignoring a command without an id")
            return
        known = self._results.get(cmd.command_id)
        if known is not None:
            log.info("command %s seen before; re-sending its last result", cmd.command_id)
            self._emit(known)
            return
        if cmd.epoch < self.max_epoch:
            self._record(agent_pb2.CommandResult(
                command_id=cmd.command_id, phase=agent_pb2.COMMAND_PHASE_REJECTED,
                message=f"stale epoch {cmd.epoch}: this agent has seen epoch {self.max_epoch}"))
            return
        self.max_epoch = cmd.epoch
        action = cmd.WhichOneof("action")
        handler = self._handlers.get(action or "")
        if handler is None:
            self._record(agent_pb2.CommandResult(
                command_id=cmd.command_id, phase=agent_pb2.COMMAND_PHASE_REJECTED,
                message=f"unsupported command action {action!r}"))
            return
        self._record(agent_pb2.CommandResult(
            command_id=cmd.command_id, phase=agent_pb2.COMMAND_PHASE_ACCEPTED))
        task = asyncio.create_task(self._run(cmd, handler))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, cmd: agent_pb2.Command, handler: Handler) -> None:
        def progress(fraction: float, message: str) -> None:
            self._record(agent_pb2.CommandResult(
                command_id=cmd.command_id, phase=agent_pb2.COMMAND_PHASE_RUNNING,
                progress=fraction, message=message))

        self.executed += 1
        self._log_run(cmd)
        try:
            message = await handler(cmd, progress)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("command %s (%s) failed: %s", cmd.command_id, cmd.WhichOneof("action"), exc)
            self._record(agent_pb2.CommandResult(
                command_id=cmd.command_id, phase=agent_pb2.COMMAND_PHASE_FAILED, message=str(exc)))
            return
        self._record(agent_pb2.CommandResult(
            command_id=cmd.command_id, phase=agent_pb2.COMMAND_PHASE_SUCCEEDED, progress=1.0,
            message=message))

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
