"""Output for people (rich tables) and for tools (`-o json`)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import click
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console
from rich.table import Table
from rich.text import Text

output_option = click.option(
    "-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True,
    help="table for people, json for tools")


def to_dict(msg: Message) -> dict[str, Any]:
    return MessageToDict(msg, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


TABLE_WIDTH_CHARS = 160
WIDE_TABLE_WIDTH_CHARS = 320  # `-o wide`: a line per row rather than folded headers


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
                width: int = TABLE_WIDTH_CHARS) -> None:
    table = Table(title=title, title_justify="left", header_style="bold")
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        # Cells are data (agents' host ids and labels, engine labels such as "vllm 0.40.0
        # [as 0.18: ...]"), never console markup: a "[...]" in them is shown as written,
        # and a control character as its escape (no cell can drive the terminal).
        table.add_row(*(Text(escape_controls("" if v is None else str(v))) for v in r))
    Console(width=width).print(table)


_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    """`text` with each C0/C1 control character written as its escape (ESC -> \\x1b)."""
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], text)


def fmt_ms(seconds: float | None, present: bool = True) -> str:
    if not present or seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}"


def fmt_rate(v: float) -> str:
    return f"{v:.1f}"


def timestamp_text(ts: Timestamp) -> str | None:
    """A protobuf Timestamp as UTC text; None when it is unset (all zero), which proto3
    cannot tell from 1970-01-01: an unset time is never shown as 1970 or as now."""
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return datetime.fromtimestamp(ts.seconds, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def times_line(times: Sequence[tuple[str, Timestamp]]) -> str:
    """"created 2026-…, updated 2026-…": the times that are set, in order; "" when none is."""
    return ", ".join(f"{label} {text}" for label, ts in times
                     if (text := timestamp_text(ts)) is not None)
