"""Capacity per engine for the decision core: what the fleet measured, else what the
policy's priors or the default ratio imply, each with where it came from. One rule,
shared by the live loop (`controller.policy_loop`) and the blind backtest
(`policies.blind`); each adapter only says what it measured (`Measurement`).

The rule (`resolve_capacities`), per model:

1. An engine with its own usable figure uses it: ``measured`` (where the p99 fit
   crosses the SLA, with its bootstrap band), ``lower_bound`` (the SLA was never
   reached: the most load served within it) or ``upper_bound``. A lower bound
   under the engine's own absolute prior keeps the prior (a bound can raise a
   prior, never lower it).
2. An engine without one, when the other engine has one, gets the other's figure
   times the prior capacity ratio: the ratio of the two policy priors
   (``spec.models.<m>.engines.<e>.capacityRps``) when both are given
   (``ratio-prior``), else a lone absolute prior of this engine (``prior``), else
   the engine catalog's default prior ratios (``default-ratio``: each entry's
   `CapacityPrior`, relative to vLLM, e.g. TensorRT-LLM 5% ahead, the middle of
   the public range, docs/engines.md, which gives the ratio's interval). A bound that only shows the traffic (`bounds_only`: the
   engine never served above its minimum replicas) wins when it is higher.
3. With nothing measured: the absolute prior (``prior``), else such a bound, else
   ``unknown`` (no capacity: the cost rule makes no move).

An engine whose release changed (`Measurement.earlier`: what an earlier release of it
measured) and that has no figure of its own on the new release yet takes the earlier
release's figure as its prior, never as a measurement: ``earlier-release``, its band
widened by EARLIER_RELEASE_WIDENING each way (a release can move capacity by a quarter),
the note naming both releases ("vllm 0.12.0: not measured; prior from 0.11.0, band
widened"). It comes before step 2: the same engine's earlier release says more than
another engine's figure. Other engines derive their figure from it (step 2) only when no
engine has a figure of its own.

Every figure that is not the engine's own measurement carries a note that says
what it was derived from and why nothing better was available (too little data,
no SLA to measure against, …); `citations` turns them into decision inputs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gearshift.common.engines import CATALOG, ENGINE_NAMES
from gearshift.policies.schema import EnginePriors, ModelPriors
from gearshift.policies.signals import SignalValue

# Capacity relative to the baseline engine when nothing else is known, and the public
# range it is the middle of: each catalog entry's `CapacityPrior` (docs/engines.md).
DEFAULT_PRIOR_RATIO = {e.name: e.prior.ratio for e in CATALOG}
DEFAULT_PRIOR_RATIO_RANGE = {e.name: (e.prior.low, e.prior.high) for e in CATALOG}
OWN_SOURCES = ("measured", "lower_bound", "upper_bound")
PRIOR_NOTE = "policy prior (spec.models)"
EARLIER_RELEASE_SOURCE = "earlier-release"
EARLIER_RELEASE_WIDENING = 0.25  # the band of an earlier release's figure, widened each way


@dataclass(frozen=True)
class EngineCapacity:
    """The capacity the policy uses for one engine (req/s per replica), and where it came from."""

    capacity_rps: float | None
    low: float | None
    high: float | None
    source: str  # measured | lower_bound | upper_bound | prior | ratio-prior | default-ratio | unknown
    note: str = ""
    ratio: float | None = None  # capacity / the base engine's (ratio-prior, default-ratio)
    ratio_low: float | None = None
    ratio_high: float | None = None
    base: str | None = None  # the engine whose figure the ratio scales


@dataclass(frozen=True)
class Measurement:
    """What the fleet measured of one model on one engine."""

    figure: EngineCapacity | None = None  # a usable figure (source in OWN_SOURCES)
    bounds_only: bool = False  # the figure only bounds the capacity (never served at scale)
    why: str = ""  # why there is no usable figure: too little data, no SLA, …
    # The engine runs a release (`version`) on which nothing usable was measured yet, and
    # `earlier` is what release `earlier_version` of it measured: the prior of this one.
    version: str | None = None
    earlier: EngineCapacity | None = None
    earlier_version: str | None = None


def earlier_release(engine: str, m: Measurement) -> EngineCapacity | None:
    """The prior an engine's earlier release gives the release it runs now (module
    docstring), or None when there is none."""
    old = m.earlier
    if old is None or old.capacity_rps is None:
        return None
    w = EARLIER_RELEASE_WIDENING
    low, high = old.low or old.capacity_rps, old.high or old.capacity_rps
    return EngineCapacity(
        old.capacity_rps, low * (1 - w), high * (1 + w), EARLIER_RELEASE_SOURCE,
        f"{engine} {m.version or 'new release'}: not measured; prior from "
        f"{m.earlier_version or 'an earlier release'} ({old.source} {old.capacity_rps:.3g} rps), "
        f"band widened {w:.0%}" + (f"; {m.why}" if m.why else ""))


def priors_for(models: Mapping[str, ModelPriors], model: str) -> ModelPriors:
    """The first `spec.models` entry whose name or glob matches `model`."""
    for pattern, priors in models.items():
        # "*" matches every name: the common catch-all needs no glob match per model.
        if pattern in ("*", model) or fnmatch.fnmatchcase(model, pattern):
            return priors
    return ModelPriors()


def _prior_capacity(priors: Mapping[str, EnginePriors], engine: str) -> float | None:
    p = priors.get(engine)
    return None if p is None or not p.capacity_rps else float(p.capacity_rps)


def _scaled(value: float | None, factor: float | None) -> float | None:
    return None if value is None or factor is None else value * factor


def _own(m: Measurement, prior: float | None, engine: str) -> EngineCapacity | None:
    fig = m.figure
    if fig is None or m.bounds_only or fig.capacity_rps is None:
        return None
    if fig.source == "lower_bound" and prior is not None and prior > fig.capacity_rps:
        return EngineCapacity(prior, fig.capacity_rps, None, "prior",
                              f"{PRIOR_NOTE}; above the measured lower bound "
                              f"{fig.capacity_rps:.3g} rps on {engine}")
    return fig


def _derived(engine: str, base: str, found: EngineCapacity, priors: Mapping[str, EnginePriors],
             why: str) -> EngineCapacity:
    """`engine`'s figure from `base`'s through a prior ratio (step 2 of the rule)."""
    mine, theirs = _prior_capacity(priors, engine), _prior_capacity(priors, base)
    value = found.capacity_rps or 0.0
    tail = f"; {why}" if why else ""
    if mine is not None and theirs is not None:
        ratio = mine / theirs
        return EngineCapacity(value * ratio, _scaled(found.low, ratio), _scaled(found.high, ratio),
                              "ratio-prior", f"{base} {found.source} {value:.3g} rps x {ratio:.3g} "
                              f"(ratio of the policy priors {mine:g}/{theirs:g}){tail}",
                              ratio, ratio, ratio, base)
    if mine is not None:
        return EngineCapacity(mine, None, None, "prior", f"{PRIOR_NOTE}{tail}")
    ratio = DEFAULT_PRIOR_RATIO[engine] / DEFAULT_PRIOR_RATIO[base]
    lo = DEFAULT_PRIOR_RATIO_RANGE[engine][0] / DEFAULT_PRIOR_RATIO_RANGE[base][1]
    hi = DEFAULT_PRIOR_RATIO_RANGE[engine][1] / DEFAULT_PRIOR_RATIO_RANGE[base][0]
    return EngineCapacity(value * ratio, (found.low or value) * lo, (found.high or value) * hi,
                          "default-ratio", f"{base} {found.source} {value:.3g} rps x {ratio:.3g} "
                          f"(default ratio, no policy priors: the middle of the public range "
                          f"{lo:.2f}..{hi:.2f}x, docs/engines.md){tail}", ratio, lo, hi, base)


def resolve_capacities(measurements: Mapping[str, Measurement],
                       priors: Mapping[str, EnginePriors],
                       engines: Sequence[str] = ENGINE_NAMES) -> dict[str, EngineCapacity]:
    """One capacity per engine of `engines` (catalog order), by the rule of the module
    docstring."""
    nothing = Measurement(why="not measured yet")
    own = {e: c for e in engines
           if (c := _own(measurements.get(e, nothing), _prior_capacity(priors, e), e)) is not None}
    # With no engine's own figure, an earlier release's figure is the base the others are
    # derived from (an upgrade of the only measured engine leaves the others priced).
    earlier = {e: c for e in engines
               if (c := earlier_release(e, measurements.get(e, nothing))) is not None}
    bases = own or earlier
    out: dict[str, EngineCapacity] = {}
    for e in engines:
        if e in own:
            out[e] = own[e]
            continue
        m = measurements.get(e, nothing)
        floor = m.figure if m.bounds_only and m.figure is not None else None
        base = next((o for o in engines if o in bases and o != e), None)
        prior = _prior_capacity(priors, e)
        if e in earlier:
            found = earlier[e]
        elif base is not None:
            found = _derived(e, base, bases[base], priors, m.why)
        elif prior is not None:
            found = EngineCapacity(prior, None, None, "prior",
                                   f"{PRIOR_NOTE}; {m.why}" if m.why else PRIOR_NOTE)
        else:
            found = EngineCapacity(None, None, None, "unknown",
                                   f"nothing measured on any engine and no prior; {m.why}"
                                   if m.why else "nothing measured on any engine and no prior")
        if floor is not None and (floor.capacity_rps or 0.0) > (found.capacity_rps or 0.0):
            found = floor
        out[e] = found
    return out


def citations(caps: Mapping[str, EngineCapacity]) -> dict[str, SignalValue]:
    """Decision inputs saying where each engine's capacity figure came from."""
    cite: dict[str, SignalValue] = {}
    for e, c in caps.items():
        cite.update({f"capacity_source.{e}": c.source, f"capacity_low.{e}": c.low,
                     f"capacity_high.{e}": c.high})
        if c.note:
            cite[f"capacity_note.{e}"] = c.note
        if c.ratio is not None:
            cite.update({f"capacity_ratio.{e}": c.ratio, f"capacity_ratio_low.{e}": c.ratio_low,
                         f"capacity_ratio_high.{e}": c.ratio_high,
                         f"capacity_ratio_base.{e}": c.base})
    return cite
