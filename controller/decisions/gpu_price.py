"""The price of a GPU-hour the live policy loop prices a model's serving at.

A policy's `spec.cost.pricePerGpuHour` wins (`policies.economics`); unset, the
fleet's price is used: the controller's `--gpu-price-per-hour`
($GEARSHIFT_GPU_PRICE_PER_HOUR), overridden per host by the host label
`gearshift.dev/gpu-price-per-hour` (the agent's `labels`). A model's price is the
mean over its ready deployments of their hosts' prices; with no price anywhere
the model has none, and a decision says so (`policies.economics.NO_PRICE_NOTE`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from gearshift.policies.economics import NO_PRICE_NOTE, PRICE_LABEL

if TYPE_CHECKING:
    from gearshift.controller.ingest.fleet import FleetState
    from gearshift.policies.loader import Policy

FLAG_SOURCE = "controller --gpu-price-per-hour"
LABEL_SOURCE = f"host label {PRICE_LABEL}"


def parse_price(text: str) -> float | None:
    """A price label's value in USD per GPU-hour; None when it is not a positive number."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def host_price(labels: Mapping[str, str], fleet_price: float | None) -> tuple[float | None, str]:
    """(USD per GPU-hour, where it came from) for a host with these labels."""
    text = labels.get(PRICE_LABEL)
    if text is not None:
        value = parse_price(text)
        if value is not None:
            return value, LABEL_SOURCE
        if fleet_price is not None:
            return fleet_price, f"{FLAG_SOURCE} (label {PRICE_LABEL}={text!r} is not a positive number)"
        return None, f"label {PRICE_LABEL}={text!r} is not a positive number"
    return (fleet_price, FLAG_SOURCE) if fleet_price is not None else (None, "")


def model_price(prices: list[tuple[float | None, str]]) -> tuple[float | None, str]:
    """A model's price from its ready deployments' host prices (one each): their mean,
    over the deployments whose host has one; with the sources, joined."""
    known = [p for p, _ in prices if p is not None]
    if not known:
        sources = sorted({s for _, s in prices if s})
        return None, "; ".join(sources) if sources else "none"
    sources = sorted({s for p, s in prices if p is not None})
    source = "; ".join(sources)
    if len(known) < len(prices):
        source += f" ({len(known)} of {len(prices)} deployments' hosts have a price)"
    return sum(known) / len(known), source


def price_warning(policy: Policy, fleet_price: float | None, fleet: FleetState) -> str | None:
    """What `policy validate`/`apply` warn when the policy prices moves (an
    expected-savings rule) but no price is known anywhere: not in the policy, not the
    controller's, not on any connected host."""
    savings = [r.name for r in policy.doc.spec.rules if r.kind == "expected-savings"]
    if not savings or policy.doc.spec.cost.price_per_gpu_hour is not None or fleet_price is not None:
        return None
    if any(parse_price(e.hello.labels.get(PRICE_LABEL, "")) for e in fleet.hosts.values()):
        return None
    return (f"{policy.source}: rule {', '.join(savings)} can never move a model: spec.cost."
            f"pricePerGpuHour is unset and the fleet has no price ({NO_PRICE_NOTE})")
