"""Ingest benchmark: many simulated agents report to one controller over real gRPC.

    python bench/ingest.py --agents 500 --deployments-per-agent 8 --interval-s 10 --duration-s 30

The controller runs as its own process (`gearshift controller`, SQLite store in a
temp dir). Simulated agents run in `--workers` separate processes, each holding
many agents on one event loop (uvloop; `--agent-loop asyncio` for asyncio's); every
agent has its own bidirectional stream on its own HTTP/2 connection, as agent hosts
connect (`--agents-per-channel N`: N streams share one instead, which costs gRPC less
per report and per agent than a fleet's connections do). An agent starts at a random
moment within the first interval (as a fleet coming up does), sends Hello, waits for
Welcome, then sends a Report with N deployment samples every interval on a fixed
schedule, times its Ack and sends the next report one interval after the last. Reports are serialized once per agent;
only the sequence number changes.

The agents speak gRPC with HTTP/2 frames written by hand (`bench/agent_wire.py`): to
the controller the same bytes on the wire as gRPC's own client sends, at about a
third of that client's CPU per report, so that the machine's CPU goes to the
controller being measured. `--agent-client grpc` runs them on gRPC's asyncio client
instead (each report then costs the simulator about as much as the controller).

Prints one JSON object:
  server, agents, interval_s, reports_per_s, ack_p50_ms, ack_p99_ms,
  controller_cpu_s_per_1k_reports, controller_cores, controller_rss_mb,
  controller_peak_rss_mb, lost_reports,
  streams_failed, stream_errors, connect_p50_ms, connect_max_ms, all_connected_s, report_bytes,
  server_pings_per_report, agent_processes, pinned, controller_fds, controller_fd_limit, agent_cores,
  agent_max_process_cores, agent_loop_lag_p99_ms, agent_loop_stalls_over_50ms,
  machine_cores, machine_count, machine_nice_cores, other_cores, controller_split
`--floor` serves the same agents with gRPC's floor instead of the controller
(`bench/grpc_floor.py`: the controller's server options and event loop, every message
read and every report acked, nothing validated, applied or kept; `server` says which
ran, and the controller_* figures are then the floor's): what gRPC's asyncio server
costs this fleet before the controller does any work of its own.
Controller CPU is read from the controller process over the measured window, and
split by thread (`controller_split`): the event loop (the main thread), the store
writer (named `gs-store-writer`), the rest (gRPC's own threads), and the garbage
collector's pauses (from the controller's metrics, inside the thread that ran it);
`handle_cores` and `handle_us_per_report` are the event loop's share spent applying
reports (validation, the fleet's state, the rollups; the controller's
``gearshift_controller_report_handle_seconds``), the rest of the loop's being gRPC's
reads and writes and the loop itself;
`loop_stalls_over_50ms` counts the event loop's wake-ups that came over 50 ms late
and `loop_stall_max_under_s` bounds its longest stall (both from
``gearshift_controller_event_loop_lag_seconds``).
`agent_cores` is the simulated agents' own CPU over the window (all processes;
`agent_max_process_cores` the busiest one: near 1.0 it, not the controller, is the
bottleneck). `streams_failed` counts agent streams that ended in an error, and
`stream_errors` the first distinct errors (with where they happened: connect or
stream) and how many streams each ended; `connect_p50_ms` / `connect_max_ms` time
an agent's stream from opening to its Welcome (during the start-up burst new
streams wait in gRPC core's queue until the controller takes them), and
`all_connected_s` how long after the start the last agent got its Welcome. The
measured window (`--duration-s`) opens one interval after every agent is
connected, so acks and CPU describe the fleet in steady state and the start-up
burst shows in the connect figures only. `report_bytes` is one report's
serialized size. `server_pings_per_report`: the HTTP/2 PINGs the server sent in the window
(keepalive and, where enabled, gRPC's bandwidth-delay probe, which pings for the first DATA
frame a connection reads once its delay, 100 ms growing towards 10 s, has passed), per report; null with gRPC's client, which
answers them unseen. `controller_fds` is the controller's open files at the window's
start, every agent connected. `lost_reports` counts reports sent in the measured window that
were not acked by ACK_GRACE_S after it. `controller_rss_mb` is the controller's RSS at the window's end,
`controller_peak_rss_mb` its largest so far (VmHWM: the connect burst's, usually).

The acks are timed by the simulator, so its own delays are in them: every simulator
process probes its event loop as the controller does (`agent_loop_lag_p99_ms`, and
`agent_loop_stalls_over_50ms` over all of them). The controller and the simulator
share the machine's cores, and so does anything else running:
`machine_cores` is the whole machine's busy CPU over the window (`machine_count`
cores) and `other_cores` what neither the controller nor the simulator used (near 0:
a quiet machine; a figure taken with other work running says so here), of which
`machine_nice_cores` ran at a lower priority (nice), which the scheduler gives way to
the controller and the simulator. `--pin` runs
the controller on core 0 alone and the simulator on the others (`pinned` names
them; null without it), so that neither waits for the other's CPU: a fairer view of
the controller itself, to be reported beside the unpinned figure, never instead of it.

At 10,000 agents x 8 deployments every 10 s (the command in the first line with
--agents 10000 --duration-s 40) on a 2-core machine (1e7-add loop 1.3-1.7 s) with
nothing else running, the controller on uvloop: 0.60-0.64 core, ack p50 0.7-0.8 ms and
p99 6-18 ms, the simulator 0.18-0.21 core on frames; with gRPC's client the simulator
took 0.40-0.51 core and the p99 was 37-272 ms. No failed stream or lost report in any
run; the figures and the paired runs are in docs/performance.md. Those runs had a
hundred agents to a connection; with a connection per agent (now the default) and gRPC's
bandwidth-delay probe off, on a machine whose 1e7-add loop took 0.3 s: 0.54-0.67 core,
ack p99 9-24 ms, 606-627 MB at the window's end and a peak of 720-734 MB (seven runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import agent_wire
import psutil
from machine import MachineWatch

from gearshift.controller.limits import raise_open_files_limit

WARMUP_S = 3.0  # worker processes importing and starting their loops
# Agents per simulator process by default: at 10 s intervals one process runs about
# 1,000 streams at a small share of a core, so it never becomes what is measured.
AGENTS_PER_WORKER = 1000
ACK_GRACE_S = 2.0  # how long an agent waits for its last ack after the window
CONNECT_TIMEOUT_S = 120.0  # the window opens then even if some agents are not connected
CONTROLLER_CPU = 0  # with --pin: the controller's core
LAG_PROBE_S = 0.05  # the simulator's loop-lag probe, as the controller's (controller.loop_lag)
HANDLE_SUM = "gearshift_controller_report_handle_seconds_sum"  # the loop applying reports
HANDLE_COUNT = "gearshift_controller_report_handle_seconds_count"


def _deployment(agent: int, i: int, rng: random.Random) -> Any:
    from gearshift.v1 import agent_pb2

    d = agent_pb2.DeploymentReport(
        deployment_id=f"a{agent}-d{i}", engine="vllm" if i % 2 else "tensorrt-llm",
        engine_version="0.11.0", model=f"model-{(agent * 8 + i) % 200}", revision="r1",
        phase=agent_pb2.DEPLOYMENT_PHASE_READY, endpoint=f"http://127.0.0.1:{8000 + i}",
        request_rate=rng.uniform(1, 50), running_requests=rng.randint(0, 64),
        waiting_requests=rng.randint(0, 8), prompt_tokens_per_s=rng.uniform(100, 5000),
        generation_tokens_per_s=rng.uniform(100, 5000), kv_cache_usage=rng.random(),
        errors_total=0, metrics_present=True)
    for q in (d.ttft, d.itl, d.e2e):
        q.present, q.p50_s, q.p99_s, q.mean_s, q.count = True, 0.05, 0.2, 0.07, 100
    return d


class _StreamError(Exception):
    """A simulated agent's stream ended: where (connect or stream) and the status."""


def _error_kind(exc: BaseException) -> str:
    """An error's text without the numbers that make every agent's unique."""
    text = str(exc) if isinstance(exc, _StreamError) else f"{type(exc).__name__}: {exc}"
    return re.sub(r"\d+", "N", text)[:200]


class _Stats:
    def __init__(self) -> None:
        self.acks: list[float] = []
        self.sent = 0
        self.lost = 0
        self.connected = 0
        self.connect_ms: list[float] = []  # stream opened -> Welcome read
        self.errors: list[str] = []
        self.cpu_window: list[float] = []  # this process's CPU seconds at the window's start, end
        self.pings_window: list[int] = []  # the server's PINGs on this process's connections, too
        self.lags_ms: list[float] = []  # how late this loop woke, per probe in the window


class _Window:
    """The measured window, set by the parent once every agent is connected: wall-clock
    start and end in shared memory (inf until then), read as this loop's times."""

    def __init__(self, shared: Any, offset: float) -> None:
        self._shared, self._offset = shared, offset  # offset: wall clock -> loop clock

    @property
    def start(self) -> float:
        return float(self._shared[0]) + self._offset

    @property
    def end(self) -> float:
        return float(self._shared[1]) + self._offset


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class _ReportBytes:
    """One agent's `AgentMessage` reports, serialized once: only the sequence number
    (`Report.seq`, field 1, written first as protobuf does) changes from one to the next,
    so a report costs a few byte joins instead of a message serialization."""

    def __init__(self, report: Any) -> None:
        report.ClearField("seq")
        self._rest = report.SerializeToString()

    def __call__(self, seq: int) -> bytes:
        body = b"\x08" + _varint(seq) + self._rest
        return b"\x12" + _varint(len(body)) + body  # AgentMessage.report (field 2)


class _AckSeqs:
    """The sequence number of an ack given as bytes (the stream passes bytes through, see
    `_connect_method`): acks repeat across agents, so each distinct one is parsed once."""

    def __init__(self) -> None:
        self._seen: dict[bytes, int] = {}

    def __call__(self, data: bytes) -> int | None:
        seq = self._seen.get(data)
        if seq is None:
            from gearshift.v1 import agent_pb2

            msg = agent_pb2.ControllerMessage.FromString(data)
            if msg.WhichOneof("body") != "ack":
                return None
            seq = self._seen[data] = msg.ack.seq
        return seq


CONNECT_PATH = "/gearshift.v1.AgentService/Connect"


def _connect_method(channel: Any) -> Any:
    """`AgentService.Connect` on a gRPC channel, taking and giving serialized messages."""
    return channel.stream_stream(CONNECT_PATH, request_serializer=None,
                                 response_deserializer=None)


def _messages(idx: int, args: argparse.Namespace) -> tuple[bytes, _ReportBytes]:
    """An agent's Hello and its reports, serialized."""
    from gearshift.v1 import agent_pb2

    rng = random.Random(idx)
    report = agent_pb2.Report(interval_s=args.interval_s)
    report.deployments.extend(
        _deployment(idx, i, rng) for i in range(args.deployments_per_agent))
    hello = agent_pb2.AgentMessage()
    hello.hello.host_id = f"bench-{idx}"
    hello.hello.agent_version = "bench"
    hello.hello.protocol_version = agent_pb2.PROTOCOL_VERSION_1
    hello.hello.emulated_gpus = True
    for g in range(8):
        hello.hello.gpus.add(index=g, model="NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30)
    return hello.SerializeToString(), _ReportBytes(report)


class _WireAgent:
    """One simulated agent on a hand-written HTTP/2 stream (`agent_wire`): its Hello, then
    a report each interval from a loop timer, each ack timed in the stream's callback.
    `done` resolves when the agent is through (an exception: its stream failed)."""

    def __init__(self, idx: int, conn: Any, args: argparse.Namespace, stats: _Stats,
                 window: _Window, ack_seqs: _AckSeqs) -> None:
        self.loop = asyncio.get_running_loop()
        self.idx, self.conn, self.stats, self.window = idx, conn, stats, window
        self.interval_s, self.ack_seqs = args.interval_s, ack_seqs
        hello, self.reports = _messages(idx, args)
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.connected = False
        self.seq = 0
        self.lost = 0  # reports sent in the window and not acked (yet)
        self.in_window = False
        self.sent = self.due = 0.0
        self.opened = time.monotonic()
        self.sid = conn.open_stream(self)
        conn.send(self.sid, hello)

    def on_message(self, data: bytes) -> None:
        if self.done.done():
            return
        if not self.connected:
            from gearshift.v1 import agent_pb2

            welcome = agent_pb2.ControllerMessage.FromString(data)
            if welcome.WhichOneof("body") != "welcome":
                self._finish(RuntimeError(f"agent {self.idx}: expected a welcome"))
                return
            self.connected = True
            self.stats.connected += 1
            self.stats.connect_ms.append((time.monotonic() - self.opened) * 1000.0)
            self.due = self.loop.time()
            self._report()
            return
        if self.ack_seqs(data) != self.seq:
            self._finish(RuntimeError(f"agent {self.idx}: expected the ack of report {self.seq}"))
            return
        if self.in_window:
            self.lost -= 1
            self.stats.acks.append((time.monotonic() - self.sent) * 1000.0)
        self.due += self.interval_s
        if self.due < self.window.end:
            self.loop.call_at(self.due, self._report)
        else:
            self._finish(None)

    def _report(self) -> None:
        if self.done.done():
            return
        self.seq += 1
        self.in_window = self.loop.time() >= self.window.start
        if self.in_window:
            self.stats.sent += 1
            self.lost += 1
        self.sent = time.monotonic()
        self.conn.send(self.sid, self.reports(self.seq))

    def on_end(self, error: str) -> None:
        self._finish(_StreamError(f"{'stream' if self.connected else 'connect'}: {error}"))

    def _finish(self, exc: BaseException | None) -> None:
        self.conn.cancel(self.sid)  # nothing if the server ended it
        if not self.done.done():
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)


async def _wire_agent(idx: int, conn: Any, args: argparse.Namespace, stats: _Stats,
                      start_at: float, window: _Window, ack_seqs: _AckSeqs) -> None:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    agent = _WireAgent(idx, conn, args, stats, window, ack_seqs)
    try:
        await agent.done
    except asyncio.CancelledError:  # by `_worker_main`, ACK_GRACE_S after the window
        agent.on_end("cancelled")
        if not agent.connected:
            raise RuntimeError("connect: no welcome by the measured window's end") from None
        raise
    finally:
        stats.lost += agent.lost


async def _grpc_agent(idx: int, connect: Any, args: argparse.Namespace, stats: _Stats,
                      start_at: float, window: _Window, ack_seqs: _AckSeqs) -> None:
    """One simulated agent on gRPC's asyncio client (`--agent-client grpc`)."""
    import grpc

    loop = asyncio.get_running_loop()
    hello, report_bytes = _messages(idx, args)
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    call = connect()
    opened = time.monotonic()
    try:
        await call.write(hello)
        data = await call.read()
    except grpc.aio.AioRpcError as exc:
        raise _StreamError(f"connect: {exc.code().name}: {exc.details()}") from None
    except asyncio.CancelledError:  # by `_worker_main`, at the window's end
        call.cancel()
        raise RuntimeError("connect: no welcome by the measured window's end") from None
    from gearshift.v1 import agent_pb2

    welcome = (agent_pb2.ControllerMessage.FromString(data) if data is not grpc.aio.EOF
               else None)
    if welcome is None or welcome.WhichOneof("body") != "welcome":
        raise RuntimeError(f"agent {idx}: expected a welcome, got {welcome!r}")
    stats.connected += 1
    stats.connect_ms.append((time.monotonic() - opened) * 1000.0)
    # One coroutine writes a report and reads its ack (the controller acks each report
    # in order and sends nothing else to these agents): no reader task per agent.
    seq = 0
    lost = 0
    try:
        due = loop.time()
        while due < window.end:
            seq += 1
            in_window = loop.time() >= window.start
            sent = time.monotonic()  # not the loop's time: uvloop's is in whole ms
            if in_window:
                stats.sent += 1
                lost += 1  # until its ack comes
            try:
                await call.write(report_bytes(seq))
                data = await call.read()
            except grpc.aio.AioRpcError as exc:
                raise _StreamError(f"stream: {exc.code().name}: {exc.details()}") from None
            if data is grpc.aio.EOF or ack_seqs(data) != seq:
                raise RuntimeError(f"agent {idx}: expected the ack of report {seq}")
            if in_window:
                lost -= 1
                stats.acks.append((time.monotonic() - sent) * 1000.0)
            due += args.interval_s
            await asyncio.sleep(max(0.0, due - loop.time()))
    finally:
        stats.lost += lost
        call.cancel()


async def _worker_main(args: argparse.Namespace, agent_ids: list[int], shared: Any,
                       connected: Any) -> _Stats:
    import grpc

    loop = asyncio.get_running_loop()
    window = _Window(shared, loop.time() - time.time())
    stats = _Stats()
    ack_seqs = _AckSeqs()
    channels: list[Any] = []  # gRPC channels or `agent_wire.Connection`s
    tasks = []
    start_rng = random.Random(len(agent_ids) * 7919 + (agent_ids[0] if agent_ids else 0))
    host, _, port = args.controller.rpartition(":")
    agent: Callable[..., Coroutine[Any, Any, None]]  # `_wire_agent` or `_grpc_agent`
    # gRPC's client: a local subchannel pool (each channel its own connection, as separate
    # hosts' are) and the agent's own options.
    channel_options: list[tuple[str, int]] = [("grpc.use_local_subchannel_pool", 1)]
    if args.agent_client == "grpc":
        from gearshift.agents.daemon import CHANNEL_OPTIONS

        channel_options += CHANNEL_OPTIONS
    for start in range(0, len(agent_ids), args.agents_per_channel):
        if args.agent_client == "wire":
            channel = await agent_wire.connect(host, int(port), CONNECT_PATH)
            agent, via = _wire_agent, channel
        else:
            channel = grpc.aio.insecure_channel(args.controller, options=channel_options)
            agent, via = _grpc_agent, _connect_method(channel)
        channels.append(channel)
        for idx in agent_ids[start:start + args.agents_per_channel]:
            start_at = loop.time() + start_rng.uniform(0, args.interval_s)  # jittered start-up
            tasks.append(asyncio.create_task(
                agent(idx, via, args, stats, start_at, window, ack_seqs)))

    async def sample_cpu() -> None:
        # Tells the parent how many agents are connected (or gave up) until the window is
        # set, then takes this process's CPU time at its start and end.
        while window.start == math.inf:
            with connected.get_lock():
                connected[0] = stats.connected + sum(t.done() for t in tasks)
            await asyncio.sleep(0.2)
        for at in (window.start, window.end):
            await asyncio.sleep(max(0.0, at - loop.time()))
            stats.cpu_window.append(time.process_time())
            if args.agent_client == "wire":  # gRPC's client answers PINGs unseen
                stats.pings_window.append(sum(c.pings for c in channels))

    async def probe_lag() -> None:
        # The simulator's own stalls: an ack read late by this loop counts as a slow ack.
        while window.start == math.inf:
            await asyncio.sleep(0.2)
        await asyncio.sleep(max(0.0, window.start - loop.time()))
        while loop.time() < window.end:
            due = time.monotonic() + LAG_PROBE_S
            await asyncio.sleep(LAG_PROBE_S)
            stats.lags_ms.append(max(0.0, time.monotonic() - due) * 1000.0)

    async def stop_waiting() -> None:
        # An agent waits for each report's ack before its next report: ACK_GRACE_S after
        # the window, what still waits is cancelled, and its unacknowledged report is lost.
        while window.end == math.inf:
            await asyncio.sleep(0.2)
        await asyncio.sleep(max(0.0, window.end + ACK_GRACE_S - loop.time()))
        for t in tasks:
            t.cancel()

    sampler = asyncio.create_task(sample_cpu())
    prober = asyncio.create_task(probe_lag())
    stopper = asyncio.create_task(stop_waiting())
    results = await asyncio.gather(*tasks, return_exceptions=True)
    if window.end != math.inf:
        await sampler  # agents may be through before the window's end
    sampler.cancel()
    prober.cancel()
    stopper.cancel()
    stats.errors = [_error_kind(r) for r in results
                    if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    for channel in channels:
        if args.agent_client == "wire":
            channel.close()
        else:
            await channel.close()
    return stats


def _worker(args: argparse.Namespace, agent_ids: list[int], shared: Any, connected: Any,
            q: Any) -> None:
    if args.pin:  # before gRPC starts its threads, which inherit it
        os.sched_setaffinity(0, _agent_cpus())
    raise_open_files_limit()  # a connection per agent: AGENTS_PER_WORKER and more
    main = _worker_main(args, agent_ids, shared, connected)
    if args.agent_loop == "uvloop":
        import uvloop

        stats = uvloop.run(main)
    else:
        stats = asyncio.run(main)
    cpu = stats.cpu_window[1] - stats.cpu_window[0] if len(stats.cpu_window) == 2 else float("nan")
    pings = stats.pings_window[1] - stats.pings_window[0] if len(stats.pings_window) == 2 else None
    q.put({"acks": stats.acks, "connect_ms": stats.connect_ms, "sent": stats.sent, "lost": stats.lost,
           "connected": stats.connected, "errors": dict(Counter(stats.errors)),
           "failed": len(stats.errors), "cpu_s": cpu, "lags_ms": stats.lags_ms, "pings": pings,
           "report_bytes": _report_bytes(args)})


def _report_bytes(args: argparse.Namespace) -> int:
    from gearshift.v1 import agent_pb2

    msg = agent_pb2.AgentMessage()
    msg.report.interval_s, msg.report.seq = args.interval_s, 1
    msg.report.deployments.extend(_deployment(0, i, random.Random(0))
                                  for i in range(args.deployments_per_agent))
    return msg.ByteSize()


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per role of the controller's threads: the event loop (main thread),
    the store writer, the rest (gRPC's threads)."""
    out = {"event_loop": 0.0, "writer": 0.0, "other_threads": 0.0}
    for t in psutil.Process(pid).threads():
        try:
            name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
        except OSError:
            name = ""
        role = ("event_loop" if t.id == pid else "writer" if name == "gs-store-writer"
                else "other_threads")
        out[role] += t.user_time + t.system_time
    return out


def _agent_cpus() -> set[int]:
    """With --pin: the simulator's cores (all but the controller's)."""
    return set(range(os.cpu_count() or 1)) - {CONTROLLER_CPU} or {CONTROLLER_CPU}


def _pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a running process (affinity is per thread on Linux; threads
    started later inherit the main thread's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def _busy_s(times: Any) -> float:
    """CPU seconds the whole machine's cores spent running anything (Linux counts guest
    time inside user and nice; idle, I/O wait and steal are not running)."""
    return float(sum(getattr(times, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq")))


def _peak_rss_mb(pid: int) -> float:
    """The process's largest RSS so far (VmHWM; the connect burst's, usually), in MB."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    found = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) * 1024 / 1e6 if found else 0.0


def _scrape(metrics_port: int) -> dict[str, float]:
    """The controller's metrics that the bench reads, as {sample: value} (empty: none)."""
    if not metrics_port:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("gearshift_controller_gc_pause_seconds_sum",
                            "gearshift_controller_event_loop_lag_seconds_bucket",
                            HANDLE_SUM, HANDLE_COUNT)):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _gc_seconds(m0: dict[str, float], m1: dict[str, float]) -> float:
    """Garbage-collector pause time between two scrapes."""
    if not m1:
        return float("nan")
    return sum(v - m0.get(k, 0.0) for k, v in m1.items()
               if k.startswith("gearshift_controller_gc_pause_seconds_sum"))


def _handling(m0: dict[str, float], m1: dict[str, float], duration_s: float
              ) -> dict[str, float]:
    """The event loop's time applying reports between two scrapes (validation, the
    fleet's state, the rollups: `gearshift_controller_report_handle_seconds`), in cores
    and per report; the rest of the loop's CPU is gRPC's reads and writes and the loop."""
    if HANDLE_SUM not in m1:
        return {}
    spent = m1[HANDLE_SUM] - m0.get(HANDLE_SUM, 0.0)
    reports = m1.get(HANDLE_COUNT, 0.0) - m0.get(HANDLE_COUNT, 0.0)
    return {"handle_cores": round(spent / duration_s, 3),
            "handle_us_per_report": round(spent / reports * 1e6, 1) if reports else math.nan}


def _loop_stalls(m0: dict[str, float], m1: dict[str, float]) -> dict[str, float]:
    """The event loop's stalls between two scrapes (from its lag histogram): how many
    probes woke over 50 ms late, and the bucket bound the longest stall was under."""
    les = {float(k.split('le="')[1].split('"')[0]): v - m0.get(k, 0.0)
           for k, v in m1.items() if k.startswith("gearshift_controller_event_loop_lag_")}
    if not les:
        return {}
    total = les.get(math.inf, 0.0)
    return {"loop_stalls_over_50ms": round(total - les.get(0.05, 0.0)),
            "loop_stall_max_under_s": min((le for le, n in les.items() if n >= total),
                                          default=math.inf)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=200)
    p.add_argument("--deployments-per-agent", type=int, default=8)
    p.add_argument("--interval-s", type=float, default=10.0)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=0,
                   help=f"agent processes (default: one per {AGENTS_PER_WORKER} agents, at least 2)")
    p.add_argument("--agents-per-channel", type=int, default=1,
                   help="agent streams sharing one connection (default: each agent its own, "
                        "as agent hosts connect)")
    p.add_argument("--agent-client", choices=("wire", "grpc"), default="wire",
                   help="the simulated agents' client: HTTP/2 frames written by hand "
                        "(bench/agent_wire.py), or gRPC's asyncio client")
    p.add_argument("--agent-loop", choices=("asyncio", "uvloop"), default="uvloop",
                   help="the simulator processes' event loop")
    p.add_argument("--pin", action="store_true",
                   help=f"run the controller on core {CONTROLLER_CPU} only and the simulated "
                        "agents on the others (Linux), so neither waits for the other's CPU")
    p.add_argument("--controller", default="",
                   help="use a running controller instead of starting one")
    p.add_argument("--floor", action="store_true",
                   help="serve the agents with gRPC's floor (bench/grpc_floor.py: read and "
                        "ack, nothing applied) instead of the controller")
    p.add_argument("--controller-pid", type=int, default=0,
                   help="with --controller: its process id, to measure its CPU and memory")
    args = p.parse_args()
    if args.workers == 0:
        args.workers = max(2, -(-args.agents // AGENTS_PER_WORKER))
    if args.agents < 1 or args.workers < 1 or args.agents_per_channel < 1 \
            or args.interval_s <= 0 or args.duration_s <= 0:
        p.error("--agents, --workers, --agents-per-channel, --interval-s and --duration-s "
                "must be positive")
    if args.floor and args.controller:
        p.error("--floor starts its own server: not with --controller")

    from gearshift.devfleet.local_fleet import LocalFleet, spawn, wait_ready_file

    watch = MachineWatch()
    with tempfile.TemporaryDirectory(prefix="gearshift-ingest-") as tmp:
        fleet = LocalFleet(Path(tmp), report_interval_s=args.interval_s)
        procs: list[mp.Process] = []
        try:  # a floor or controller that never got ready is stopped too
            ctl = None
            if args.floor:  # stopped with the fleet, as its controller would be
                ready = Path(tmp) / "grpc-floor.ready"
                floor = fleet.procs["grpc-floor"] = spawn("grpc-floor", [
                    sys.executable, str(Path(__file__).with_name("grpc_floor.py")), str(ready),
                    str(args.interval_s)], Path(tmp))
                port = wait_ready_file(ready, floor).split()[0]
                args.controller, args.controller_pid = f"127.0.0.1:{port}", floor.popen.pid
            elif not args.controller:
                ctl = fleet.start_controller()
                args.controller = fleet.controller_addr
            pid = ctl.popen.pid if ctl else args.controller_pid
            ctl_ps = psutil.Process(pid) if pid else None
            if args.pin and pid:
                _pin_process(pid, {CONTROLLER_CPU})
            t0 = time.time()
            q: Any = mp.Queue()
            ids = list(range(args.agents))
            shared = mp.Array("d", [math.inf, math.inf], lock=False)  # window start, end
            counts = [mp.Array("i", [0]) for _ in range(args.workers)]
            procs = [mp.Process(target=_worker,
                                args=(args, ids[w::args.workers], shared, counts[w], q))
                     for w in range(args.workers)]
            for pr in procs:
                pr.start()
            # The window opens one interval after every agent is connected (each is then
            # past its first report, which also writes its deployments): the start-up
            # burst is timed by connect_*_ms, not mixed into the acks.
            give_up = t0 + WARMUP_S + args.interval_s + CONNECT_TIMEOUT_S
            while sum(c[0] for c in counts) < args.agents and time.time() < give_up:
                time.sleep(0.2)
            connected_s = time.time() - t0
            t_measure = max(time.time() + args.interval_s, t0 + WARMUP_S + 2 * args.interval_s)
            t_end = t_measure + args.duration_s
            shared[1], shared[0] = t_end, t_measure
            time.sleep(max(0.0, t_measure - time.time()))
            machine0 = psutil.cpu_times()
            cpu0 = sum(ctl_ps.cpu_times()[:2]) if ctl_ps else 0.0
            split0 = _thread_cpu(pid) if ctl_ps else {}
            m0 = _scrape(fleet.metrics_port if ctl else 0)
            fds = ctl_ps.num_fds() if ctl_ps else 0  # every agent connected
            time.sleep(max(0.0, t_end - time.time()))
            cpu1 = sum(ctl_ps.cpu_times()[:2]) if ctl_ps else 0.0
            machine1 = psutil.cpu_times()
            split1 = _thread_cpu(pid) if ctl_ps else {}
            m1 = _scrape(fleet.metrics_port if ctl else 0)
            rss_mb = ctl_ps.memory_info().rss / 1e6 if ctl_ps else 0.0
            peak_rss_mb = _peak_rss_mb(pid) if ctl_ps else 0.0
            fd_limit = ctl_ps.rlimit(psutil.RLIMIT_NOFILE)[0] if ctl_ps else 0
            stats = [q.get(timeout=args.interval_s + ACK_GRACE_S + 120) for _ in procs]
            for pr in procs:
                pr.join(10)
        finally:
            for pr in procs:
                if pr.is_alive():
                    pr.terminate()
            fleet.stop()
    acks = sorted(a for s in stats for a in s["acks"])
    sent = sum(s["sent"] for s in stats)

    def pct(values: list[float], q: float) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values \
            else float("nan")

    out: dict[str, Any] = {
        "server": "grpc-floor" if args.floor else "controller",
        "agents": args.agents,
        "interval_s": args.interval_s,
        "reports_per_s": round(sent / args.duration_s, 1),
        "ack_p50_ms": pct(acks, 0.50),
        "ack_p99_ms": pct(acks, 0.99),
        "controller_cpu_s_per_1k_reports": round((cpu1 - cpu0) / max(1, sent) * 1000, 3),
        "controller_cores": round((cpu1 - cpu0) / args.duration_s, 3),
        "controller_rss_mb": round(rss_mb, 1),
        "controller_peak_rss_mb": round(peak_rss_mb, 1),
        "lost_reports": sum(s["lost"] for s in stats),
    }
    errors: Counter[str] = Counter()
    for s in stats:
        errors.update(s["errors"])
    out["streams_failed"] = sum(s["failed"] for s in stats)
    out["stream_errors"] = dict(errors.most_common(5))
    connects = sorted(c for s in stats for c in s["connect_ms"])
    out["connect_p50_ms"] = pct(connects, 0.50)
    out["connect_max_ms"] = round(connects[-1], 3) if connects else float("nan")
    out["all_connected_s"] = round(connected_s, 1)
    out["report_bytes"] = stats[0]["report_bytes"] if stats else 0
    pings = [s["pings"] for s in stats]
    out["server_pings_per_report"] = (round(sum(pings) / max(1, sent), 4)
                                      if pings and None not in pings else None)
    out["agent_processes"] = args.workers
    out["pinned"] = ({"controller_cpus": [CONTROLLER_CPU], "agent_cpus": sorted(_agent_cpus())}
                     if args.pin else None)
    out["controller_fds"], out["controller_fd_limit"] = fds, fd_limit
    out["agent_cores"] = round(sum(s["cpu_s"] for s in stats) / args.duration_s, 3)
    out["agent_max_process_cores"] = round(max(s["cpu_s"] for s in stats) / args.duration_s, 3)
    lags = sorted(lag for s in stats for lag in s["lags_ms"])
    out["agent_loop_lag_p99_ms"] = pct(lags, 0.99)
    out["agent_loop_stalls_over_50ms"] = sum(1 for lag in lags if lag > 50.0)
    busy = _busy_s(machine1) - _busy_s(machine0)
    out["machine_cores"], out["machine_count"] = round(busy / args.duration_s, 3), psutil.cpu_count()
    out["machine_nice_cores"] = round((machine1.nice - machine0.nice) / args.duration_s, 3)
    out["other_cores"] = round((busy - (cpu1 - cpu0) - sum(s["cpu_s"] for s in stats))
                               / args.duration_s, 3)
    out["controller_split"] = {
        **{f"{k}_cores": round((split1[k] - split0[k]) / args.duration_s, 3) for k in split1},
        "gc_s": round(_gc_seconds(m0, m1), 3), **_handling(m0, m1, args.duration_s),
        **_loop_stalls(m0, m1)}
    out["machine_steal_cores"] = round((getattr(machine1, "steal", 0.0)
                                        - getattr(machine0, "steal", 0.0)) / args.duration_s, 3)
    out["machine"] = watch.result()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
