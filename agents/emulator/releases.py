"""The emulated engine as one release: its option set and its metric names.

`gearshift emulate --engine-version V` picks V's row of the engine's version table
(`gearshift.common.engine_versions`) and the facts extracted from that release's
source (`common/engine_releases/`). `check_options` refuses, as the real parser
would (exit status 2, a message naming the flag), every option the release does not
know: vLLM's parser also takes `--flag_name` for `--flag-name`, `--no-flag` for a
boolean `--flag` and `--flag.key` for a JSON option; trtllm-serve (click) and SGLang
take only the spellings they declare. `ReleaseMetrics` serves only the metric
families the release exports, so an emulated 0.10 vLLM has no
`vllm:inter_token_latency_seconds`. Facts derived from a later release (their
origin says "derived") are a lower bound of what the release has: their options
are still enforced, their metric list is not used to drop families.
"""

from __future__ import annotations

import re

from gearshift.agents.emulator.args import EngineArgsError
from gearshift.agents.emulator.metrics import EngineMetrics, RequestRecord
from gearshift.common.engine_versions import ReleaseFacts

_NUMBER_RE = re.compile(r"^-\d")
# Engines whose parser (vLLM's FlexibleArgumentParser) rewrites `_` to `-` in long options.
_DASH_NORMALIZING = frozenset({"vllm"})
_CLICK_ENGINES = frozenset({"tensorrt-llm"})
_ENGINE_PREFIXES = ("vllm:", "sglang:", "trtllm_")


def _known(engine: str, flag: str, options: frozenset[str]) -> bool:
    if flag in options:
        return True
    if engine not in _DASH_NORMALIZING or not flag.startswith("--"):
        return False
    flag = "--" + flag[2:].replace("_", "-")
    base = flag.split(".", 1)[0]  # --json-arg.key value
    return (flag in options or base in options
            or (flag.startswith("--no-") and "--" + flag[5:] in options))


def unknown_options(engine: str, argv: list[str], facts: ReleaseFacts) -> list[str]:
    """The options in `argv` that `facts`' release does not know, in order."""
    if engine == "tensorrt-llm" and argv[:1] == ["build"]:
        return []  # the engine-build stand-in, not trtllm-serve
    unknown: list[str] = []
    for token in argv:
        if not token.startswith("-") or token in ("-", "--") or _NUMBER_RE.match(token):
            continue
        flag = token.split("=", 1)[0]
        if not _known(engine, flag, facts.options):
            unknown.append(flag)
    return unknown


def check_options(engine: str, argv: list[str], facts: ReleaseFacts) -> None:
    """`EngineArgsError` naming the first option the release does not know (the real
    parsers stop at the first: argparse lists all, click names one)."""
    unknown = unknown_options(engine, argv, facts)
    if not unknown:
        return
    if engine in _CLICK_ENGINES:
        raise EngineArgsError(f"{engine} {facts.version}: No such option: {unknown[0]}")
    raise EngineArgsError(
        f"{engine} {facts.version}: unrecognized arguments: {' '.join(unknown)}")


def _family(name: str) -> str:
    for suffix in ("_total", "_created"):
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


class ReleaseMetrics:
    """A metrics container that renders only the engine families `facts` lists."""

    def __init__(self, inner: EngineMetrics, facts: ReleaseFacts) -> None:
        self.inner = inner
        self.allowed = facts.metrics

    def observe_token(self, itl_s: float) -> None:
        self.inner.observe_token(itl_s)

    def observe_request(self, record: RequestRecord) -> None:
        self.inner.observe_request(record)

    def _keeps(self, name: str) -> bool:
        if not name.startswith(_ENGINE_PREFIXES):
            return True  # process_*, python_*, gearshift_emulator_info
        return _family(name) in self.allowed

    def render(self) -> bytes:
        kept: list[str] = []
        keep = True
        for line in self.inner.render().decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                keep = self._keeps(line.split(" ", 3)[2])
            if keep:
                kept.append(line)
        return ("\n".join(kept) + "\n").encode() if kept else b""


def for_release(metrics: EngineMetrics, facts: ReleaseFacts | None) -> EngineMetrics:
    """`metrics` limited to `facts`' families (unchanged without facts or with derived ones)."""
    if facts is None or facts.derived:
        return metrics
    return ReleaseMetrics(metrics, facts)
