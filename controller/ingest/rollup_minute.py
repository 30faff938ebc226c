"""How `controller.ingest.rollup` holds an open (model, engine, minute) until it is handed back.

A minute of a large fleet is the larger part of the controller's memory after gRPC's
(80,000 deployments of 10,000 hosts, two minutes open at each minute's turn), so it is
held in numbers rather than objects: a bucket's per-deployment sums in columns by slot
(`DeploymentSums`), a latency's p99s as runs of equal samples with their weights in 4
bytes (`LatencySamples`). Everything here is read back exactly as added: the rows
`controller.ingest.rollup` makes from it are what a list of every report's figures would give,
to the last bit.
"""

from __future__ import annotations

from array import array

import numpy as np

from gearshift.v1 import agent_pb2

P99_TAIL_FRACTION = 0.01
MAX_U32 = (1 << 32) - 1


class DeploymentSums:
    """Each deployment's sums within one bucket, in columns: a deployment is a slot (its
    index, in order of first report), each figure an array of numbers. An object per
    deployment with its own float objects took about 290 bytes and one object for the
    garbage collector to walk; a slot takes about 160 and none (80,000 a minute at
    10,000 hosts, two minutes open at each minute's turn)."""

    __slots__ = ("blocks_set", "blocks_total", "blocks_used", "gen_sum", "n", "preempt_n",
                 "preempt_sum", "rate_latest", "rate_sum", "running_sum", "sleeping", "slot",
                 "waiting_sum")

    def __init__(self) -> None:
        self.slot: dict[str, int] = {}  # deployment id -> its slot
        self.n = array("q")  # reports
        self.rate_sum = array("d")
        self.rate_latest = array("d")
        self.running_sum = array("d")
        self.waiting_sum = array("d")
        self.gen_sum = array("d")
        self.preempt_n = array("q")
        self.preempt_sum = array("d")
        self.sleeping = bytearray()
        self.blocks_set = bytearray()  # 1: kv_blocks_total was reported, 2: kv_blocks_used
        self.blocks_total = array("Q")  # the latest reported (uint64, as in the report)
        self.blocks_used = array("Q")

    def add(self, dep_id: str) -> int:
        """A new deployment's slot, its sums at 0."""
        k = self.slot[dep_id] = len(self.n)
        self.n.append(0)
        self.preempt_n.append(0)
        self.blocks_total.append(0)
        self.blocks_used.append(0)
        self.rate_sum.append(0.0)
        self.rate_latest.append(0.0)
        self.running_sum.append(0.0)
        self.waiting_sum.append(0.0)
        self.gen_sum.append(0.0)
        self.preempt_sum.append(0.0)
        self.sleeping.append(0)
        self.blocks_set.append(0)
        return k


class LatencySamples:
    """Count-weighted p50 sum and the p99s (with weights) of one latency kind.

    The p99s are kept in insertion order as runs: a report whose p99 and weight equal the
    previous report's (a p99 at a histogram bound, a fleet of like deployments) lengthens
    the last run instead of adding a sample. `p99` expands the runs back into the very
    sequence of samples, so the percentile is computed on the same float64s in the same
    order. A sample takes 12 bytes (its p99 as a double, its weight in 4 bytes until one
    does not fit, then doubles), and 4 more once some run is longer than one; a run of
    any length takes one sample's bytes."""

    __slots__ = ("count", "last_p99", "last_w", "p50_wsum", "p99_weights", "p99s", "runs")

    def __init__(self) -> None:
        self.count = 0
        self.p50_wsum = 0.0
        # array('d') appends as fast as a list and hands numpy its buffer without a copy
        self.p99s = array("d")
        self.p99_weights: array[int] | array[float] = array("I")
        self.runs: array[int] | None = None  # each sample's run length; None: all 1
        self.last_p99 = 0.0  # of the last sample (a 0 never starts a run: -0.0 == 0.0)
        self.last_w = 0

    def add(self, quantiles: agent_pb2.Quantiles, p50: float, p99: float) -> None:
        """Add one report's `quantiles` (their p50 and p99 as the fold already read them)."""
        if quantiles.present:
            w = quantiles.count or 1
            self.count += w
            self.p50_wsum += p50 * w
            if p99 == self.last_p99 and w == self.last_w and p99:
                runs = self.runs
                if runs is None:
                    runs = self.runs = array("I", [1]) * len(self.p99s)
                runs[-1] += 1
                return
            self.last_p99, self.last_w = p99, w
            self.p99s.append(p99)
            if self.runs is not None:
                self.runs.append(1)
            weights = self.p99_weights
            if w > MAX_U32 and weights.typecode == "I":
                # doubles from here on, each converted from the same integer as before
                weights = self.p99_weights = array("d", weights)
            weights.append(w)

    def p50(self) -> float | None:
        return self.p50_wsum / self.count if self.count else None

    def p99(self) -> float | None:
        """The count-weighted 99th percentile of the report p99s (see the module doc)."""
        if not self.count:
            return None
        values = np.frombuffer(self.p99s, dtype=np.float64)
        weights = np.frombuffer(self.p99_weights, dtype=np.uint32 if
                                self.p99_weights.typecode == "I" else np.float64)
        weights = weights.astype(np.float64)
        if self.runs is not None:
            runs = np.frombuffer(self.runs, dtype=np.uint32)
            values, weights = np.repeat(values, runs), np.repeat(weights, runs)
        order = np.argsort(-values, kind="stable")  # slowest first
        cumulative = np.cumsum(weights[order])
        first = int(np.searchsorted(cumulative, self.count * P99_TAIL_FRACTION, side="left"))
        return float(values[order[min(first, len(order) - 1)]])


class Bucket:
    """Everything known about one (model, engine, minute)."""

    __slots__ = ("deps", "e2e", "engine_version", "errors", "gen_len", "gpu_model",
                 "hit_rate", "itl", "kv_sum", "prompt_len", "queue", "rate_max", "rate_total",
                 "reports", "ttft")

    def __init__(self) -> None:
        self.deps = DeploymentSums()
        self.reports = 0
        self.kv_sum = 0.0
        self.rate_total = 0.0
        self.rate_max = 0.0
        self.errors = 0
        self.engine_version = ""
        self.gpu_model = ""
        self.ttft = LatencySamples()
        self.itl = LatencySamples()
        self.e2e = LatencySamples()
        self.queue = LatencySamples()
        self.hit_rate = Mean()
        self.prompt_len = Mean()
        self.gen_len = Mean()


class Mean:
    """The mean of the reports that have a value (added to by `RollupAggregator.add`)."""

    __slots__ = ("n", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value

    def value(self) -> float | None:
        return self.total / self.n if self.n else None


__all__ = ["MAX_U32", "P99_TAIL_FRACTION", "Bucket", "DeploymentSums", "LatencySamples", "Mean"]
