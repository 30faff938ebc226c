"""`gearshift emulate`: run an emulated engine (one flavour per engine catalog entry).

Usage: `gearshift emulate --flavor ENGINE [OPTIONS] -- ARGV...` where ARGV is
exactly what the real executable would get (`serve MODEL --port P ...` for vLLM,
`MODEL --port P --backend pytorch ...` for trtllm-serve, or `build` for the
engine-build stand-in; each flavour module documents its engine's). Every option can also come from its
`GEARSHIFT_EMULATOR_*` environment variable, so the agent can tune each engine.
"""

from __future__ import annotations

import importlib.util
import sys

import click

from gearshift.agents.emulator.args import EngineArgsError, parse_engine_argv
from gearshift.agents.emulator.config import (
    DEFAULT_ITL_S,
    DEFAULT_LOAD_S,
    DEFAULT_OUTPUT_TOKENS,
    DEFAULT_TTFT_BASE_S,
    EmulatorOptions,
    FaultError,
    parse_faults_json,
)
from gearshift.agents.emulator.flavors import get_flavor
from gearshift.agents.emulator.releases import check_options
from gearshift.common.engine_versions import facts_for, release_for, version_key
from gearshift.common.engines import ENGINE_NAMES

ENV_PREFIX = "GEARSHIFT_EMULATOR_"


def _positive(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and value <= 0:
        raise click.BadParameter(f"must be > 0, got {value}", param=param)
    return value


@click.command(
    "emulate",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    help="Run an emulated engine (vLLM, trtllm-serve, ...: every engine of the catalog). "
         "ENGINE_ARGV (after `--`) is exactly what the real executable would get: "
         "`serve MODEL --port P ...` for vLLM, `MODEL --port P --backend pytorch ...` for "
         "trtllm-serve, or `build` for the engine-build stand-in. Every option also reads "
         "its GEARSHIFT_EMULATOR_* env var.",
)
@click.option("--flavor", type=click.Choice(ENGINE_NAMES), required=True,
              envvar=ENV_PREFIX + "FLAVOR", help="Which engine to emulate.")
@click.option("--capacity-rps", type=float, default=None, callback=_positive,
              envvar=ENV_PREFIX + "CAPACITY_RPS", show_envvar=True,
              help="Requests/s at which the queue saturates (default: the flavour's).")
@click.option("--load-s", type=click.FloatRange(min=0), default=DEFAULT_LOAD_S, show_default=True,
              envvar=ENV_PREFIX + "LOAD_S", show_envvar=True,
              help="Model load time; connections are refused meanwhile.")
@click.option("--ttft-base-s", type=click.FloatRange(min=0), default=DEFAULT_TTFT_BASE_S,
              show_default=True, envvar=ENV_PREFIX + "TTFT_BASE_S", show_envvar=True,
              help="Time to first token of a lone request.")
@click.option("--itl-s", type=click.FloatRange(min=0), default=DEFAULT_ITL_S, show_default=True,
              envvar=ENV_PREFIX + "ITL_S", show_envvar=True,
              help="Inter-token latency of a lone request.")
@click.option("--output-tokens", type=click.IntRange(min=1), default=DEFAULT_OUTPUT_TOKENS,
              show_default=True, envvar=ENV_PREFIX + "OUTPUT_TOKENS", show_envvar=True,
              help="Tokens generated when a request gives no max_tokens.")
@click.option("--max-batch", type=click.IntRange(min=1), default=None,
              envvar=ENV_PREFIX + "MAX_BATCH", show_envvar=True,
              help="Batch slots (default: derived from the capacity).")
@click.option("--engine-version", default=None, envvar=ENV_PREFIX + "ENGINE_VERSION",
              show_envvar=True,
              help="The release to emulate (default: the flavour's): its row of the engine's "
                   "version table decides the options accepted (others exit with status 2, "
                   "as the real parser does) and the metric names served; reported on "
                   "/version.")
@click.option("--faults", "faults_json", default=None, envvar=ENV_PREFIX + "FAULTS",
              show_envvar=True, help='Faults at start, JSON, e.g. {"crash_after_s": 5}.')
@click.option("--trtllm-metric-names", type=click.Choice(["prefixed", "unprefixed"]),
              default=None, envvar=ENV_PREFIX + "TRTLLM_METRIC_NAMES", show_envvar=True,
              help="trtllm_ names or the unprefixed ones (default: the release's; "
                   "unprefixed before 1.3).")
@click.option("--build-s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              envvar=ENV_PREFIX + "BUILD_S", show_envvar=True,
              help="Duration of the `build` stand-in.")
@click.option("--event-loop", type=click.Choice(["asyncio", "uvloop"]), default="asyncio",
              show_default=True, envvar=ENV_PREFIX + "EVENT_LOOP", show_envvar=True,
              help="uvloop costs less CPU per request but steps its timers by milliseconds "
                   "(lumpy token latencies): for zero-latency load tests.")
@click.argument("engine_argv", nargs=-1, type=click.UNPROCESSED)
def emulate(flavor: str, capacity_rps: float | None, load_s: float, ttft_base_s: float,
            itl_s: float, output_tokens: int, max_batch: int | None, engine_version: str | None,
            faults_json: str | None, trtllm_metric_names: str | None, build_s: float,
            event_loop: str, engine_argv: tuple[str, ...]) -> None:
    # Deferred so `--help` stays cheap.
    from gearshift.agents.emulator.server import run

    found = get_flavor(flavor)
    version = engine_version or found.default_version
    try:
        version_key(version)
    except ValueError as exc:
        raise click.BadParameter(f"{exc} (e.g. 0.11.0)", param_hint="--engine-version") from None
    resolved = release_for(flavor, version)
    if resolved.flagged:
        click.echo(f"warning: {flavor} {resolved.describe()}: emulating the nearest row of "
                   "the version table", err=True)
    facts = facts_for(resolved)
    try:
        if facts is not None:
            check_options(flavor, list(engine_argv), facts)
        args = parse_engine_argv(flavor, list(engine_argv))
    except EngineArgsError as exc:
        raise click.UsageError(f"engine arguments: {exc}") from None
    try:
        faults = parse_faults_json(faults_json, where=f"{ENV_PREFIX}FAULTS / --faults")
    except FaultError as exc:
        raise click.BadParameter(str(exc), param_hint="--faults") from None
    if event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise click.BadParameter("uvloop is not installed (pip install uvloop)",
                                 param_hint="--event-loop")
    prefixed = (trtllm_metric_names == "prefixed" if trtllm_metric_names
                else "trtllm_" in resolved.row.metric_names.prefixes)
    options = EmulatorOptions(
        capacity_rps=capacity_rps or found.default_capacity_rps,
        load_s=load_s, ttft_base_s=ttft_base_s, itl_s=itl_s, output_tokens=output_tokens,
        engine_version=version, max_batch=max_batch,
        trtllm_prefixed_names=prefixed, build_s=build_s, faults=faults,
        event_loop=event_loop, release_facts=facts)
    sys.exit(run(args, options))
