"""`decisions explain` of decisions the core made on the SLA signals: each signal a rule
used is shown with its value and unit (core decision -> stored dict -> Decision message ->
report, as the controller serves it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.json_format import ParseDict

from gearshift.cli.explain import decision_report
from gearshift.policies.core import Decision, ModelState, decide
from gearshift.policies.loader import load_policy, load_policy_file
from gearshift.policies.signals import EngineFacts, ModelFacts, ModelHistory, compute_signals
from gearshift.v1 import control_pb2

EXAMPLES = Path(__file__).parents[3] / "policies" / "examples"
T0 = 1_772_409_600.0
DAY_S = 86400.0


def decided(policy: Any, vllm: dict[str, Any]) -> Decision:
    engines = {
        "vllm": EngineFacts(**{"capacity_rps": 10.0, "ttft_p99_ms": 900.0, "cold_start_s": 210,
                               "build_s": 0, "build_overhead_usd": 0.0, **vllm}),
        "tensorrt-llm": EngineFacts(capacity_rps=11.6, ttft_p99_ms=780.0, cold_start_s=240,
                                    build_s=1800, build_overhead_usd=150.0),
    }
    facts = ModelFacts(gpus_per_replica=8, sla_ttft_p99_ms=1000.0, engines=engines, nvidia=True,
                       price_per_gpu_hour=4.0)
    hist = ModelHistory.of(T0 + np.arange(300) * 300.0, [20.0] * 300, [], 300.0)
    now = T0 + DAY_S
    sig = compute_signals("m", hist, facts, now, policy.signal_settings)
    [d] = decide(policy, {"m": sig}, {"m": ModelState("vllm", T0 - 30 * DAY_S)}, now)
    return d


def report(d: Decision) -> str:
    doc = d.to_dict()
    doc.pop("urgent")
    return decision_report(ParseDict({**doc, "id": "dec-1", "policy_version": 1},
                                     control_pb2.Decision(), ignore_unknown_fields=True))


def test_the_sla_guard_saturation_warning_is_explained() -> None:
    text = report(decided(load_policy_file(str(EXAMPLES / "default.yaml")),
                          {"queue_p99_ms": 600.0}))
    assert "tested: queue_share_of_ttft_sla = 60%, needs >= 50%: held" in text
    assert "600 ms" in text  # the queue p99 among the rule's inputs
    assert "saturation coming" in text


def test_threshold_rules_on_the_signals_are_explained_with_units() -> None:
    rules = """    - name: cache-friendly
      kind: threshold
      prefer: tensorrt-llm
      when:
        - {signal: prefix_cache_hit_rate, gt: 0.5}
        - {signal: preemptions_per_s, ge: 1}
        - {signal: mean_prompt_tokens, gt: 2000}
        - {signal: kv_blocks_free, lt: 100}
        - {signal: engine_asleep, eq: false}
"""
    text = (f"apiVersion: gearshift.dev/v1\nkind: EnginePolicy\nmetadata:\n  name: t\n"
            f"spec:\n  mode: auto\n  rules:\n{rules}")
    d = decided(load_policy(text, "t.yaml"), {
        "prefix_cache_hit_rate": 0.7, "preemptions_per_s": 2.0, "mean_prompt_tokens": 4000.0,
        "kv_blocks_total": 2452.0, "kv_blocks_used": 2400.0, "asleep": False})
    out = report(d)
    for line in ("tested: prefix_cache_hit_rate = 70%, needs > 50%: held",
                 "tested: preemptions_per_s = 2 req/s, needs >= 1 req/s: held",
                 "tested: mean_prompt_tokens = 4,000 tokens, needs > 2,000 tokens: held",
                 "tested: kv_blocks_free = 52 blocks, needs < 100 blocks: held",
                 "tested: engine_asleep = no, needs == no: held"):
        assert line in out, (line, out)
