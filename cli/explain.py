"""Short reports a person can act on: `decisions explain ID` and `migrations show ID`.

Pure rendering: protobuf message in, text out (no I/O), so the reports are tested
without a controller. Values get units from their names (the policy signal
registry first, then the naming conventions of the decision core and the canary
analysis: `_rps`, `_ms`, `_s`, `_usd`, `_h`, shares and rates as %). The rule's
tests are rendered from the decision's structured conditions (signal, operator,
threshold, observed value, unit), never parsed from the core's prose; the
reversal lines are derived only from those conditions and the stored inputs, and
when they say nothing specific it prints an honest generic sentence instead of
guessing. "Where the
figures come from" says, per engine (and the release it runs, where known), whether
its capacity was measured or came from a policy prior, a default ratio or another
release of the engine, and why (too little data, no SLA, …), and whether the
traffic level is the forecast's or the observed one.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console
from rich.table import Table

from gearshift.cli.output import times_line
from gearshift.policies.signals import ENGINE_VERSION, SIGNALS
from gearshift.v1 import control_pb2

REPORT_WIDTH_CHARS = 160
GENERIC_REVERSAL = ("a change in the inputs above that makes another engine cheaper or the "
                    "current one break its SLA")
# Inputs every decision carries; the rule's own inputs are shown before them.
_TRAFFIC_KEYS = ("rps_current", "rps_sustained", "rps_mean", "rps_peak", "burstiness",
                 "revisions_per_week", "history_h", "dwell_h")
_FRACTION_WORDS = ("share", "error_rate", "hit_rate", "tolerance", "fraction", "usage", "hysteresis",
                   "capacity_gain")
_LATENCY_WORDS = ("ttft", "itl", "latency", "e2e")
_SYMBOL = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "eq": "==", "ne": "!=", "in": "in"}
_REVERSE = {"gt": "falling to {v} or below", "ge": "falling below {v}",
            "lt": "rising to {v} or above", "le": "rising above {v}",
            "eq": "no longer being {v}", "ne": "becoming {v}", "in": "leaving {v}"}


# -- values ---------------------------------------------------------------------------------


def fmt_time(ts: Timestamp) -> str:
    if ts.seconds == 0 and ts.nanos == 0:
        return "-"
    return datetime.fromtimestamp(ts.seconds, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _num(v: float) -> str:
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,}"
    return f"{v:,.{2 if abs(v) >= 1 else 3}f}".rstrip("0").rstrip(".")


def usd(v: float, signed: bool = False) -> str:
    sign = "-" if v < 0 else ("+" if signed and v > 0 else "")
    return f"{sign}${abs(v):,.2f}"


def _unit_of(key: str) -> str:
    base = key.split(".", 1)[0]
    spec = SIGNALS.get(base)
    if spec is not None and spec.unit not in ("", "ratio"):
        return {"USD": "usd", "1/week": "week"}.get(spec.unit, spec.unit)
    if any(w in key for w in _FRACTION_WORDS):
        return "%"
    if key == "burstiness" or "_ratio" in base or base.endswith("_scale"):
        return "x"
    if (base.endswith("_rps") or base.startswith("rps_") or "capacity_rps" in base
            or base in ("capacity_low", "capacity_high")):
        return "req/s"
    if base.endswith("usd_per_day"):
        return "usd/day"
    if base.endswith("usd_per_h"):
        return "usd/h"
    if base.endswith("_usd") or base.startswith("usd_"):
        return "usd"
    if base.endswith("_ms"):
        return "ms"
    if base.endswith("_s"):
        return "ms" if any(w in base for w in _LATENCY_WORDS) else "s"
    if base.endswith("_h"):
        return "h"
    if base.endswith("per_week"):
        return "week"
    return ""


def fmt_value(key: str, value: Any) -> str:
    """One input, figure or expected value with its unit, read from its name."""
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, int | float):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    unit = _unit_of(key)
    if unit == "%":
        return f"{value * 100:.1f}%".replace(".0%", "%")
    if unit == "usd":
        return usd(value)
    if unit in ("usd/day", "usd/h"):
        return f"{usd(value)}/{unit[4:]}"
    if unit == "ms" and key.split(".", 1)[0].endswith("_s"):
        return f"{value * 1000:,.0f} ms"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "week":
        return f"{_num(value)}/week"
    return f"{_num(value)} {unit}".rstrip()


def struct_dict(msg: Message) -> dict[str, Any]:
    """A google.protobuf.Struct as a plain dict."""
    d = MessageToDict(msg, preserving_proto_field_name=True)
    return d if isinstance(d, dict) else {}


def _alternatives(d: control_pb2.Decision) -> list[tuple[str, str]]:
    out = []
    for item in MessageToDict(d.alternatives) or []:
        if isinstance(item, Mapping):
            option = str(item.get("option") or item.get("engine") or item.get("rule") or "?")
            out.append((option, str(item.get("why") or item.get("reason") or "")))
        else:
            out.append((str(item), ""))
    return out


# -- decisions ------------------------------------------------------------------------------


def decision_headline(d: control_pb2.Decision) -> str:
    return (f"Move {d.model} from {d.from_engine or '?'} to {d.to_engine or '?'} "
            f"(rule {d.rule or '?'}) — {d.status or 'unknown'}")


def _with_unit(signal: str, unit: str, value: Any) -> str:
    """A condition's value in the unit the condition carries."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if not isinstance(value, int | float) or isinstance(value, bool) or unit in ("", "ratio"):
        return fmt_value(signal, value)
    if unit == "USD":
        return usd(value)
    if unit == "1/week":
        return f"{_num(value)}/week"
    return f"{_num(value)} {unit}"


def _conditions(d: control_pb2.Decision) -> list[dict[str, Any]]:
    return [MessageToDict(c, preserving_proto_field_name=True,
                          always_print_fields_with_no_presence=True) for c in d.conditions]


def _condition_line(c: Mapping[str, Any]) -> str:
    signal, unit, op = str(c.get("signal", "?")), str(c.get("unit", "")), str(c.get("operator", ""))
    seen = _with_unit(signal, unit, c.get("observed"))
    threshold = _with_unit(signal, unit, c.get("threshold"))
    verdict = "held" if c.get("held") else "not met"
    group = f" ({c['group']})" if c.get("group") == "whenAny" else ""
    return f"  tested: {signal} = {seen}, needs {_SYMBOL.get(op, op)} {threshold}: {verdict}{group}"


def _ordered_inputs(inputs: Mapping[str, Any]) -> list[str]:
    def rank(key: str) -> tuple[int, int, str]:
        if key in _TRAFFIC_KEYS:
            return (1, _TRAFFIC_KEYS.index(key), key)
        if key.startswith(("traffic_", "forecast_")):
            return (1, len(_TRAFFIC_KEYS), key)
        if "." in key or key in ("sla_ttft_p99_ms", "nvidia", "gpu_model"):
            return (2, 0, key)
        return (0, 0, key)  # the rule's own inputs first
    return sorted(inputs, key=rank)


def _reversals(d: control_pb2.Decision, inputs: Mapping[str, Any],
               conditions: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    if d.rule == "pin":
        out.append(f"the pin to {d.to_engine} being removed or changed")
    net, margin = inputs.get("net_savings_usd"), inputs.get("margin_usd")
    for c in conditions:
        if not c.get("held"):
            continue
        sig, unit = str(c.get("signal", "?")), str(c.get("unit", ""))
        observed, threshold = c.get("observed"), c.get("threshold")
        if sig == "net_savings_usd" and c.get("group") == "test":
            net, margin = observed, threshold  # the savings rule's test: said in words below
            continue
        words = _REVERSE.get(str(c.get("operator")), "changing from {v}")
        out.append(f"{sig} {words.format(v=_with_unit(sig, unit, threshold))} "
                   f"(now {_with_unit(sig, unit, observed)})")
    if isinstance(net, int | float) and isinstance(margin, int | float):
        out.append(f"expected net savings (now {usd(net)} over the horizon) dropping to the "
                   f"margin of {usd(margin)} or below, e.g. when traffic or measured capacity "
                   "changes")
    sla = inputs.get("sla_ttft_p99_ms")
    target = inputs.get(f"ttft_p99_ms.{d.to_engine}")
    if isinstance(sla, int | float) and isinstance(target, int | float):
        out.append(f"{d.to_engine} breaking its SLA: TTFT p99 rising above {fmt_value('x_ms', sla)} "
                   f"(measured {fmt_value('x_ms', target)})")
    return out


OWN_SOURCES = ("measured", "lower_bound", "upper_bound")
# By `policies.priors` source (spelled out: importing it loads the policy schema, a tenth of
# a second of every CLI run).
_CAPACITY_SOURCE_WORDS = {
    "measured": "measured at the SLA",
    "lower_bound": "measured lower bound (the SLA was never reached: at least this)",
    "upper_bound": "measured upper bound (the SLA was missed even at the lowest load seen)",
    "prior": "NOT MEASURED: the policy's prior (spec.models)",
    "ratio-prior": "NOT MEASURED: {base}'s figure x {ratio} (the ratio of the policy's priors)",
    "default-ratio": "NOT MEASURED: a default, {base}'s figure x {ratio} (assumed, not measured; "
                     "public range {low}..{high}x)",
    "unknown": "unknown: nothing measured and no prior",
    "earlier-release": "NOT MEASURED on this release: another release's figure as its prior "
                       "(band widened)",
}


def _engines_cited(d: control_pb2.Decision, inputs: Mapping[str, Any]) -> list[str]:
    cited = {k.split(".", 1)[1] for k in inputs if k.startswith("capacity_source.")}
    first = [e for e in (d.from_engine, d.to_engine) if e in cited]
    return first + sorted(cited - set(first))


def _plain(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, int | float) else "?"


def _provenance(d: control_pb2.Decision, inputs: Mapping[str, Any]) -> list[str]:
    """Where each capacity figure and the traffic level came from, in plain words."""
    out: list[str] = []
    for e in _engines_cited(d, inputs):
        source = str(inputs[f"capacity_source.{e}"])
        words = _CAPACITY_SOURCE_WORDS.get(source, source).format(
            base=inputs.get(f"capacity_ratio_base.{e}", "the other engine"),
            ratio=_plain(inputs.get(f"capacity_ratio.{e}")),
            low=_plain(inputs.get(f"capacity_ratio_low.{e}")),
            high=_plain(inputs.get(f"capacity_ratio_high.{e}")))
        value = fmt_value("capacity_rps", inputs.get(f"capacity_rps.{e}"))
        low, high = inputs.get(f"capacity_low.{e}"), inputs.get(f"capacity_high.{e}")
        band = (f", band {fmt_value('capacity_rps', low)} .. {fmt_value('capacity_rps', high)}"
                if isinstance(low, int | float) and isinstance(high, int | float) else "")
        release = inputs.get(f"{ENGINE_VERSION}.{e}")
        on = f"{e} {release}" if release else e
        out.append(f"  capacity on {on}: {value}, {words}{band}")
        note = inputs.get(f"capacity_note.{e}")
        if note:
            out.append(f"    {'note' if source in OWN_SOURCES else 'why'}: {note}")
    basis = inputs.get("traffic_basis")
    level = fmt_value("traffic_level_rps", inputs.get("traffic_level_rps"))
    if basis == "forecast":
        made = inputs.get("forecast_age_h")
        when = f", made {fmt_value('x_h', made)} ago" if isinstance(made, int | float) else ""
        out.append(f"  traffic level: {level}, the FORECAST sustained rate "
                   f"({inputs.get('forecast_method', '?')}, over "
                   f"{fmt_value('x_h', inputs.get('forecast_horizon_h'))}{when}); the window's "
                   f"traffic scaled {fmt_value('x_scale', inputs.get('traffic_scale'))}")
    elif basis == "observed":
        out.append(f"  traffic level: {level}, the OBSERVED sustained rate (the forecast was not "
                   f"used: {inputs.get('traffic_note') or 'none'})")
    if basis is not None and inputs.get("savings_basis"):
        out.append(f"  the savings estimate was bound by the {inputs['savings_basis']} figure")
    return out


def decision_report(d: control_pb2.Decision) -> str:
    """`gearshift decisions explain ID` as plain text."""
    inputs, expected = struct_dict(d.inputs), struct_dict(d.expected)
    alts = _alternatives(d)
    conditions = _conditions(d)
    lines = [decision_headline(d), f"  id {d.id}, decided {fmt_time(d.created_at)}", "", "Why"]
    lines.append(f"  rule {d.rule}" + (f": {d.reason}" if d.reason else ""))
    lines += [_condition_line(c) for c in conditions]
    if d.HasField("trial_share"):
        lines.append(f"  trial first: {d.to_engine} serves {d.trial_share:.0%} of the traffic "
                     "to be measured before the move")
    known = [k for k in _ordered_inputs(inputs) if inputs[k] is not None]
    width = max((len(k) for k in known), default=0)
    lines += [f"  {k:<{width}}  {fmt_value(k, inputs[k])}" for k in known]
    missing = sorted(k for k, v in inputs.items() if v is None)
    if missing:
        lines.append(f"  not measured: {', '.join(missing)}")
    provenance = _provenance(d, inputs)
    if provenance:
        lines += ["", "Where the figures come from", *provenance]
    no_price = inputs.get("price_note")
    lines += ["", "Expected effect",
              *_expected_lines(expected, no_price if isinstance(no_price, str) else None)]
    lines += ["", "Alternatives rejected"]
    lines += [_alternative_line(d, o, w) for o, w in alts] or ["  none recorded"]
    reversals = _reversals(d, inputs, conditions) or [GENERIC_REVERSAL]
    lines += ["", "What would reverse it", *(f"  {r}" for r in reversals)]
    lines += ["", "Policy", f"  version {d.policy_version or '?'}, mode {d.mode or '?'}"]
    status = d.status or "unknown"
    lines += ["", "Status", f"  {status}" + (f": {d.status_reason}" if d.status_reason else "")
              + (f" (updated {fmt_time(d.updated_at)})" if d.updated_at.seconds else "")]
    return "\n".join(lines)


def _alternative_line(d: control_pb2.Decision, option: str, why: str) -> str:
    if option == d.from_engine and d.reason and why == f"stay: rule {d.rule}: {d.reason}":
        return f"  stay on {option}: rejected by rule {d.rule} (see Why)"
    return f"  {option}: {why}" if why else f"  {option}"


def _expected_lines(e: Mapping[str, Any], no_price: str | None = None) -> list[str]:
    """The expected effect; `no_price`: why nothing is priced (no GPU price known)."""
    out: list[str] = []
    day = e.get("cost_usd_per_day")
    if isinstance(day, int | float):
        effect = "saves" if day < 0 else "costs"
        out.append(f"  cost per day      {usd(day, signed=True)}/day ({effect} {usd(abs(day))} a day)")
    horizon_h = e.get("horizon_h")
    if horizon_h is None and isinstance(e.get("horizon_s"), int | float):
        horizon_h = e["horizon_s"] / 3600.0
    if isinstance(day, int | float) and isinstance(horizon_h, int | float):
        out.append(f"  over the horizon  {usd(day * horizon_h / 24.0, signed=True)} serving cost "
                   f"over {_num(horizon_h)} h")
    net, switch = e.get("net_savings_usd"), e.get("switch_cost_usd")
    if isinstance(net, int | float):
        tail = f" after a switch cost of {usd(switch)}" if isinstance(switch, int | float) else ""
        out.append(f"  net over horizon  saves {usd(net)}{tail}" if net >= 0
                   else f"  net over horizon  loses {usd(-net)}{tail}")
    elif isinstance(switch, int | float):
        out.append(f"  switch cost       {usd(switch)}")
    ttft = e.get("ttft_p99_ms")
    if isinstance(ttft, int | float):
        word = "slower" if ttft > 0 else "faster" if ttft < 0 else "unchanged"
        out.append(f"  TTFT p99          {ttft:+,.0f} ms ({word})")
    shown = {"cost_usd_per_day", "horizon_h", "horizon_s", "net_savings_usd", "switch_cost_usd",
             "ttft_p99_ms"}
    for k in sorted(set(e) - shown):
        if e[k] is not None:
            out.append(f"  {k:<16}  {fmt_value(k, e[k])}")
    unknown = sorted(k for k in shown & set(e) if e[k] is None)
    if no_price is not None:  # the money figures are unknown for want of a price
        unpriced = [k for k in unknown if k in _PRICED]
        if unpriced:
            out.append(f"  unknown: {', '.join(unpriced)} ({no_price})")
        unknown = [k for k in unknown if k not in _PRICED]
    if unknown:
        out.append(f"  unknown: {', '.join(unknown)} (facts not measured yet)")
    return out or [f"  not estimated ({no_price or 'facts not measured yet'})"]


_PRICED = frozenset({"cost_usd_per_day", "net_savings_usd", "switch_cost_usd"})


def expected_saving_per_day(d: control_pb2.Decision) -> str:
    """The list column: what the move saves a day (negative cost), or '-'."""
    day = struct_dict(d.expected).get("cost_usd_per_day")
    if not isinstance(day, int | float):
        return "-"
    return usd(-day)


# -- migrations -----------------------------------------------------------------------------


def migration_phase(m: control_pb2.Migration) -> str:
    if m.phase == "canary" and len(m.canary_steps) > 0:
        step = min(m.canary_step, len(m.canary_steps) - 1)
        return f"canary {step + 1}/{len(m.canary_steps)} ({m.canary_steps[step]:.0%})"
    return m.phase or "?"


def migration_move(m: control_pb2.Migration) -> str:
    """What the migration changes: engines, or the revision a rollout brings."""
    if m.kind == "revision_rollout":
        return f"revision {m.target_revision or '?'} on {m.to_engine or m.from_engine or '?'}"
    return f"{m.from_engine or '?'} → {m.to_engine or '?'}"


_FIGURE_ORDER = ("step", "share", "candidate_ttft_p99_s", "baseline_ttft_p99_s", "sla_ttft_p99_s",
                 "candidate_itl_p99_s", "baseline_itl_p99_s", "sla_itl_p99_s",
                 "candidate_error_rate", "max_error_rate")


def key_figures(figures: Mapping[str, Any]) -> str:
    """Canary numbers for one table cell, one per line: the ones a person checks first."""
    parts = []
    for k in _FIGURE_ORDER:
        if figures.get(k) is None:
            continue
        v = figures[k]
        label = (k.replace("candidate_", "cand ").replace("baseline_", "base ")
                 .replace("_p99_s", " p99").replace("error_rate", "errors").replace("_", " "))
        parts.append(f"{label} {int(v)}" if k == "step" and isinstance(v, int | float)
                     else f"{label} {fmt_value(k, v)}")
    return "\n".join(parts)


def _render(items: Iterable[Any]) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=REPORT_WIDTH_CHARS, color_system=None, highlight=False,
                      emoji=False)
    for item in items:
        console.print(item)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def migration_report(m: control_pb2.Migration) -> str:
    """`gearshift migrations show ID`: header, then the step log as a table."""
    header = [f"Migration {m.id}: {m.model} {migration_move(m)} ({m.kind or '?'})",
              f"  phase     {migration_phase(m)}"]
    if m.status_message:
        header.append(f"  waiting   {m.status_message}")
    if m.reason:
        header.append(f"  reason    {m.reason}")
    if m.trial_outcome:
        header.append(f"  trial     {m.trial_outcome}")
    if m.decision_id:
        header.append(f"  decision  {m.decision_id}")
    if m.target_revision and m.kind != "revision_rollout":
        header.append(f"  revision  {m.target_revision}")
    if len(m.canary_steps) > 0:
        header.append("  canary    " + " → ".join(f"{s:.0%}" for s in m.canary_steps))
    header.append(f"  source    {', '.join(m.source_deployments) or '-'}")
    header.append(f"  target    {', '.join(m.target_deployments) or '-'}")
    times = migration_times(m)
    if times:
        header.append(f"  {times}")
    table = Table(title="steps", title_justify="left", header_style="bold")
    for c in ("time", "phase", "message", "figures"):
        table.add_column(c, overflow="fold")
    for s in m.steps:
        move = f"{s.from_phase} → {s.to_phase}" if s.from_phase != s.to_phase else s.to_phase
        table.add_row(fmt_time(s.at), move, s.message, key_figures(struct_dict(s.figures)))
    body: list[Any] = ["\n".join(header), table if len(m.steps) else "no steps recorded"]
    return _render(body)


ENDED_PHASES = frozenset({"done", "rolled_back", "aborted"})


def migration_times(m: control_pb2.Migration) -> str:
    """"created …, updated …" for a running migration, "created …, finished …" for an ended
    one: only the times it has (a running move has no finish time)."""
    if m.phase in ENDED_PHASES:
        return times_line([("created", m.created_at), ("finished", m.finished_at)])
    return times_line([("created", m.created_at), ("updated", m.updated_at)])
