"""Ingest benchmark: many simulated agents report to one controller over real gRPC.

    python bench/ingest.py --agents 500 --deployments-per-agent 8 --interval-s 10 --duration-s 30

The controller runs as its own process (SQLite store in a temp dir); simulated
agents run in `--workers` separate processes, each holding many agent streams
(one channel per 100 agents). Every agent sends Hello, then a Report with N
deployment samples every interval (phases spread at random) and times the Ack.
Prints one JSON object:
  agents, interval_s, reports_per_s, ack_p50_ms, ack_p99_ms,
  controller_cpu_s_per_1k_reports, controller_rss_mb, lost_reports
`lost_reports` counts reports sent in the measured window that were never acked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from pathlib import Path

import psutil

AGENTS_PER_CHANNEL = 100
WARMUP_S = 3.0


def _deployment(agent: int, i: int, rng: random.Random):  # type: ignore[no-untyped-def]
    from gearshift.v1 import agent_pb2

    d = agent_pb2.DeploymentReport(
        deployment_id=f"a{agent}-d{i}", engine="vllm" if i % 2 else "tensorrt-llm",
        engine_version="0.11.0", model=f"model-{(agent * 8 + i) % 200}", revision="r1",
        phase=agent_pb2.DEPLOYMENT_PHASE_READY, endpoint=f"http://10.0.0.1:{8000 + i}",
        request_rate=rng.uniform(1, 50), running_requests=rng.randint(0, 64),
        waiting_requests=rng.randint(0, 8), prompt_tokens_per_s=rng.uniform(100, 5000),
        generation_tokens_per_s=rng.uniform(100, 5000), kv_cache_usage=rng.random(),
        errors_total=0, metrics_present=True)
    for q in (d.ttft, d.itl, d.e2e):
        q.present, q.p50_s, q.p99_s, q.mean_s, q.count = True, 0.05, 0.2, 0.07, 100
    return d


async def _agent(idx: int, channel, args, stats: dict, t_end: float, t_measure: float) -> None:  # type: ignore[no-untyped-def]
    import grpc

    from gearshift.v1 import agent_pb2, agent_pb2_grpc

    rng = random.Random(idx)
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    call = stub.Connect()
    hello = agent_pb2.Hello(host_id=f"bench-{args.worker}-{idx}", agent_version="bench",
                            protocol_version=agent_pb2.PROTOCOL_VERSION_1, emulated_gpus=True)
    for g in range(8):
        hello.gpus.add(index=g, model="NVIDIA H100 80GB HBM3", memory_total_bytes=80 << 30)
    await call.write(agent_pb2.AgentMessage(hello=hello))
    welcome = await call.read()
    assert welcome.WhichOneof("body") == "welcome", welcome
    sent_at: dict[int, float] = {}
    deps = [_deployment(idx, i, rng) for i in range(args.deployments_per_agent)]

    async def reader() -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            if msg.WhichOneof("body") == "ack":
                t0 = sent_at.pop(msg.ack.seq, None)
                if t0 is not None and t0 >= t_measure:
                    stats["acks"].append((time.perf_counter() - t0) * 1000.0)

    rtask = asyncio.create_task(reader())
    await asyncio.sleep(rng.uniform(0, args.interval_s))
    seq = 0
    while time.perf_counter() < t_end:
        seq += 1
        report = agent_pb2.Report(seq=seq, interval_s=args.interval_s, deployments=deps)
        now = time.perf_counter()
        sent_at[seq] = now
        if now >= t_measure:
            stats["sent"] += 1
        await call.write(report_msg(report))
        await asyncio.sleep(args.interval_s)
    await asyncio.sleep(min(2.0, args.interval_s))  # let the last acks arrive
    stats["lost"] += sum(1 for t in sent_at.values() if t >= t_measure)
    rtask.cancel()
    call.cancel()


def report_msg(report):  # type: ignore[no-untyped-def]
    from gearshift.v1 import agent_pb2

    return agent_pb2.AgentMessage(report=report)


async def _worker_main(args, agent_ids: list[int], t_end: float, t_measure: float) -> dict:  # type: ignore[no-untyped-def]
    import grpc

    stats: dict = {"acks": [], "sent": 0, "lost": 0}
    channels = []
    tasks = []
    for start in range(0, len(agent_ids), AGENTS_PER_CHANNEL):
        ch = grpc.aio.insecure_channel(args.controller)
        channels.append(ch)
        for idx in agent_ids[start:start + AGENTS_PER_CHANNEL]:
            tasks.append(asyncio.create_task(_agent(idx, ch, args, stats, t_end, t_measure)))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    stats["errors"] = [repr(r) for r in results if isinstance(r, BaseException)][:5]
    for ch in channels:
        await ch.close()
    return stats


def _worker(args, worker: int, agent_ids: list[int], t_end_wall: float, t_measure_wall: float, q) -> None:  # type: ignore[no-untyped-def]
    args.worker = worker
    offset = time.perf_counter() - time.time()
    stats = asyncio.run(_worker_main(args, agent_ids, t_end_wall + offset, t_measure_wall + offset))
    q.put(stats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=200)
    p.add_argument("--deployments-per-agent", type=int, default=8)
    p.add_argument("--interval-s", type=float, default=10.0)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--controller", default="", help="use a running controller instead of starting one")
    args = p.parse_args()

    from gearshift.cli.local_fleet import LocalFleet

    with tempfile.TemporaryDirectory(prefix="gearshift-ingest-") as tmp:
        fleet = LocalFleet(Path(tmp), report_interval_s=args.interval_s)
        ctl = None
        if not args.controller:
            ctl = fleet.start_controller()
            args.controller = fleet.controller_addr
        try:
            ctl_ps = psutil.Process(ctl.popen.pid) if ctl else None
            t0 = time.time()
            # every agent connected and past its first report (which also writes its deployments)
            t_measure = t0 + WARMUP_S + 2 * args.interval_s
            t_end = t_measure + args.duration_s
            q: mp.Queue = mp.Queue()
            ids = list(range(args.agents))
            procs = [mp.Process(target=_worker, args=(args, w, ids[w::args.workers], t_end, t_measure, q))
                     for w in range(args.workers)]
            for pr in procs:
                pr.start()
            time.sleep(max(0.0, t_measure - time.time()))
            cpu0 = sum(ctl_ps.cpu_times()[:2]) if ctl_ps else 0.0
            time.sleep(max(0.0, t_end - time.time()))
            cpu1 = sum(ctl_ps.cpu_times()[:2]) if ctl_ps else 0.0
            rss_mb = ctl_ps.memory_info().rss / 1e6 if ctl_ps else 0.0
            stats = [q.get(timeout=args.interval_s + 120) for _ in procs]
            for pr in procs:
                pr.join(10)
        finally:
            fleet.stop()
    acks = sorted(a for s in stats for a in s["acks"])
    sent = sum(s["sent"] for s in stats)
    lost = sum(s["lost"] for s in stats)

    def pct(q: float) -> float:
        return round(acks[min(len(acks) - 1, int(q * len(acks)))], 3) if acks else float("nan")

    out = {
        "agents": args.agents,
        "interval_s": args.interval_s,
        "reports_per_s": round(sent / args.duration_s, 1),
        "ack_p50_ms": pct(0.50),
        "ack_p99_ms": pct(0.99),
        "controller_cpu_s_per_1k_reports": round((cpu1 - cpu0) / max(1, sent) * 1000, 3),
        "controller_cores": round((cpu1 - cpu0) / args.duration_s, 3),
        "controller_rss_mb": round(rss_mb, 1),
        "lost_reports": lost,
    }
    errors = [e for s in stats for e in s.get("errors", [])]
    if errors:
        out["agent_errors"] = errors
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
