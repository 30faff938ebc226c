"""Queue time sees saturation coming before TTFT breaks: an emulated run.

An in-process emulated vLLM (`agents/emulator`, its continuous-batching model) is
driven with open-loop Poisson traffic (`devfleet.load.LoadGenerator`, plain
completions) at rising shares of its capacity, each step's requests answered before
the next step; after each
load step the agent's own scraper (`EngineScraper`, the production path) reads the
step's TTFT p99 and queue-time p99 from the engine's `vllm:` histograms. For each
step it prints whether the SLA guard's saturation warning holds (queue p99 >=
`queueShareOfTtftSla` x the TTFT target, policies/rules.py) and whether TTFT p99
breaks the target, and, in the summary, the first load at which each happens.

Prints one JSON object. Usage: python bench/sla_queue_warning.py [STEP_S]
(figures vary with the machine's load: asyncio timers stretch on a busy host).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from gearshift.agents.emulator.app import build_app
from gearshift.agents.emulator.args import parse_engine_argv
from gearshift.agents.emulator.config import EmulatorOptions
from gearshift.agents.emulator.server import make_state
from gearshift.agents.metrics import EngineScraper
from gearshift.devfleet.load import LoadGenerator, Target
from gearshift.policies.rules import DEFAULT_QUEUE_SHARE_OF_TTFT_SLA

# A slow engine (0.4 s prefill, 1.5 s per request at full batch), so that timer jitter
# on a busy host matters little, with a 2.5 s TTFT target (a bucket bound of vLLM's TTFT
# histogram, so a breach is resolved exactly): the warning threshold (1.25 s)
# must lie well above 0.3 s, vLLM's lowest queue-time bucket.
CAPACITY_RPS = 4.0
SLA_TTFT_P99_S = 2.5
LOAD_SHARES = (0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05)
DEFAULT_STEP_S = 20.0
OPTIONS = EmulatorOptions(capacity_rps=CAPACITY_RPS, load_s=0.0, ttft_base_s=0.4, itl_s=0.04,
                          output_tokens=16)
PROMPT = "a short prompt"


async def run(step_s: float) -> dict[str, Any]:
    state = make_state(parse_engine_argv("vllm", ["serve", "org/m", "--served-model-name", "m"]),
                       OPTIONS)
    runner = web.AppRunner(build_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}"
    # Plain completions of the engine's own length (no max_tokens).
    load = LoadGenerator([Target(url, "m", LOAD_SHARES[0] * CAPACITY_RPS)], stream_share=0.0,
                         max_tokens=None, prompt=PROMPT, seed=7)
    limit = DEFAULT_QUEUE_SHARE_OF_TTFT_SLA * SLA_TTFT_P99_S
    steps: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession() as http, \
                EngineScraper("vllm", url, session=http) as scraper:
            await scraper.scrape(time.monotonic())
            for share in LOAD_SHARES:
                load.set_rate("m", share * CAPACITY_RPS)
                failed_before = load.failed
                await load.run_for(step_s)
                failed = load.failed - failed_before
                sample = await scraper.scrape(time.monotonic())
                ttft, queue = sample.ttft, sample.queue_time
                steps.append({
                    "load_share": share, "offered_rps": round(share * CAPACITY_RPS, 2),
                    "served_rps": round(sample.request_rate, 2), "failed": failed,
                    "ttft_p99_s": round(ttft.p99_s, 4) if ttft.present else None,
                    "queue_p99_s": round(queue.p99_s, 4) if queue.present else None,
                    "queue_share_of_ttft_sla": (round(queue.p99_s / SLA_TTFT_P99_S, 3)
                                                if queue.present else None),
                    "warning": queue.present and queue.p99_s >= limit,
                    "breach": ttft.present and ttft.p99_s > SLA_TTFT_P99_S,
                })
    finally:
        await runner.cleanup()
    breaches = [s for s in steps if s["breach"]]
    return {
        "capacity_rps": CAPACITY_RPS, "sla_ttft_p99_s": SLA_TTFT_P99_S,
        "queue_share_of_ttft_sla": DEFAULT_QUEUE_SHARE_OF_TTFT_SLA, "step_s": step_s,
        "steps": steps,
        "first_warning_load_share": next((s["load_share"] for s in steps if s["warning"]), None),
        "first_breach_load_share": breaches[0]["load_share"] if breaches else None,
        # A step is one interval: a breach the warning did not flag in the same interval,
        # and the intervals where it flagged saturation while TTFT still met its target.
        "breaches": len(breaches),
        "breaches_without_warning": [s["load_share"] for s in breaches if not s["warning"]],
        "warnings_without_breach": [s["load_share"] for s in steps
                                    if s["warning"] and not s["breach"]],
    }


def main() -> None:
    step_s = float(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_STEP_S
    print(json.dumps(asyncio.run(run(step_s)), indent=2))


if __name__ == "__main__":
    main()
