"""Extract one engine release's command-line options and metric names from its own source.

Usage:
    python scripts/extract_engine_release.py ENGINE VERSION SOURCE_DIR --origin TEXT [--out DIR]

SOURCE_DIR is the root of the release's Python sources: an unpacked wheel
(`pip download --no-deps --only-binary :all: vllm==0.11.0`, then unzip) or a
checkout of the engine's repository at the release's tag. ORIGIN says where
SOURCE_DIR came from (wheel file name and sha256, or repository and commit);
it is written into the result, which goes to
`common/engine_releases/<engine>-<version>.json`.

Nothing is imported from the engine (its packages need GPUs and heavy
dependencies): the files are parsed with `ast` and read as text.

- vLLM: the options of `vllm serve` are the string literals given to
  `add_argument(...)` in `vllm/engine/arg_utils.py`, `vllm/entrypoints/cli/serve.py`
  and every `vllm/entrypoints/**/cli_args.py` (the frontend arguments moved between
  releases; a run-batch parser there adds a few options serve does not have), plus `--<field>` for every field of a
  `*FrontendArgs` dataclass (vLLM derives those flags from the field names).
  Metric names are the `"vllm:..."` literals under `vllm/v1/metrics/`.
- TensorRT-LLM: the options of the `serve` command are the strings given to
  its `@click.option(...)` decorators in `tensorrt_llm/commands/serve.py`;
  metric names are `metric_prefix + "<name>"` in `tensorrt_llm/metrics/collector.py`.
- SGLang: the options are the `add_argument(...)` literals of
  `python/sglang/srt/server_args.py` (or `sglang/srt/server_args.py` in a
  wheel) and, from the 0.5.1x line, `--<field>` (and `Arg(aliases=...)`) of the
  `A[...]`-annotated fields in `srt/arg_groups/fields/*.py`; metric names are the `"sglang:..."` literals under `srt/metrics/` and
  `srt/observability/`.

Counters are named as the engine declares them (prometheus_client adds
`_total` to a counter's samples; a declared `_total` suffix is dropped, as
prometheus_client does for the family name).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "common" / "engine_releases"
_FLAG_RE = re.compile(r"^--?[A-Za-z][\w.-]*$")


def _literal_flags(call: ast.Call) -> list[str]:
    return [a.value for a in call.args
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and _FLAG_RE.match(a.value)]


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def argparse_options(path: Path) -> set[str]:
    """Flags given as literals to `add_argument`, and `--<field>` of `*FrontendArgs` dataclasses."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _call_name(node) == "add_argument":
            found.update(_literal_flags(node))
        if isinstance(node, ast.ClassDef) and node.name.endswith("FrontendArgs"):
            for item in node.body:
                if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and not item.target.id.startswith("_")
                        and "ClassVar" not in ast.unparse(item.annotation)):
                    found.add("--" + item.target.id.replace("_", "-"))
    return found


def annotated_field_options(path: Path) -> set[str]:
    """SGLang's dataclass-derived flags: a field annotated `A[type, "help"]` or
    `A[type, Arg(..., aliases=[...])]` is `--<field-name>` plus its aliases."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(node.annotation, ast.Subscript)
                and isinstance(node.annotation.value, ast.Name)
                and node.annotation.value.id == "A"):
            continue
        found.add("--" + node.target.id.replace("_", "-"))
        meta = node.annotation.slice
        parts = meta.elts if isinstance(meta, ast.Tuple) else [meta]
        for part in parts:
            if isinstance(part, ast.Call):
                for kw in part.keywords:
                    if kw.arg == "aliases" and isinstance(kw.value, ast.List | ast.Tuple):
                        found.update(e.value for e in kw.value.elts
                                     if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return found


def click_options(path: Path, command: str) -> set[str]:
    """Flags of the click command function `command` (its `@*.option(...)` decorators)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == command:
            found: set[str] = set()
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and _call_name(deco) == "option":
                    found.update(_literal_flags(deco))
            if found:
                return found
    raise SystemExit(f"{path}: no click command function {command!r} with options")


def _family(name: str) -> str:
    return name[:-len("_total")] if name.endswith("_total") else name


def literal_metrics(paths: list[Path], prefix: str) -> set[str]:
    pattern = re.compile(r"[\"'](" + re.escape(prefix) + r"[a-z0-9_]+)[\"']")
    found: set[str] = set()
    for path in paths:
        found.update(_family(m) for m in pattern.findall(path.read_text(encoding="utf-8")))
    return found


def trtllm_metrics(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    prefix = re.search(r"metric_prefix\s*=\s*[\"']([^\"']*)[\"']", text)
    names = re.findall(r"metric_prefix\s*\+\s*\(?\s*[\"']([a-z0-9_]+)[\"']", text)
    if not names:
        raise SystemExit(f"{path}: no `metric_prefix + \"name\"` metric definitions found")
    return {_family((prefix.group(1) if prefix else "") + n) for n in names}


def _existing(root: Path, *relative: str) -> list[Path]:
    return [root / r for r in relative if (root / r).is_file()]


def extract(engine: str, root: Path) -> tuple[set[str], set[str], list[str]]:
    """(options, metric names, source files read, relative to root)."""
    if engine == "vllm":
        # The frontend arguments moved between releases (entrypoints/openai, /launchers,
        # /common): every entrypoints/**/cli_args.py is read.
        cli = [*_existing(root, "vllm/engine/arg_utils.py", "vllm/entrypoints/cli/serve.py"),
               *sorted((root / "vllm/entrypoints").glob("**/cli_args.py"))]
        metric_files = sorted((root / "vllm/v1/metrics").glob("*.py"))
        options = set().union(*(argparse_options(p) for p in cli))
        metrics = literal_metrics(metric_files, "vllm:")
    elif engine == "tensorrt-llm":
        cli = _existing(root, "tensorrt_llm/commands/serve.py")
        metric_files = _existing(root, "tensorrt_llm/metrics/collector.py")
        options = click_options(cli[0], "serve") if cli else set()
        metrics = trtllm_metrics(metric_files[0]) if metric_files else set()
    elif engine == "sglang":
        base = "python/sglang" if (root / "python/sglang").is_dir() else "sglang"
        # From the 0.5.1x line the flags are derived from annotated dataclass fields
        # (srt/arg_groups/fields/*.py), before from add_argument calls.
        cli = [*_existing(root, f"{base}/srt/server_args.py"),
               *sorted((root / base / "srt/arg_groups/fields").glob("*.py"))]
        # The collectors moved from srt/metrics/ to srt/observability/ in the 0.5 line.
        metric_files = sorted([*(root / base / "srt/metrics").glob("*.py"),
                               *(root / base / "srt/observability").glob("*.py")])
        options = set().union(*(argparse_options(p) | annotated_field_options(p) for p in cli))
        metrics = literal_metrics(metric_files, "sglang:")
    else:
        raise SystemExit(f"unknown engine {engine!r}; known: vllm, tensorrt-llm, sglang")
    if not cli or not options:
        raise SystemExit(f"{root}: no command-line options found for {engine}")
    if not metrics:
        raise SystemExit(f"{root}: no metric definitions found for {engine}")
    read = [str(p.relative_to(root)) for p in [*cli, *metric_files]]
    return options, metrics, read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=("vllm", "tensorrt-llm", "sglang"))
    parser.add_argument("version")
    parser.add_argument("source_dir", type=Path)
    parser.add_argument("--origin", required=True,
                        help="where SOURCE_DIR came from (wheel + sha256, or repo + commit)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--drop-option", action="append", default=[],
                        help="remove an option (only for a release derived from a later source "
                             "by a documented change; say so in --origin)")
    args = parser.parse_args(argv)
    for meta in args.source_dir.glob("*.dist-info/METADATA"):
        found = re.search(r"^Version:\s*(\S+)", meta.read_text(encoding="utf-8"), re.MULTILINE)
        if found and found.group(1) != args.version:
            raise SystemExit(f"{meta}: the source is version {found.group(1)}, not {args.version}")
    options, metrics, read = extract(args.engine, args.source_dir)
    options -= set(args.drop_option)
    data = {"engine": args.engine, "version": args.version, "origin": args.origin,
            "files": read, "options": sorted(options), "metrics": sorted(metrics)}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.engine}-{args.version}.json"
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"{out}: {len(options)} options, {len(metrics)} metrics", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
