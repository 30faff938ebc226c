"""Names of protobuf enum values for people, stores and metric labels.

A newer agent may send a value this controller's proto does not know (a new
deployment phase, say). Protobuf keeps such a value as a bare number; naming it
must never raise: it is "unknown", everywhere it is shown or stored.
"""

from __future__ import annotations

from typing import Any

UNKNOWN = "unknown"


def enum_label(enum_type: Any, prefix: str, value: int) -> str:
    """`DEPLOYMENT_PHASE_READY` -> "ready"; a value the enum lacks -> "unknown"."""
    try:
        name: str = enum_type.Name(value)
    except ValueError:
        return UNKNOWN
    return name.removeprefix(prefix).lower()
