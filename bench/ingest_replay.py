"""Ingest replay: one recorded stream of agent messages through the controller's handling.

    python bench/ingest_replay.py record --agents 10000 --intervals 9 -o /tmp/stream.bin
    python bench/ingest_replay.py replay /tmp/stream.bin

`record` writes a deterministic stream (seeded) of Hellos and Reports from
`--agents` agents of `--deployments-per-agent` deployments, one report each per
`--interval-s` over `--intervals` intervals, with varied figures: quantiles present
or not, with counts from 0 up, repeated and distinct p99s (and ±0), optional SLA
signals set or not, sleep states, errors_total going up and dropping (restarts),
endpoints and phases changing, duplicate sequence numbers, and a few invalid reports (each ends its stream; the agent says
hello again).

`replay` feeds it, message by message in the recorded order and at the recorded
times (an injected clock), through `AgentService.Connect` over in-process streams
(no network), the controller's `FleetState`, `Persistence` and rate series (`RateSeries`,
whose learner here keeps the rollup rows built) with a SQLite store and its batching
writer, and closes the minutes as the controller's housekeeping does (`RateSeries.tick`).
It prints one JSON object: the event loop's CPU seconds over the replay
(`handle_cpu_s`, and per report in `handle_us_per_report`; parsing the messages and
the in-process streams are in it, the writer thread is not), `rss_mb` after the replay, and sha256 digests of
what the controller keeps and answers: the rows stored in each table, the rollup rows
as built (every field, floats in hex), the fleet's state (each host's kept bytes,
shape, rates and counters, the routing table, the counts), every answer written to
each stream (acks, welcomes without their random token) and every status a stream
ended with. Two controllers handle a stream identically exactly when every digest
is equal: run it under each and compare (`--dump` writes the digested text too).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import resource
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

HELLO, REPORT, END = 0, 1, 2
_HEAD = struct.Struct("<BdII")  # kind, time, host index, message length
WALL_CLOCK_COLUMNS = {("hosts", "first_seen")}  # the store's own time of insertion
START_TS = datetime(2026, 3, 2, 12, 0, 37, tzinfo=UTC).timestamp()


# -- record ----------------------------------------------------------------------------

def _quantiles(q: Any, rng: random.Random, common: float) -> None:
    r = rng.random()
    if r < 0.15:
        return  # absent
    q.present = True
    q.count = rng.choice([0, 1, 7, 100, 100, 100, 2500, 1 << 40])
    q.p50_s = rng.choice([0.05, rng.uniform(0, 0.5)])
    q.mean_s = rng.uniform(0, 0.5)
    q.p99_s = rng.choice([common, common, 0.2, 0.0, -0.0, rng.uniform(0, 5), rng.uniform(0, 5)])


def record(args: argparse.Namespace) -> None:
    from gearshift.common.engines import ENGINE_NAMES
    from gearshift.v1 import agent_pb2

    rng = random.Random(args.seed)
    engines = list(ENGINE_NAMES)
    n_models = max(1, args.agents * args.deployments_per_agent // 40)
    states: list[dict[str, Any]] = []
    for a in range(args.agents):
        deps = []
        for i in range(args.deployments_per_agent):
            deps.append({"id": f"a{a}-d{i}", "model": f"model-{rng.randrange(n_models)}",
                         "engine": engines[(a + i) % 3], "errors": 0,
                         "port": 8000 + i if rng.random() < 0.97 else 0,
                         "phase": agent_pb2.DEPLOYMENT_PHASE_READY, "restarts": 0})
        states.append({"seq": 0, "deps": deps, "start": rng.uniform(0, args.interval_s)})
    out = bytearray()
    events: list[tuple[float, int, int]] = []  # (time, host, interval)
    for a, st in enumerate(states):
        for k in range(args.intervals):
            events.append((START_TS + st["start"] + k * args.interval_s, a, k))
    events.sort()

    def write(kind: int, ts: float, host: int, data: bytes) -> None:
        out.extend(_HEAD.pack(kind, ts, host, len(data)))
        out.extend(data)

    def hello(a: int, ts: float) -> None:
        msg = agent_pb2.AgentMessage()
        h = msg.hello
        h.host_id, h.agent_version = f"host-{a}", "replay"
        h.protocol_version = agent_pb2.PROTOCOL_VERSION_1
        for g in range(rng.choice([0, 4, 8])):
            h.gpus.add(index=g, model=rng.choice(["NVIDIA H100 80GB HBM3", "NVIDIA L4"]),
                       memory_total_bytes=80 << 30)
        h.engines.add(engine="vllm", version="0.11.0")
        write(HELLO, ts, a, msg.SerializeToString())

    for ts, a, k in events:
        st = states[a]
        if k == 0:
            hello(a, ts - 0.5)
        msg = agent_pb2.AgentMessage()
        r = msg.report
        dup = st["seq"] > 0 and rng.random() < 0.01
        if not dup:
            st["seq"] += 1
        r.seq = st["seq"]
        r.interval_s = args.interval_s
        if rng.random() < 0.1:
            r.gpus.add(index=0, model=rng.choice(["NVIDIA H100 80GB HBM3", "NVIDIA A10G"]),
                       utilization=rng.random(), power_w=300.0, temperature_c=50.0,
                       memory_total_bytes=80 << 30, memory_used_bytes=10 << 30)
        common = rng.choice([0.2, 0.25, 0.1])
        for dep in st["deps"]:
            if rng.random() < 0.002:
                dep["phase"] = rng.choice([agent_pb2.DEPLOYMENT_PHASE_READY,
                                           agent_pb2.DEPLOYMENT_PHASE_DRAINING,
                                           agent_pb2.DEPLOYMENT_PHASE_STARTING])
            if dep["port"] and rng.random() < 0.001:
                dep["port"] += 1
            if rng.random() < 0.3:
                dep["errors"] += rng.randint(0, 5)
            if rng.random() < 0.01:
                dep["errors"] = rng.randint(0, 2)  # the engine restarted
                dep["restarts"] += 1
            d = r.deployments.add(
                deployment_id=dep["id"], engine=dep["engine"], model=dep["model"],
                engine_version=rng.choice(["0.11.0", "0.11.0", "0.11.0", "", "0.10.1"]),
                revision="r2" if rng.random() < 0.001 else "r1", phase=dep["phase"],
                endpoint=f"http://127.0.0.1:{dep['port']}" if dep["port"] else "",
                served_model_name=dep["model"], restarts=dep["restarts"],
                metrics_present=rng.random() < 0.95, errors_total=dep["errors"],
                request_rate=rng.choice([rng.uniform(0, 50), 10.0]),
                running_requests=rng.randint(0, 64), waiting_requests=rng.randint(0, 8),
                prompt_tokens_per_s=rng.uniform(0, 5000),
                generation_tokens_per_s=rng.uniform(0, 5000), kv_cache_usage=rng.random(),
                sleep_state=rng.choice(sorted(agent_pb2.EngineSleepState.values())),
                tensor_parallel_size=rng.choice([0, 1, 2]))
            for q in (d.ttft, d.itl, d.e2e, d.queue_time):
                _quantiles(q, rng, common)
            for name in ("preemptions_per_s", "prefix_cache_hit_rate", "mean_prompt_tokens",
                         "mean_generation_tokens"):
                if rng.random() < 0.5:
                    setattr(d, name, rng.choice([0.0, rng.uniform(0, 1)]))
            if rng.random() < 0.5:
                d.kv_blocks_total = rng.randint(100, 1000)
            if rng.random() < 0.5:
                d.kv_blocks_used = rng.randint(0, 100)
        bad = rng.random() < 0.002
        if bad:  # one invalid figure: the stream ends, the agent says hello again
            d = r.deployments[rng.randrange(len(r.deployments))]
            choice = rng.randrange(4)
            if choice == 0:
                d.kv_cache_usage = 1.5
            elif choice == 1:
                d.ttft.p99_s = float("nan")
            elif choice == 2:
                d.model = ""
            else:
                d.prefix_cache_hit_rate = 2.0
        write(REPORT, ts + rng.uniform(0, 0.05), a, msg.SerializeToString())
        if bad:
            hello(a, ts + 1.0)
    Path(args.output).write_bytes(out)


# -- replay ----------------------------------------------------------------------------

def _messages(path: str) -> Iterator[tuple[int, float, int, bytes]]:
    data = Path(path).read_bytes()
    at, items = 0, []
    while at < len(data):
        kind, ts, host, n = _HEAD.unpack_from(data, at)
        at += _HEAD.size
        items.append((kind, ts, host, data[at:at + n]))
        at += n
    items.sort(key=lambda m: m[1])  # stable: the recorded order among equal times
    return iter(items)


class _Stream:
    """One agent's stream, in process: `Connect` reads what the replay feeds it and
    writes its answers here (the welcome's random session token left out)."""

    def __init__(self, out: list[bytes]) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.idle = asyncio.Event()
        self.out = out

    async def read(self) -> Any:
        self.idle.set()
        msg = await self.inbox.get()
        self.idle.clear()
        return msg

    async def write(self, msg: Any) -> None:
        if msg.WhichOneof("body") == "welcome":
            shown = type(msg)()
            shown.CopyFrom(msg)
            shown.welcome.session_token = ""
            msg = shown
        self.out.append(msg.SerializeToString())

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.out.append(f"abort {code.name} {details}".encode())
        raise aio.AbortError()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}


async def _replay(path: str, tmp: Path) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from gearshift.controller.ingest.agent_service import AgentService
    from gearshift.controller.ingest.fleet import FleetState, HostEntry
    from gearshift.controller.ingest.rollup import RollupAggregator
    from gearshift.controller.ingest.series import RateSeries
    from gearshift.controller.metrics import ControllerMetrics
    from gearshift.controller.store.persistence import Persistence
    from gearshift.controller.store.tables import RollupRow
    from gearshift.v1 import agent_pb2

    now = [START_TS]
    fleet = FleetState(clock=lambda: now[0])
    persistence = Persistence.open("", tmp, CollectorRegistry())
    metrics = ControllerMetrics(registry=CollectorRegistry())
    built: list[RollupRow] = []

    class Built:  # the learner's place: keeps the rows built
        def observe(self, rows: list[RollupRow]) -> int:
            built.extend(rows)
            return len(rows)

    rollups = RollupAggregator()
    series = RateSeries.open(persistence.store, fleet, rollups, resolution_s=60.0, now=START_TS,
                             sink=persistence.writer, learner=Built(), metrics=metrics)

    def on_report(host_id: str, entry: HostEntry, report: agent_pb2.Report, ts: float) -> None:
        series.report(host_id, entry, report, ts)  # as Controller._on_report
        persistence.report(host_id, report, ts)

    service = AgentService(fleet, metrics, report_interval_s=10.0, epoch=1, controller_id="replay",
                           on_hello=persistence.host_seen, on_report=on_report)
    streams: dict[int, _Stream] = {}
    tasks: dict[int, asyncio.Task[None]] = {}
    answers: dict[int, list[bytes]] = {}
    next_housekeeping = START_TS + 5.0
    reports = 0
    cpu0 = time.thread_time()  # the event loop's own: not the writer thread's
    for kind, ts, host, data in _messages(path):
        while ts >= next_housekeeping:  # the controller's housekeeping, every 5 s
            now[0] = next_housekeeping
            await series.tick(next_housekeeping)
            next_housekeeping += 5.0
        now[0] = ts
        msg = agent_pb2.AgentMessage.FromString(data)
        if kind == HELLO:
            old = tasks.get(host)
            if old is not None:
                if not old.done():
                    streams[host].inbox.put_nowait(aio.EOF)
                await asyncio.gather(old, return_exceptions=True)
            stream = streams[host] = _Stream(answers.setdefault(host, []))
            tasks[host] = asyncio.ensure_future(service.Connect(iter(()), stream))  # type: ignore[arg-type]
            stream.inbox.put_nowait(msg)
        else:
            reports += 1
            stream = streams[host]
            if tasks[host].done():
                continue  # its stream ended (an invalid report); the next hello reopens it
            stream.inbox.put_nowait(msg)
        # Let the stream's handler take it and answer (then it waits for the next one).
        while True:
            await asyncio.sleep(0)
            if (stream.idle.is_set() and stream.inbox.empty()) or tasks[host].done():
                break
    for host, task in tasks.items():
        if not task.done():
            streams[host].inbox.put_nowait(aio.EOF)
        await asyncio.gather(task, return_exceptions=True)
    cpu = time.thread_time() - cpu0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    series.close()
    late = rollups.late_reports
    digests: dict[str, str] = {}
    dumps: dict[str, str] = {}

    def digest(name: str, text: str) -> None:
        digests[name] = hashlib.sha256(text.encode()).hexdigest()
        dumps[name] = text

    digest("rollup_rows_built", "\n".join(_row_text(r) for r in built))
    digest("fleet", _fleet_text(fleet))
    digest("answers", "\n".join(f"{h} " + " ".join(a.hex() for a in answers[h])
                                for h in sorted(answers)))
    persistence.close(fleet)
    digest("stored", _stored_text(persistence.store.url))
    return {"reports": reports, "handle_cpu_s": round(cpu, 3),
            "handle_us_per_report": round(cpu / max(1, reports) * 1e6, 1),
            "rss_mb": round(rss_mb, 1), "rollup_rows": len(built), "late_reports": late,
            "digests": digests, "_dumps": dumps}


def _value(v: Any) -> str:
    if isinstance(v, float):
        return v.hex()
    if isinstance(v, datetime):
        return v.isoformat()
    return repr(v)


def _row_text(row: Any) -> str:
    return " ".join(f"{k}={_value(getattr(row, k))}" for k in sorted(type(row).model_fields))


def _fleet_text(fleet: Any) -> str:
    lines = []
    for host_id in sorted(fleet.hosts):
        e = fleet.hosts[host_id]
        deps = " ".join(f"{k}:{e.deployments._raw[k].hex()}" for k in e.deployments)
        lines.append(f"{host_id} {e.hello_bytes.hex()} {e.gpus_bytes!r} {e.gpu_model!r} "
                     f"{e.connected} {e.last_report_ts.hex()} {e.last_seq} {e.reports} "
                     f"{e.reported} {e.deployments_at.hex()} {e.shape!r} "
                     f"{sorted((m, r.hex()) for m, r in e.rates.items())} {deps}")
    # The routes' version and time are left out: when they are recomputed is timed by the
    # wall clock (a debounce), not by the replay's.
    lines.append(f"routes {[m.SerializeToString().hex() for m in fleet.routing_table().models]}")
    lines.append(f"counts {sorted(fleet.deployment_counts().items())}")
    lines.append(f"rates {sorted((m, r.hex()) for m, r in fleet.model_rates().items())}")
    lines.append(f"models {sorted(fleet.model_names())} {fleet.reports_total}")
    lines.append(f"restarts {sorted(fleet.restarts.take().items())}")
    return "\n".join(lines)


def _stored_text(url: str) -> str:
    import sqlite3

    db = sqlite3.connect(url.removeprefix("sqlite:///"))
    lines = []
    for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name"):
        if table == "alembic_version":
            continue
        columns = [c[1] for c in db.execute(f'PRAGMA table_info("{table}")')
                   if (table, c[1]) not in WALL_CLOCK_COLUMNS]
        listed = ", ".join(f'"{c}"' for c in columns)
        for row in db.execute(f'SELECT {listed} FROM "{table}" ORDER BY 1, 2, 3'):
            lines.append(f"{table} " + " ".join(
                v.hex() if isinstance(v, float) else repr(v) for v in row))
    db.close()
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--agents", type=int, default=10000)
    rec.add_argument("--deployments-per-agent", type=int, default=8)
    rec.add_argument("--interval-s", type=float, default=10.0)
    rec.add_argument("--intervals", type=int, default=9)
    rec.add_argument("--seed", type=int, default=15)
    rec.add_argument("-o", "--output", required=True)
    rep = sub.add_parser("replay")
    rep.add_argument("stream")
    rep.add_argument("--dump", default="", help="a folder to write the digested text to")
    args = p.parse_args()
    if args.cmd == "record":
        record(args)
        return 0
    logging.disable(logging.CRITICAL)  # the invalid reports' warnings
    with tempfile.TemporaryDirectory(prefix="gearshift-replay-") as tmp:
        out = asyncio.run(_replay(args.stream, Path(tmp)))
    dumps = out.pop("_dumps")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for name, text in dumps.items():
            Path(args.dump, f"{name}.txt").write_text(text)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
