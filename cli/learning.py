"""`gearshift models capacity NAME` and `gearshift models forecast NAME`: what was learned.

The controller returns the learned capacity models and the request-rate history;
the estimates, forecasts and plots are computed here with the same code the
controller uses, so what a person sees is what the policy saw.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from gearshift.cli.client import call, control_stub
from gearshift.cli.output import output_option, print_json, print_table
from gearshift.controller.decisions.learning import FORECAST_MIN_STEP_S
from gearshift.policies.capacity import CapacityModel, plot_capacity
from gearshift.policies.forecast import forecast_rate, plot_forecast
from gearshift.v1 import control_pb2

plot_option = click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
                           default=None, help="also write a PNG plot to this file")


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


@click.command()
@click.argument("name")
@plot_option
@output_option
@click.pass_context
def capacity(ctx: click.Context, name: str, plot_path: Path | None, output: str) -> None:
    """Learned capacity at the SLA per engine (with its uncertainty band)."""
    with control_stub(ctx) as stub:
        resp = call(stub.GetCapacity, control_pb2.GetCapacityRequest(model=name))
    sla_ttft = resp.sla_ttft_p99_s or None
    sla_itl = resp.sla_itl_p99_s or None
    learned = [CapacityModel.from_dict(json.loads(m), where=f"capacity model of {name}")
               for m in resp.models_json]
    estimates = [(m, m.estimate(sla_ttft, sla_itl)) for m in learned]
    priors = json.loads(resp.priors_json or "{}")
    if output == "json":
        print_json({"model": name, "sla_ttft_p99_s": sla_ttft, "sla_itl_p99_s": sla_itl,
                    "priors": priors,
                    "estimates": [{"key": asdict(m.key), **asdict(e)} for m, e in estimates]})
    else:
        rows = [(m.key.engine, m.key.engine_version or "-", m.key.gpu_model or "-", e.status,
                 _fmt(e.capacity_rps), f"{_fmt(e.low)} – {_fmt(e.high)}", e.points,
                 _fmt(e.max_observed_rps), e.reason) for m, e in estimates]
        print_table(f"{name}: capacity per replica at the SLA (TTFT p99 {_fmt(sla_ttft, ' s')}, "
                    f"ITL p99 {_fmt(sla_itl, ' s')})",
                    ["engine", "version", "GPU", "status", "req/s", "band", "points",
                     "max seen req/s", "note"], rows)
        if not estimates:
            click.echo("nothing measured yet: the policy uses the configured priors"
                       + (f" {json.dumps(priors.get('engines', {}))}" if priors else " (none set)"))
    if plot_path is not None:
        if not learned:
            raise click.ClickException(f"no capacity data for {name} to plot yet")
        for i, (m, e) in enumerate(estimates):
            path = plot_path if i == 0 else plot_path.with_name(
                f"{plot_path.stem}-{m.key.engine}-{i}{plot_path.suffix}")
            plot_capacity(m, path, sla_ttft_p99_s=sla_ttft, sla_itl_p99_s=sla_itl, estimate=e)
            click.echo(f"wrote {path}", err=True)


@click.command()
@click.argument("name")
@click.option("--horizon", "horizon_h", type=click.FloatRange(min=0.1, max=24 * 28), default=24.0,
              show_default=True, help="hours ahead")
@plot_option
@output_option
@click.pass_context
def forecast(ctx: click.Context, name: str, horizon_h: float, plot_path: Path | None,
             output: str) -> None:
    """Forecast of the sustained (low quantile) and peak request rate over the horizon."""
    with control_stub(ctx) as stub:
        resp = call(stub.GetRateHistory, control_pb2.GetRateHistoryRequest(model=name))
    ts, rps = list(resp.ts), list(resp.rps)
    now = (ts[-1] + resp.resolution_s) if ts else 0.0
    fc = forecast_rate(ts, rps, now, horizon_h * 3600,
                       step_s=max(resp.resolution_s, FORECAST_MIN_STEP_S))
    if output == "json":
        data = asdict(fc)
        del data["start_ts"]  # path_ts[0]: the JSON keeps its fields
        for k in ("path_ts", "path_low", "path_high"):
            data[k] = list(data[k])
        print_json({"model": name, "samples": len(ts), **data})
    else:
        print_table(f"{name}: request-rate forecast over {horizon_h:g} h", ["", "value"], [
            ("status", fc.status), ("method", fc.method),
            (f"sustained (q={fc.quantile:.2f})", _fmt(fc.sustained_rps, " req/s")),
            ("peak", _fmt(fc.peak_rps, " req/s")), ("history samples used", fc.points),
            ("note", fc.reason or "-")])
    if plot_path is not None:
        plot_forecast(ts, rps, fc, plot_path, title=f"{name}: request rate and forecast")
        click.echo(f"wrote {plot_path}", err=True)
