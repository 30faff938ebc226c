"""Values ready for JSON and protobuf Structs, which have no NaN or infinity."""

from __future__ import annotations

import math
from typing import Any


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float as None, mapping keys as strings and tuples as
    lists, nested (decision inputs and migration figures may hold NaN or inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value
