"""Ingest benchmark: many simulated agents report to one controller over real gRPC.

    python bench/ingest.py --agents 500 --deployments-per-agent 8 --interval-s 10 --duration-s 30

The controller runs as its own process (`gearshift controller`, SQLite store in a
temp dir). Simulated agents run in `--workers` separate processes, each holding
many agents on one event loop; every agent has its own bidirectional stream
(`--agents-per-channel` streams share one HTTP/2 connection). An agent starts at
a random moment within the first interval (as a fleet coming up does), sends
Hello, waits for Welcome, then sends a Report with N deployment samples every
interval on a fixed schedule and times the Ack. Report messages are built once
per agent; only the sequence number changes, so the agents stay cheap and the
machine's CPU goes to the controller being measured.

Prints one JSON object:
  agents, interval_s, reports_per_s, ack_p50_ms, ack_p99_ms,
  controller_cpu_s_per_1k_reports, controller_cores, controller_rss_mb,
  controller_peak_rss_mb, lost_reports,
  streams_failed, stream_errors, connect_p50_ms, connect_max_ms, all_connected_s, report_bytes,
  agent_processes, pinned, controller_fds, controller_fd_limit, agent_cores,
  agent_max_process_cores, agent_loop_lag_p99_ms, agent_loop_stalls_over_50ms,
  machine_cores, machine_count, machine_nice_cores, other_cores, controller_split
Controller CPU is read from the controller process over the measured window, and
split by thread (`controller_split`): the event loop (the main thread), the store
writer (named `gs-store-writer`), the rest (gRPC's own threads), and the garbage
collector's pauses (from the controller's metrics, inside the thread that ran it);
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
serialized size. `lost_reports` counts reports sent in the measured window that
were never acked. `controller_rss_mb` is the controller's RSS at the window's end,
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
--agents 10000 --duration-s 40) on a quiet 2-core machine (`other_cores` 0.00-0.01),
the controller before and after the timed young collections (controller/gc_policy.py),
back to back: ack p99 352 -> 112 ms, 0.73 -> 0.72 core, RSS 576 -> 549 MB, 0 failed
streams and 0 lost reports in both; the simulator's own lag p99 was 4.7-6.5 ms. Two
more quiet runs after: p99 66 and 380 ms. With other work running (`other_cores`
0.1-0.9) the p99 was 0.2-0.9 s (docs/architecture.md).
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
from pathlib import Path
from typing import Any

import psutil

WARMUP_S = 3.0  # worker processes importing and starting their loops
# Agents per simulator process by default: at 10 s intervals one process runs about
# 1,000 streams at a small share of a core, so it never becomes what is measured.
AGENTS_PER_WORKER = 1000
ACK_GRACE_S = 2.0  # how long an agent waits for its last acks after the window
CONNECT_TIMEOUT_S = 120.0  # the window opens then even if some agents are not connected
CONTROLLER_CPU = 0  # with --pin: the controller's core
LAG_PROBE_S = 0.05  # the simulator's loop-lag probe, as the controller's (controller.loop_lag)


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
    def __init__(self, where: str, exc: Any) -> None:
        super().__init__(f"{where}: {exc.code().name}: {exc.details()}")


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


async def _agent(idx: int, stub: Any, args: argparse.Namespace, stats: _Stats,
                 start_at: float, window: _Window) -> None:
    import grpc

    from gearshift.v1 import agent_pb2

    loop = asyncio.get_running_loop()
    rng = random.Random(idx)
    msg = agent_pb2.AgentMessage()
    msg.report.interval_s = args.interval_s
    msg.report.deployments.extend(
        _deployment(idx, i, rng) for i in range(args.deployments_per_agent))
    hello = agent_pb2.AgentMessage()
    hello.hello.host_id = f"bench-{idx}"
    hello.hello.agent_version = "bench"
    hello.hello.protocol_version = agent_pb2.PROTOCOL_VERSION_1
    hello.hello.emulated_gpus = True
    for g in range(8):
        hello.hello.gpus.add(index=g, model="NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30)

    await asyncio.sleep(max(0.0, start_at - loop.time()))
    call = stub.Connect()
    opened = loop.time()
    try:
        await call.write(hello)
        welcome = await call.read()
    except grpc.aio.AioRpcError as exc:
        raise _StreamError("connect", exc) from None
    if welcome is grpc.aio.EOF or welcome.WhichOneof("body") != "welcome":
        raise RuntimeError(f"agent {idx}: expected a welcome, got {welcome!r}")
    stats.connected += 1
    stats.connect_ms.append((loop.time() - opened) * 1000.0)
    sent_at: dict[int, float] = {}

    async def reader() -> None:
        while True:
            ack = await call.read()
            if ack is grpc.aio.EOF:
                return
            t0 = sent_at.pop(ack.ack.seq, None)
            if t0 is not None and t0 >= window.start:
                stats.acks.append((loop.time() - t0) * 1000.0)

    rtask = asyncio.create_task(reader())
    try:
        seq = 0
        due = loop.time()
        while due < window.end:
            seq += 1
            msg.report.seq = seq
            now = loop.time()
            sent_at[seq] = now
            if now >= window.start:
                stats.sent += 1
            try:
                await call.write(msg)
            except grpc.aio.AioRpcError as exc:
                raise _StreamError("stream", exc) from None
            due += args.interval_s
            await asyncio.sleep(max(0.0, due - loop.time()))
        await asyncio.sleep(ACK_GRACE_S)
    finally:
        stats.lost += sum(1 for t in sent_at.values() if t >= window.start)
        rtask.cancel()
        call.cancel()


async def _worker_main(args: argparse.Namespace, agent_ids: list[int], shared: Any,
                       connected: Any) -> _Stats:
    import grpc

    from gearshift.v1 import agent_pb2_grpc

    loop = asyncio.get_running_loop()
    window = _Window(shared, loop.time() - time.time())
    stats = _Stats()
    channels, tasks = [], []
    start_rng = random.Random(len(agent_ids) * 7919 + (agent_ids[0] if agent_ids else 0))
    for start in range(0, len(agent_ids), args.agents_per_channel):
        # A local subchannel pool: each channel is its own connection, as separate hosts' are.
        ch = grpc.aio.insecure_channel(args.controller,
                                       options=[("grpc.use_local_subchannel_pool", 1)])
        channels.append(ch)
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        for idx in agent_ids[start:start + args.agents_per_channel]:
            start_at = loop.time() + start_rng.uniform(0, args.interval_s)  # jittered start-up
            tasks.append(asyncio.create_task(
                _agent(idx, stub, args, stats, start_at, window)))

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

    async def probe_lag() -> None:
        # The simulator's own stalls: an ack read late by this loop counts as a slow ack.
        while window.start == math.inf:
            await asyncio.sleep(0.2)
        await asyncio.sleep(max(0.0, window.start - loop.time()))
        while loop.time() < window.end:
            due = loop.time() + LAG_PROBE_S
            await asyncio.sleep(LAG_PROBE_S)
            stats.lags_ms.append(max(0.0, loop.time() - due) * 1000.0)

    sampler = asyncio.create_task(sample_cpu())
    prober = asyncio.create_task(probe_lag())
    results = await asyncio.gather(*tasks, return_exceptions=True)
    sampler.cancel()
    prober.cancel()
    stats.errors = [_error_kind(r) for r in results if isinstance(r, BaseException)]
    for ch in channels:
        await ch.close()
    return stats


def _worker(args: argparse.Namespace, agent_ids: list[int], shared: Any, connected: Any,
            q: Any) -> None:
    if args.pin:  # before gRPC starts its threads, which inherit it
        os.sched_setaffinity(0, _agent_cpus())
    stats = asyncio.run(_worker_main(args, agent_ids, shared, connected))
    cpu = stats.cpu_window[1] - stats.cpu_window[0] if len(stats.cpu_window) == 2 else float("nan")
    q.put({"acks": stats.acks, "connect_ms": stats.connect_ms, "sent": stats.sent, "lost": stats.lost,
           "connected": stats.connected, "errors": dict(Counter(stats.errors)),
           "failed": len(stats.errors), "cpu_s": cpu, "lags_ms": stats.lags_ms,
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
                            "gearshift_controller_event_loop_lag_seconds_bucket")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _gc_seconds(m0: dict[str, float], m1: dict[str, float]) -> float:
    """Garbage-collector pause time between two scrapes."""
    if not m1:
        return float("nan")
    return sum(v - m0.get(k, 0.0) for k, v in m1.items()
               if k.startswith("gearshift_controller_gc_pause_seconds_sum"))


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
    p.add_argument("--agents-per-channel", type=int, default=100,
                   help="agent streams sharing one connection")
    p.add_argument("--pin", action="store_true",
                   help=f"run the controller on core {CONTROLLER_CPU} only and the simulated "
                        "agents on the others (Linux), so neither waits for the other's CPU")
    p.add_argument("--controller", default="",
                   help="use a running controller instead of starting one")
    p.add_argument("--controller-pid", type=int, default=0,
                   help="with --controller: its process id, to measure its CPU and memory")
    args = p.parse_args()
    if args.workers == 0:
        args.workers = max(2, -(-args.agents // AGENTS_PER_WORKER))
    if args.agents < 1 or args.workers < 1 or args.agents_per_channel < 1 \
            or args.interval_s <= 0 or args.duration_s <= 0:
        p.error("--agents, --workers, --agents-per-channel, --interval-s and --duration-s "
                "must be positive")

    from gearshift.devfleet.local_fleet import LocalFleet

    with tempfile.TemporaryDirectory(prefix="gearshift-ingest-") as tmp:
        fleet = LocalFleet(Path(tmp), report_interval_s=args.interval_s)
        ctl = None
        if not args.controller:
            ctl = fleet.start_controller()
            args.controller = fleet.controller_addr
        procs: list[mp.Process] = []
        try:
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
            time.sleep(max(0.0, t_end - time.time()))
            cpu1 = sum(ctl_ps.cpu_times()[:2]) if ctl_ps else 0.0
            machine1 = psutil.cpu_times()
            split1 = _thread_cpu(pid) if ctl_ps else {}
            m1 = _scrape(fleet.metrics_port if ctl else 0)
            rss_mb = ctl_ps.memory_info().rss / 1e6 if ctl_ps else 0.0
            peak_rss_mb = _peak_rss_mb(pid) if ctl_ps else 0.0
            fds = ctl_ps.num_fds() if ctl_ps else 0
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
        "gc_s": round(_gc_seconds(m0, m1), 3), **_loop_stalls(m0, m1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
