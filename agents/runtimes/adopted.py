"""An engine process this agent did not spawn itself: one its predecessor started.

It is not our child, so it cannot be waited for with `waitpid`; its exit is seen
through a Linux pidfd (readable once the process has exited: at once, and
never confused with a later process that reuses the pid), or, where pidfds
are missing, by polling its start time. Its exit status belongs to its real
parent (init), so it is unknown here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from gearshift.agents.runtimes.engine_state import START_TIME_TOLERANCE_S, process_start_time

POLL_INTERVAL_S = 0.5  # exit detection where pidfds are not available


class AdoptedProcess:
    """The handful of `asyncio.subprocess.Process` operations the supervisor needs."""

    def __init__(self, pid: int, start_time: float) -> None:
        self.pid = pid
        self.start_time = start_time
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()
        self._fd: int | None = None
        self._poller: asyncio.Task[None] | None = None
        self._watch()

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self._poller = loop.create_task(self._poll())
            return
        if not self._same_process():
            # The pid was recycled between the check and the pidfd: it is not ours.
            os.close(fd)
            self._set_exited()
            return
        self._fd = fd
        loop.add_reader(fd, self._on_exit)

    def _same_process(self) -> bool:
        started = process_start_time(self.pid)
        return started is not None and abs(started - self.start_time) <= START_TIME_TOLERANCE_S

    async def _poll(self) -> None:
        while self._same_process():
            await asyncio.sleep(POLL_INTERVAL_S)
        self._set_exited()

    def _on_exit(self) -> None:
        self._close_fd()
        self._set_exited()

    def _close_fd(self) -> None:
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None

    def _set_exited(self) -> None:
        if self.returncode is None:
            self.returncode = -1  # unknown: the status went to the engine's real parent
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        if self._fd is not None:
            signal.pidfd_send_signal(self._fd, sig)  # cannot reach a recycled pid
        elif self._same_process():
            os.kill(self.pid, sig)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def close(self) -> None:
        """Stop watching (the process keeps running)."""
        self._close_fd()
        if self._poller is not None:
            self._poller.cancel()
        with contextlib.suppress(asyncio.InvalidStateError):
            if not self._exited.done():
                self._exited.cancel()
