"""The emulated engine as one release: its option set and its metric names.

`gearshift emulate --engine-version V` picks V's row of the engine's version table
(`gearshift.common.engine_versions`) and the facts extracted from that release's
source (`common/engine_releases/`). `check_options` refuses, as the real parser
would (exit status 2, a message naming the flag), every option the release does not
know, with the spellings and the message of the engine's parser (the catalog's
`LaunchFacts.option_parser`: vLLM's also takes `--flag_name` for `--flag-name`,
`--no-flag` for a boolean `--flag` and `--flag.key` for a JSON option; the others only
the spellings they declare). `ReleaseMetrics` serves only the metric
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
from gearshift.common.engines import CATALOG, OptionParser, engine_entry

_NUMBER_RE = re.compile(r"^-\d")
# Every engine's metric name prefixes: families outside them are the process's own.
_ENGINE_PREFIXES = tuple(dict.fromkeys(p for e in CATALOG for p in e.metric_names.prefixes if p))


def _known(engine: str, flag: str, options: frozenset[str]) -> bool:
    if flag in options:
        return True
    # vLLM's FlexibleArgumentParser rewrites `_` to `-` in long options.
    parser = engine_entry(engine).launch.option_parser
    if parser is not OptionParser.FLEXIBLE_ARGPARSE or not flag.startswith("--"):
        return False
    flag = "--" + flag[2:].replace("_", "-")
    base = flag.split(".", 1)[0]  # --json-arg.key value
    return (flag in options or base in options
            or (flag.startswith("--no-") and "--" + flag[5:] in options))


def unknown_options(engine: str, argv: list[str], facts: ReleaseFacts) -> list[str]:
    """The options in `argv` that `facts`' release does not know, in order."""
    if engine_entry(engine).build is not None and argv[:1] == ["build"]:
        return []  # the engine-build stand-in, not the serving executable
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
    if engine_entry(engine).launch.option_parser is OptionParser.CLICK:
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
