"""Parse the REAL command lines of the engines for the emulator.

The emulator replaces only the executable: the agent appends exactly the
arguments the real engine would get, so this module understands those flags
(and their spelling variants) and nothing more. The engines' own argument
parsers cannot be imported here (gearshift never imports the engines), hence
these small hand-written parsers: `scan_flags` and the option readers are
shared, each emulator flavour (`flavor_*.py`) holds its engine's parser, and
`parse_engine_argv` finds the flavour by catalog name. Unknown `--flag value`
pairs are accepted and reported as ignored, because real deployments pass many
tuning flags the emulator has no use for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

TRTLLM_BACKENDS = ("pytorch", "tensorrt")
DEFAULT_PORT = 8000
VLLM_DEFAULT_HOST = "0.0.0.0"
TRTLLM_DEFAULT_HOST = "localhost"
DEFAULT_GPU_MEMORY_FRACTION = 0.9


class EngineArgsError(ValueError):
    """The engine command line is invalid; the message names the flag and the value."""


@dataclass(frozen=True)
class EngineArgs:
    """What the emulated engine was asked to serve, read from its real command line."""

    flavor: str                     # the engine's catalog name
    command: Literal["serve", "build"]
    model: str                      # checkpoint path or hub id (positional MODEL)
    served_model_name: str          # the name clients put in "model"
    host: str
    port: int
    tensor_parallel_size: int = 1
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION
    shutdown_timeout_s: float | None = None   # vLLM --shutdown-timeout; None = abort on SIGTERM
    backend: str = ""                          # trtllm-serve --backend
    config_path: str | None = None             # trtllm-serve --config / --extra_llm_api_options
    enable_iter_perf_stats: bool = False       # from the trtllm config file
    return_perf_metrics: bool = False          # from the trtllm config file
    enable_metrics: bool = True                # False: a flag-gated metrics endpoint is off
    ignored: tuple[str, ...] = field(default_factory=tuple)


def _norm(flag: str) -> str:
    """vLLM accepts both dashes and underscores; trtllm uses underscores. Compare one form."""
    return flag.replace("_", "-")


# canonical key -> accepted spellings (normalized with _norm)
_VLLM_FLAGS: dict[str, tuple[str, ...]] = {
    "model": ("--model",),
    "host": ("--host",),
    "port": ("--port",),
    "served_model_name": ("--served-model-name",),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "gpu_memory_fraction": ("--gpu-memory-utilization",),
    "shutdown_timeout_s": ("--shutdown-timeout",),
}
_TRTLLM_FLAGS: dict[str, tuple[str, ...]] = {
    "host": ("--host",),
    "port": ("--port",),
    "backend": ("--backend",),
    "tensor_parallel_size": ("--tp-size",),
    "gpu_memory_fraction": ("--kv-cache-free-gpu-memory-fraction",),
    "config_path": ("--config", "--extra-llm-api-options"),
    "served_model_name": ("--served-model-name",),
}


def scan_flags(argv: list[str], flags: dict[str, tuple[str, ...]],
               switches: dict[str, tuple[str, ...]] | None = None,
               ) -> tuple[list[str], dict[str, str], list[str]]:
    """Split argv into positionals, known flag values and ignored tokens.

    `switches` are flags that take no value (`--enable-metrics`); one that is given
    appears in the known values as "true"."""
    switch_of = {_norm(spelling): key for key, spellings in (switches or {}).items()
                 for spelling in spellings}
    lookup = {spelling: key for key, spellings in flags.items() for spelling in spellings}
    positionals: list[str] = []
    known: dict[str, str] = {}
    ignored: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token == "-":
            positionals.append(token)
            i += 1
            continue
        name, has_eq, inline = token.partition("=")
        if not has_eq and _norm(name) in switch_of:
            known[switch_of[_norm(name)]] = "true"
            i += 1
            continue
        key = lookup.get(_norm(name))
        if key is None:
            # Unknown flag: take the next token as its value unless it is another flag.
            if has_eq:
                ignored.append(token)
                i += 1
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                ignored.extend(argv[i:i + 2])
                i += 2
            else:
                ignored.append(token)
                i += 1
            continue
        if has_eq:
            value = inline
            i += 1
        else:
            if i + 1 >= len(argv):
                raise EngineArgsError(f"option {name} needs a value")
            value = argv[i + 1]
            i += 2
        known[key] = value
    return positionals, known, ignored


def int_option(flag: str, value: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise EngineArgsError(f"option {flag}: {value!r} is not an integer") from None
    if not low <= number <= high:
        raise EngineArgsError(f"option {flag}: {number} is outside {low}..{high}")
    return number


def fraction_option(flag: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise EngineArgsError(f"option {flag}: {value!r} is not a number") from None
    if not 0.0 < number <= 1.0:
        raise EngineArgsError(f"option {flag}: {number} must be in (0, 1]")
    return number


def parse_vllm(argv: list[str]) -> EngineArgs:
    """`serve MODEL --host H --port P --served-model-name N --tensor-parallel-size T ...`."""
    positionals, known, ignored = scan_flags(argv, _VLLM_FLAGS)
    if not positionals or positionals[0] != "serve":
        raise EngineArgsError(
            f"vllm: expected the subcommand 'serve' first, got {positionals[:1] or argv[:1]}")
    rest = positionals[1:]
    model = known.get("model") or (rest[0] if rest else "")
    if not model:
        raise EngineArgsError("vllm serve: missing MODEL (positional or --model)")
    if len(rest) > 1:
        raise EngineArgsError(f"vllm serve: unexpected extra arguments {rest[1:]}")
    timeout: float | None = None
    if "shutdown_timeout_s" in known:
        try:
            timeout = float(known["shutdown_timeout_s"])
        except ValueError:
            raise EngineArgsError(
                f"option --shutdown-timeout: {known['shutdown_timeout_s']!r} is not a number"
            ) from None
        if timeout < 0:
            raise EngineArgsError(f"option --shutdown-timeout: {timeout} must be >= 0")
    return EngineArgs(
        flavor="vllm",
        command="serve",
        model=model,
        served_model_name=known.get("served_model_name") or model,
        host=known.get("host") or VLLM_DEFAULT_HOST,
        port=int_option("--port", known.get("port", str(DEFAULT_PORT)), 0, 65535),
        tensor_parallel_size=int_option("--tensor-parallel-size",
                                  known.get("tensor_parallel_size", "1"), 1, 1024),
        gpu_memory_fraction=fraction_option("--gpu-memory-utilization",
                                      known.get("gpu_memory_fraction", "0.9")),
        shutdown_timeout_s=timeout,
        ignored=tuple(ignored),
    )


def _read_trtllm_config(path: str) -> dict[str, object]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise EngineArgsError(f"option --config: cannot read {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise EngineArgsError(f"option --config: {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EngineArgsError(f"option --config: {path} must hold a mapping, got {type(data).__name__}")
    return data


def _trtllm_served_name(model: str) -> str:
    # trtllm-serve names a local checkpoint directory by its basename.
    if os.path.isdir(model):
        return os.path.basename(os.path.normpath(model))
    return model


def parse_trtllm(argv: list[str]) -> EngineArgs:
    """`MODEL --host H --port P --backend B --tp_size T --kv_cache_free_gpu_memory_fraction F`,
    optionally prefixed by `serve`; `build ...` is the engine-build stand-in."""
    positionals, known, ignored = scan_flags(argv, _TRTLLM_FLAGS)
    if positionals and positionals[0] == "build":
        return EngineArgs(flavor="tensorrt-llm", command="build", model=" ".join(positionals[1:]),
                          served_model_name="", host="", port=0, ignored=tuple(ignored))
    if positionals and positionals[0] == "serve":
        positionals = positionals[1:]
    if not positionals:
        raise EngineArgsError("trtllm-serve: missing MODEL (the first positional argument)")
    if len(positionals) > 1:
        raise EngineArgsError(f"trtllm-serve: unexpected extra arguments {positionals[1:]}")
    model = positionals[0]
    backend = known.get("backend", "pytorch")
    if backend not in TRTLLM_BACKENDS:
        raise EngineArgsError(
            f"option --backend: {backend!r} is not one of {', '.join(TRTLLM_BACKENDS)}")
    config_path = known.get("config_path")
    config = _read_trtllm_config(config_path) if config_path else {}
    return EngineArgs(
        flavor="tensorrt-llm",
        command="serve",
        model=model,
        served_model_name=known.get("served_model_name") or _trtllm_served_name(model),
        host=known.get("host") or TRTLLM_DEFAULT_HOST,
        port=int_option("--port", known.get("port", str(DEFAULT_PORT)), 0, 65535),
        tensor_parallel_size=int_option("--tp_size", known.get("tensor_parallel_size", "1"), 1, 1024),
        gpu_memory_fraction=fraction_option("--kv_cache_free_gpu_memory_fraction",
                                      known.get("gpu_memory_fraction", "0.9")),
        backend=backend,
        config_path=config_path,
        enable_iter_perf_stats=bool(config.get("enable_iter_perf_stats", False)),
        return_perf_metrics=bool(config.get("return_perf_metrics", False)),
        ignored=tuple(ignored),
    )


def parse_engine_argv(flavor: str, argv: list[str]) -> EngineArgs:
    """Parse the argv the real executable of `flavor` (a catalog engine name) would get."""
    from gearshift.agents.emulator.flavors import get_flavor
    from gearshift.common.errors import InvalidArgument

    try:
        found = get_flavor(flavor)
    except InvalidArgument as exc:
        raise EngineArgsError(exc.message) from None
    return found.parse(argv)
