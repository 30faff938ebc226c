"""Helpers for tests that run the whole fleet as real processes on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from gearshift.cli.local_fleet import LocalFleet, wait_for

__all__ = ["FAST_ENGINE_ENV", "GatewayLoad", "SteadyLoad", "gearshift", "gearshift_json",
           "wait_for"]  # wait_for lives with the fleet launcher; tests import it from here


FAST_ENGINE_ENV = {
    "vllm": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"},
    "tensorrt-llm": {"GEARSHIFT_EMULATOR_LOAD_S": "0.3"},
}


def gearshift(fleet: LocalFleet, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "gearshift.cli.main", "--controller", fleet.controller_addr, *args],
        capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"gearshift {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def gearshift_json(fleet: LocalFleet, *args: str) -> Any:
    return json.loads(gearshift(fleet, *args, "-o", "json").stdout)




class SteadyLoad:
    """Sends small completions to engine endpoints from a thread until stopped."""

    def __init__(self, targets: list[tuple[str, str]], rps: float = 20.0) -> None:
        import threading

        self.targets = targets
        self.interval_s = 1.0 / rps
        self.sent = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import urllib.request

        i = 0
        while not self._stop.is_set():
            endpoint, model = self.targets[i % len(self.targets)]
            i += 1
            body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 4}).encode()
            req = urllib.request.Request(f"{endpoint}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            self.sent += 1
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    resp.read()
            except OSError:
                self.failed += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


class GatewayLoad:
    """Clients of the gateway: streaming and non-streaming completions from threads.

    A response counts as failed when its status is not 200, the connection
    breaks, or a stream ends without its final `data: [DONE]`."""

    def __init__(self, gateway_url: str, model: str, workers: int = 3, pause_s: float = 0.05) -> None:
        import threading

        self.url = gateway_url
        self.model = model
        self.pause_s = pause_s
        self.sent = 0
        self.failed = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(workers)]

    def _one(self, stream: bool) -> str | None:
        import urllib.request

        body = json.dumps({"model": self.model, "prompt": "hi", "max_tokens": 8,
                           "stream": stream}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                data = resp.read().decode()
                if resp.status != 200:
                    return f"HTTP {resp.status}"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        if stream:
            return None if "data: [DONE]" in data else f"truncated stream: {data[-200:]!r}"
        return None if json.loads(data).get("choices") else f"no choices: {data[:200]!r}"

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            err = self._one(stream=(n + i) % 2 == 0)
            with self._lock:
                self.sent += 1
                if err is not None:
                    self.failed += 1
                    self.errors.append(err)
            self._stop.wait(self.pause_s)

    def __enter__(self) -> GatewayLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(40)
