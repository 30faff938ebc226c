"""Gateway overhead benchmark: latency added by one gateway process, and its throughput.

    python bench/gateway.py [--duration-s 16] [--concurrency 32] [--upstream auto|emulator|builtin]
    python bench/gateway.py --hostile [--duration-s 16]

Starts one emulated engine (`python -m gearshift.agents.emulator --flavor vllm`, high
capacity, ~0 latency, so the bench measures the gateway; `builtin` is a minimal
aiohttp upstream for when the emulator is absent) and one gateway
(`python -m gearshift.gateway --routes …`), each in its own process (both on uvloop
when it is installed), then drives load from a third process over real HTTP/1.1 on
loopback. The load generator is a lean keep-alive client on asyncio protocols (uvloop
when installed), so that on a small machine it leaves the cores to the processes
under test; it still checks every answer (status 200, body framed by its
Content-Length, JSON with `choices` in the latency phase). It is the one client of
its own among the benches and the demo, which all use `devfleet.load.LoadGenerator`:
that one sends open-loop Poisson arrivals through aiohttp, while this bench needs
one request at a time and closed loops of kept-alive connections, each request as
cheap in CPU as it can be (`loadgen_cpu_ms_per_req` says how cheap):

1. latency: one request at a time, alternating direct-to-engine and through-gateway
   (so drift hits both alike); added = gateway quantile − direct quantile;
2. throughput: a closed loop of `--concurrency` clients, each with its own kept-alive
   connection, sending the next request as soon as the last one is answered, through
   the gateway for the rest of the time; the rate is requests answered with 200 per
   second over the measured window (after a warm-up).

Small non-streaming completions. Prints ONE JSON object:
  direct_p50_ms, gateway_p50_ms, added_p50_ms, added_p99_ms, gateway_max_rps, failed
(plus context: direct_p99_ms, gateway_p99_ms, latency_samples, concurrency, upstream,
gateway/upstream/loadgen_cpu_ms_per_req, uvloop, cpus, load_avg_1m). On a small shared
machine the three processes compete for the cores, so gateway_max_rps is bounded by
the machine; 1000 / gateway_cpu_ms_per_req is what one gateway process does with a
core of its own.
Targets: added p50 <= 1 ms, added p99 <= 5 ms, >= 2000 req/s, failed = 0.

`--hostile` is a soak instead: a few normal clients (closed loop, small completions)
run alone for a third of the duration, then for the rest beside hostile clients from
a fourth process: heads trickled a byte at a time, bodies trickled below the minimum
rate, 30 MB bodies sent as fast as loopback allows, oversized heads, 200 connections
each holding 60 KB of a head that never ends, a declared 1 GB body, and 1,000 idle
connections. It prints normal_p99_unloaded_ms,
normal_p99_hostile_ms, p99_ratio, normal_failed, gateway_peak_rss_mb, hostile
outcomes, and the targets: p99_ratio <= 2 and gateway_peak_rss_mb <= 256 with the
default limits (the body budget, 128 MiB, bounds what the bodies can hold).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gearshift.devfleet.ports import free_port

MODEL = "bench-model"
STARTUP_TIMEOUT_S = 30.0
LATENCY_SHARE = 0.45  # of the duration; the rest is warm-up and throughput
WARMUP_S = 1.0
BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def have_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


# -- the builtin upstream (child process) --------------------------------------------

def run_builtin_upstream(port: int) -> None:
    from aiohttp import web

    answer = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                         "choices": [{"index": 0, "text": " hi", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                   "total_tokens": 2}}).encode()

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    async def health(_request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    loop = None
    if have_uvloop():
        import uvloop

        loop = uvloop.new_event_loop()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=loop)


# -- the load generator (child process) ----------------------------------------------

class BadResponse(Exception):
    """An answer the bench cannot accept (framing); counted as failed."""


class ClientConnection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 client connection carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._body_at = -1  # where the body starts, once the head is in
        self._end = -1  # where the response ends
        self._status = 0
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._settle(ConnectionResetError(f"connection lost: {exc or 'closed by the server'}"))

    def _settle(self, outcome: tuple[int, bytes] | BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.done():
            return
        if isinstance(outcome, BaseException):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if self._body_at < 0:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(buf[:head_end]).lower()
            at = head.find(b"\r\ncontent-length:")
            if not head.startswith(b"http/1.1 ") or at < 0:
                self._settle(BadResponse(f"unexpected response head {head[:80]!r}"))
                return
            eol = head.find(b"\r\n", at + 2)
            self._status = int(head[9:12])
            self._body_at = head_end + 4
            self._end = self._body_at + int(head[at + 17:eol if eol > 0 else len(head)])
        if len(buf) >= self._end:
            body = bytes(buf[self._body_at:self._end])
            del buf[:self._end]
            self._body_at = self._end = -1
            self._settle((self._status, body))

    async def request(self, data: bytes) -> tuple[int, bytes]:
        if self.transport is None:
            raise ConnectionResetError("not connected")
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self._waiter


def request_bytes(port: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
            b"User-Agent: gearshift-bench\r\nAccept: application/json\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (port, len(BODY), BODY))


async def drive(direct: str, gateway: str, duration_s: float, concurrency: int,
                gateway_pid: int, upstream_pid: int) -> dict:
    import psutil

    def cpu_s(pid: int) -> float:
        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)

    loop = asyncio.get_running_loop()
    failed = 0
    errors: dict[str, int] = {}

    async def connect(url: str) -> ClientConnection:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        _, conn = await loop.create_connection(ClientConnection, host, int(port))
        return conn

    def fail(reason: str) -> None:
        nonlocal failed
        failed += 1
        errors[reason] = errors.get(reason, 0) + 1

    async def one(conn: ClientConnection, data: bytes, check_json: bool) -> bool:
        try:
            status, body = await conn.request(data)
        except (ConnectionError, BadResponse) as err:
            fail(f"{type(err).__name__}: {err}")
            return False
        if status != 200:
            fail(f"HTTP {status}")
            return False
        if check_json and not json.loads(body).get("choices"):
            fail("answer without choices")
            return False
        return True

    d_url, g_url = direct, gateway
    d_req = request_bytes(int(direct.rsplit(":", 1)[1]))
    g_req = request_bytes(int(gateway.rsplit(":", 1)[1]))
    d_conn, g_conn = await connect(d_url), await connect(g_url)
    end = time.perf_counter() + WARMUP_S * 0.5
    while time.perf_counter() < end:  # warm connections and code paths
        await one(d_conn, d_req, True)
        await one(g_conn, g_req, True)
    direct_s: list[float] = []
    gateway_s: list[float] = []
    end = time.perf_counter() + duration_s * LATENCY_SHARE
    while time.perf_counter() < end:
        for conn, data, out in ((d_conn, d_req, direct_s), (g_conn, g_req, gateway_s)):
            t0 = time.perf_counter()
            if await one(conn, data, True):
                out.append(time.perf_counter() - t0)
    for conn in (d_conn, g_conn):
        if conn.transport is not None:
            conn.transport.close()

    done = 0
    stop_at = 0.0
    conns = [await connect(g_url) for _ in range(concurrency)]

    async def worker(conn: ClientConnection) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            if conn.transport is None:
                conn = await connect(g_url)
            if await one(conn, g_req, False):
                done += 1

    stop_at = time.perf_counter() + WARMUP_S * 0.5
    await asyncio.gather(*(worker(c) for c in conns))
    done = 0
    gw_cpu0, up_cpu0, me_cpu0 = cpu_s(gateway_pid), cpu_s(upstream_pid), time.process_time()
    t0 = time.perf_counter()
    stop_at = t0 + duration_s * (1 - LATENCY_SHARE) - WARMUP_S
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t0
    gw_cpu, up_cpu = cpu_s(gateway_pid) - gw_cpu0, cpu_s(upstream_pid) - up_cpu0
    me_cpu = time.process_time() - me_cpu0
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()

    ms = 1000.0
    if not direct_s or not gateway_s:
        raise SystemExit(f"bench: no successful latency samples; failures: {errors}")
    d50, d99 = quantile(direct_s, 0.5) * ms, quantile(direct_s, 0.99) * ms
    g50, g99 = quantile(gateway_s, 0.5) * ms, quantile(gateway_s, 0.99) * ms
    result = {
        "direct_p50_ms": round(d50, 3), "gateway_p50_ms": round(g50, 3),
        "added_p50_ms": round(g50 - d50, 3), "added_p99_ms": round(g99 - d99, 3),
        "gateway_max_rps": round(done / elapsed, 1), "failed": failed,
        "direct_p99_ms": round(d99, 3), "gateway_p99_ms": round(g99, 3),
        "latency_samples": len(gateway_s), "concurrency": concurrency,
        # CPU the gateway spent per request: 1000 / this is its req/s on a core of its own
        "gateway_cpu_ms_per_req": round(gw_cpu * ms / max(done, 1), 3),
        "upstream_cpu_ms_per_req": round(up_cpu * ms / max(done, 1), 3),
        "loadgen_cpu_ms_per_req": round(me_cpu * ms / max(done, 1), 3),
        "uvloop": have_uvloop(),
        "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    if errors:
        result["errors"] = errors
    return result


def run_load(argv: list[str]) -> None:
    d, g, dur, conc, gpid, upid = argv
    main = drive(d, g, float(dur), int(conc), int(gpid), int(upid))
    if have_uvloop():
        import uvloop

        result = uvloop.run(main)
    else:
        result = asyncio.run(main)
    print(json.dumps(result))


# -- the hostile soak (normal and hostile load generators are child processes) ---------

SOAK_CONCURRENCY = 4  # normal clients
RSS_BOUND_MB = 256
P99_RATIO_BOUND = 2.0
IDLE_CONNECTIONS = 1000
BIG_BODY_BYTES = 30 * 1000 * 1000
HOSTILE_PAUSE_S = 0.2  # between one hostile client's attempts: slow and large, not a flood


async def normal_latencies(gateway: str, duration_s: float) -> dict:
    """Closed-loop small completions for `duration_s`: p50/p99 and failures."""
    loop = asyncio.get_running_loop()
    host, port = gateway.removeprefix("http://").rsplit(":", 1)
    data = request_bytes(int(port))
    latencies: list[float] = []
    failed = 0
    stop_at = time.perf_counter() + duration_s

    async def worker() -> None:
        nonlocal failed
        _, conn = await loop.create_connection(ClientConnection, host, int(port))
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                status, _body = await asyncio.wait_for(conn.request(data), 10.0)
            except (ConnectionError, BadResponse, TimeoutError):
                failed += 1
                _, conn = await loop.create_connection(ClientConnection, host, int(port))
                continue
            if status == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                failed += 1
        if conn.transport is not None:
            conn.transport.close()

    await asyncio.gather(*(worker() for _ in range(SOAK_CONCURRENCY)))
    if not latencies:
        raise SystemExit("bench: no normal request succeeded")
    return {"p50_ms": round(quantile(latencies, 0.5) * 1000, 3),
            "p99_ms": round(quantile(latencies, 0.99) * 1000, 3),
            "requests": len(latencies), "failed": failed}


def run_normal(argv: list[str]) -> None:
    gateway, duration_s = argv[0], float(argv[1])
    print(json.dumps(asyncio.run(normal_latencies(gateway, duration_s))))


async def hostile_clients(gateway: str, duration_s: float) -> dict[str, int]:
    """Slow and oversized clients for `duration_s`; how each kind's attempts ended."""
    host, port_text = gateway.removeprefix("http://").rsplit(":", 1)
    port = int(port_text)
    stop_at = time.monotonic() + duration_s
    outcomes: dict[str, int] = {}
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n"

    def count(kind: str, got: bytes) -> None:
        key = f"{kind}:{got[9:12].decode('latin-1') or 'closed'}"
        outcomes[key] = outcomes.get(key, 0) + 1

    async def quietly(send: Awaitable[None]) -> None:
        with contextlib.suppress(OSError):  # the gateway refused and closed mid-send
            await send

    async def attempt(kind: str, send: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(HOSTILE_PAUSE_S)
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                count(kind, b"")
                await asyncio.sleep(0.1)
                continue
            sender = asyncio.ensure_future(quietly(send(writer)))
            try:
                got = await asyncio.wait_for(reader.read(64), max(0.1, stop_at - time.monotonic()))
                count(kind, got)
            except (OSError, TimeoutError):
                count(kind, b"")
            finally:
                sender.cancel()
                writer.close()

    async def trickle_head(w: asyncio.StreamWriter) -> None:
        for byte in head % len(body):
            w.write(bytes([byte]))
            await asyncio.sleep(0.5)

    async def trickle_body(w: asyncio.StreamWriter) -> None:
        w.write(head % (60 * 1000 * 1000))
        while True:
            w.write(b"x" * 100)
            await asyncio.sleep(0.1)

    async def big_body(w: asyncio.StreamWriter) -> None:
        w.write(head % BIG_BODY_BYTES)
        piece = b"x" * (1024 * 1024)
        for _ in range(BIG_BODY_BYTES // len(piece)):
            w.write(piece)
            await w.drain()
        w.write(b"x" * (BIG_BODY_BYTES % len(piece)))
        await w.drain()

    async def big_head(w: asyncio.StreamWriter) -> None:
        w.write(b"POST /v1/completions HTTP/1.1\r\nX-Pad: " + b"p" * 100_000 + b"\r\n\r\n")
        await w.drain()

    async def held_big_head(w: asyncio.StreamWriter) -> None:
        w.write(b"POST /v1/completions HTTP/1.1\r\n" + b"X-Pad: %s\r\n" % (b"p" * 1000) * 60)
        await w.drain()
        await asyncio.sleep(3600)  # never the blank line: the head deadline ends it

    async def huge_declared(w: asyncio.StreamWriter) -> None:
        w.write(head % (1000 * 1000 * 1000))
        await w.drain()

    idle = []
    for _ in range(IDLE_CONNECTIONS):
        try:
            idle.append(await asyncio.open_connection(host, port))
        except OSError:
            count("idle", b"")
    kinds: list[tuple[str, int, Callable[[asyncio.StreamWriter], Awaitable[None]]]] = [
        ("slow_head", 50, trickle_head), ("slow_body", 8, trickle_body),
        ("big_body", 4, big_body), ("big_head", 2, big_head), ("held_head", 200, held_big_head),
        ("huge_declared", 1, huge_declared)]
    await asyncio.gather(*(attempt(kind, send) for kind, n, send in kinds for _ in range(n)))
    closed = sum(1 for r, _w in idle if r.at_eof())
    outcomes["idle:held"] = len(idle) - closed
    for _r, w in idle:
        w.close()
    return outcomes


def run_hostile(argv: list[str]) -> None:
    print(json.dumps(asyncio.run(hostile_clients(argv[0], float(argv[1])))))


def soak(direct: str, gateway: str, duration_s: float, gw_proc: subprocess.Popen[bytes]) -> dict:
    """Normal clients alone, then beside hostile ones; the gateway's RSS sampled throughout."""
    import threading

    import psutil

    gw = psutil.Process(gw_proc.pid)
    peak = {"rss": 0}
    sampling = threading.Event()

    def sample_rss() -> None:
        while not sampling.is_set():
            try:
                peak["rss"] = max(peak["rss"], gw.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    def normal(seconds: float) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, __file__, "_normal", gateway, str(seconds)],
                                stdout=subprocess.PIPE, text=True)

    def result_of(proc: subprocess.Popen[str], what: str, seconds: float) -> dict:
        out, _ = proc.communicate(timeout=seconds + STARTUP_TIMEOUT_S)
        if proc.returncode != 0:
            raise SystemExit(f"bench: the {what} load generator failed")
        return json.loads(out)  # type: ignore[no-any-return]

    alone_s = max(3.0, duration_s / 3)
    hostile_s = max(5.0, duration_s - alone_s)
    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    try:
        unloaded = result_of(normal(alone_s), "normal", alone_s)
        rss_unloaded = peak["rss"]
        hostile = subprocess.Popen([sys.executable, __file__, "_hostile", gateway,
                                    str(hostile_s)], stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the idle connections and the first hostile clients are in
        loaded = result_of(normal(hostile_s - 1.0), "normal", hostile_s)
        outcomes = result_of(hostile, "hostile", hostile_s)
    finally:
        sampling.set()
        sampler.join()
    rss_mb = peak["rss"] / 1e6
    ratio = loaded["p99_ms"] / max(unloaded["p99_ms"], 1e-6)
    return {
        "normal_p99_unloaded_ms": unloaded["p99_ms"], "normal_p99_hostile_ms": loaded["p99_ms"],
        "p99_ratio": round(ratio, 2), "p99_ratio_ok": ratio <= P99_RATIO_BOUND,
        "normal_p50_unloaded_ms": unloaded["p50_ms"], "normal_p50_hostile_ms": loaded["p50_ms"],
        "normal_requests": unloaded["requests"] + loaded["requests"],
        "normal_failed": unloaded["failed"] + loaded["failed"],
        "gateway_rss_unloaded_mb": round(rss_unloaded / 1e6, 1),
        "gateway_peak_rss_mb": round(rss_mb, 1), "rss_bound_mb": RSS_BOUND_MB,
        "rss_ok": rss_mb <= RSS_BOUND_MB, "hostile": outcomes,
        "uvloop": have_uvloop(), "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


# -- orchestration -------------------------------------------------------------------

def wait_healthy(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    """Wait until GET `url` answers 200 (an engine's /health, a gateway's /readyz)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench: {what} exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise SystemExit(f"bench: {what} not healthy at {url} after {STARTUP_TIMEOUT_S:.0f}s")


def upstream_command(kind: str, port: int) -> list[str]:
    if kind == "builtin":
        return [sys.executable, __file__, "_upstream", str(port)]
    # No emulated latency here, so uvloop's millisecond timer steps do not matter.
    loop = ["--event-loop", "uvloop"] if have_uvloop() else []
    return [sys.executable, "-m", "gearshift.agents.emulator", "--flavor", "vllm",
            "--capacity-rps", "1000000", "--max-batch", "4096", "--load-s", "0",
            "--ttft-base-s", "0", "--itl-s", "0", "--output-tokens", "1", *loop,
            "--", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL]


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=16.0,
                        help="latency + throughput phases (process start-up comes on top)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--upstream", choices=["auto", "emulator", "builtin"], default="auto")
    parser.add_argument("--hostile", action="store_true",
                        help="soak: normal clients beside slow and oversized ones")
    args = parser.parse_args()
    if args.duration_s < 4 * WARMUP_S or args.concurrency < 1:
        parser.error(f"--duration-s must be >= {4 * WARMUP_S:g} and --concurrency >= 1")
    kind = args.upstream
    if kind == "auto":
        have = importlib.util.find_spec("gearshift.agents.emulator.__main__") is not None
        kind = "emulator" if have else "builtin"

    up_port, gw_port, ops_port = free_port(), free_port(), free_port()
    direct, gateway = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="gearshift-bench-") as tmp:
        routes = Path(tmp) / "routes.json"
        routes.write_text(json.dumps({MODEL: [{"endpoint": direct, "weight": 1}]}))
        try:
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            procs.append(subprocess.Popen(upstream_command(kind, up_port), **quiet))  # type: ignore[call-overload]
            wait_healthy(f"{direct}/health", procs[-1], f"upstream ({kind})")
            procs.append(start_gateway(routes, gw_port, ops_port))
            wait_healthy(f"http://127.0.0.1:{ops_port}/readyz", procs[-1], "gateway")
            if args.hostile:
                result = soak(direct, gateway, args.duration_s, procs[1])
                return print_result(result, kind)
            try:
                load = subprocess.run(
                    [sys.executable, __file__, "_load", direct, gateway, str(args.duration_s),
                     str(args.concurrency), str(procs[1].pid), str(procs[0].pid)],
                    capture_output=True, text=True, check=False,
                    timeout=args.duration_s + STARTUP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise SystemExit("bench: the load generator did not finish in time "
                                 "(a request never got its answer)") from None
            if load.returncode != 0:
                raise SystemExit(f"bench: load generator failed:\n{load.stderr}")
            result = json.loads(load.stdout)
        finally:
            for proc in reversed(procs):
                stop(proc)
    print_result(result, kind)


def print_result(result: dict, kind: str) -> None:
    result["upstream"] = kind
    print(json.dumps(result))


def start_gateway(routes: Path, port: int, ops_port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gearshift.gateway", "--routes", str(routes),
         "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{ops_port}",
         "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        run_builtin_upstream(int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_normal":
        run_normal(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_hostile":
        run_hostile(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_load":
        run_load(sys.argv[2:])
    else:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        main()
