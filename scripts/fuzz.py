"""`make fuzz`: coverage-guided fuzzing of the parsers with atheris, for a bounded time.

Each target runs in its own process for FUZZ_SECONDS (default 30 s); an input that
raises anything but gearshift's own errors is a crash, saved by libFuzzer as
`crash-*` in the working directory, and the run exits non-zero. Without atheris
(`pip install -e '.[fuzz]'` failed) it says so and exits 2; the Makefile then
runs the hypothesis properties for longer instead.

    python scripts/fuzz.py [TARGET ...]      # all targets by default
    python scripts/fuzz.py --one TARGET [libFuzzer args]   # what each process runs
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable

TARGETS = ("policy", "trace", "prometheus", "trtllm-json", "agent-config", "report")


def _target(name: str) -> Callable[[bytes], None]:
    from pathlib import Path

    from gearshift.agents.config import parse_agent_config, parse_yaml_bytes
    from gearshift.agents.metrics import RateCalculator, parse_prometheus_text, parse_trtllm_json
    from gearshift.controller.api.validation import check_report, peer_ip
    from gearshift.policies.loader import load_policy
    from gearshift.policies.trace import read_trace_bytes
    from gearshift.v1 import agent_pb2

    def text(data: bytes) -> str:
        return data.decode("utf-8", errors="replace")

    def policy(data: bytes) -> None:
        load_policy(text(data), "fuzz.yaml")

    def trace(data: bytes) -> None:
        read_trace_bytes(data, "fuzz.jsonl")

    def prometheus(data: bytes) -> None:
        calc = RateCalculator()
        half = len(data) // 2
        for i, part in enumerate((data[:half], data[half:])):
            sample = calc.update(parse_prometheus_text(text(part)), float(i + 1))
            assert sample.request_rate >= 0 and 0 <= sample.kv_cache_usage <= 1

    def trtllm_json(data: bytes) -> None:
        parse_trtllm_json(text(data))

    def agent_config(data: bytes) -> None:
        value = parse_yaml_bytes(data, Path("fuzz.yaml"))
        parse_agent_config(value, "fuzz.yaml")

    peer = peer_ip("ipv4:127.0.0.1:5000")

    def report(data: bytes) -> None:
        try:
            msg = agent_pb2.Report.FromString(data)
        except Exception:  # not a Report at all: gRPC refuses it before the check
            return
        check_report(msg, "h1", peer, set())

    return {"policy": policy, "trace": trace, "prometheus": prometheus,
            "trtllm-json": trtllm_json, "agent-config": agent_config, "report": report}[name]


def run_one(name: str, argv: list[str]) -> None:
    import atheris  # type: ignore[import-not-found]

    with atheris.instrument_imports(include=["gearshift"]):
        fn = _target(name)
    from gearshift.common.errors import GearshiftError

    def one_input(data: bytes) -> None:
        with contextlib.suppress(GearshiftError):  # a clean refusal: the expected outcome
            fn(data)

    atheris.Setup([sys.argv[0], *argv], one_input)
    atheris.Fuzz()


def main() -> int:
    if sys.argv[1:2] == ["--one"]:
        run_one(sys.argv[2], sys.argv[3:])
        return 0
    try:
        import atheris  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        print("atheris is not installed: coverage-guided fuzzing unavailable", file=sys.stderr)
        return 2
    seconds = int(os.environ.get("FUZZ_SECONDS", "30"))
    failed = []
    for name in sys.argv[1:] or TARGETS:
        print(f"== fuzzing {name} for {seconds} s", flush=True)
        rc = subprocess.call([sys.executable, __file__, "--one", name,
                              f"-max_total_time={seconds}", "-max_len=4096", "-rss_limit_mb=2048",
                              "-print_final_stats=1"])
        if rc != 0:
            failed.append(name)
    print("fuzz: " + (f"crashes in {', '.join(failed)}" if failed else "no crash in any target"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
