"""Pages and parts: no answer of the controller exceeds gRPC's message cap at the fleet
size gearshift is built for (10,000 hosts x 8 deployments).

- The fleet-sized lists (`ListHosts`, `ListDeployments`, `ListModels`) answer a page of
  at most `page_size` items (DEFAULT_PAGE_SIZE when 0, at most MAX_PAGE_SIZE) in their
  stable order, with `next_page_token` naming where the next page starts ("" on the
  last). The token is the last item's sort key, opaque to clients; a token that is not
  one of ours is refused naming `page_token`.
- `WatchRoutes` sends a table larger than MAX_ROUTE_PART_BYTES in parts of whole models
  (`RoutingTable.part` of `parts`, all of one version); the gateway applies the table
  once it has every part (`gearshift.gateway.routes.TableParts`).
"""

from __future__ import annotations

import base64
import binascii
import heapq
import json
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from gearshift.common.errors import InvalidArgument
from gearshift.v1 import control_pb2

T = TypeVar("T")
DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 5000
# A page also ends once its items reach this many bytes: a deployment's report may hold
# a few kB of names and message (controller/api/validation.py bounds them), so a page of
# MAX_PAGE_SIZE of them could pass the cap.
MAX_PAGE_BYTES = 2 << 20
MAX_ROUTE_PART_BYTES = 1 << 20  # well under gRPC's 4 MiB default cap
MAX_TOKEN_CHARS = 4096


def encode_token(key: Sequence[str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode()


def decode_token(token: str, where: str) -> tuple[str, ...]:
    """The sort key a `page_token` names; InvalidArgument naming `where` otherwise."""
    try:
        if len(token) > MAX_TOKEN_CHARS:
            raise ValueError("too long")
        key = json.loads(base64.urlsafe_b64decode(token.encode()))
        if not isinstance(key, list) or not all(isinstance(k, str) for k in key):
            raise ValueError("not a key")
    except (ValueError, binascii.Error, UnicodeError) as exc:
        raise InvalidArgument(f"{where}.page_token: not a token this controller gave "
                              f"({exc}); start again without one") from None
    return tuple(key)


def page_size(requested: int, where: str) -> int:
    if requested < 0:
        raise InvalidArgument(f"{where}.page_size: expected 0 (the default, "
                              f"{DEFAULT_PAGE_SIZE}) or a positive number, found {requested}")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def one_page(keyed: Iterable[tuple[tuple[str, ...], T]], size: int, token: str,
             where: str, size_of: Callable[[T], int] | None = None,
             max_bytes: int = MAX_PAGE_BYTES) -> tuple[list[T], str]:
    """The items after `token` of `keyed` in key order, at most `size` of them (and, with
    `size_of`, at most `max_bytes` of them, one item at least), and the token of the next
    page ("" when this is the last)."""
    after = decode_token(token, where) if token else None
    items = heapq.nsmallest(size + 1, (kv for kv in keyed if after is None or kv[0] > after),
                            key=lambda kv: kv[0])
    page: list[tuple[tuple[str, ...], T]] = []
    used = 0
    for kv in items[:size]:
        if size_of is not None:
            used += size_of(kv[1])
            if page and used > max_bytes:
                break
        page.append(kv)
    more = len(items) > len(page)
    return [item for _key, item in page], encode_token(page[-1][0]) if more and page else ""


def table_parts(table: control_pb2.RoutingTable,
                max_bytes: int = MAX_ROUTE_PART_BYTES) -> list[control_pb2.RoutingTable]:
    """`table` whole when it fits in `max_bytes`, else in parts of whole models."""
    if table.ByteSize() <= max_bytes:
        return [table]
    parts: list[control_pb2.RoutingTable] = []
    current = control_pb2.RoutingTable(version=table.version)
    size = 0
    for route in table.models:
        n = route.ByteSize() + 8
        if current.models and size + n > max_bytes:
            parts.append(current)
            current, size = control_pb2.RoutingTable(version=table.version), 0
        current.models.add().CopyFrom(route)
        size += n
    parts.append(current)
    for i, part in enumerate(parts):
        part.generated.CopyFrom(table.generated)
        part.part, part.parts = i, len(parts)
    return parts
