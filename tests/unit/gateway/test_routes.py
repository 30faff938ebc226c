"""Routing table: loading, validation, weighted choice, backoff."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gearshift.common.errors import ConfigError
from gearshift.gateway.controller_link import next_backoff_s
from gearshift.gateway.routes import (
    EJECT_S,
    load_routes_file,
    table_from_mapping,
    table_from_proto,
)
from gearshift.v1 import control_pb2


def test_weighted_choice_follows_weights() -> None:
    table = table_from_mapping({"m": [
        {"endpoint": "http://a:1", "weight": 0.75, "deployment_id": "a"},
        {"endpoint": "http://b:1", "weight": 0.25, "deployment_id": "b"},
    ]})
    rng = random.Random(7).random
    counts = Counter(table.pick("m", rng=rng).deployment_id for _ in range(4000))  # type: ignore[union-attr]
    assert 2800 < counts["a"] < 3200
    assert counts["a"] + counts["b"] == 4000


def test_leaving_and_zero_weight_get_no_new_requests() -> None:
    table = table_from_mapping({"m": [
        {"endpoint": "http://a:1", "weight": 1, "leaving": True, "deployment_id": "a"},
        {"endpoint": "http://b:1", "weight": 0, "deployment_id": "b"},
        {"endpoint": "http://c:1", "weight": 0.1, "deployment_id": "c"},
    ]})
    rng = random.Random(1).random
    assert {table.pick("m", rng=rng).deployment_id for _ in range(200)} == {"c"}  # type: ignore[union-attr]
    only_leaving = table_from_mapping({"m": [{"endpoint": "http://a:1", "leaving": True}]})
    assert only_leaving.pick("m") is None
    with pytest.raises(KeyError):
        table.pick("other")


def test_ejected_endpoint_is_passed_over_until_it_is_the_last_one() -> None:
    table = table_from_mapping({"m": [
        {"endpoint": "http://a:1", "deployment_id": "a"},
        {"endpoint": "http://b:1", "deployment_id": "b"},
    ]})
    a = table.models["m"][0]
    a.eject(now=100.0)
    assert {table.pick("m", now=100.5).deployment_id for _ in range(50)} == {"b"}  # type: ignore[union-attr]
    assert table.pick("m", exclude=[table.models["m"][1]], now=100.5) is a
    assert table.pick("m", now=100.0 + EJECT_S + 0.1, rng=lambda: 0.0) is a


def test_table_from_proto_keeps_weights_and_leaving() -> None:
    msg = control_pb2.RoutingTable(version=9, models=[control_pb2.ModelRoute(model="m", endpoints=[
        control_pb2.RouteEndpoint(deployment_id="d1", endpoint="http://h:1", weight=0.4),
        control_pb2.RouteEndpoint(deployment_id="d2", endpoint="http://h:2", weight=0.6,
                                  leaving=True),
    ])])
    table = table_from_proto(msg)
    assert table.version == 9 and table.source == "controller"
    (d1, d2) = table.models["m"]
    assert (d1.deployment_id, d1.weight, d1.leaving) == ("d1", 0.4, False)
    assert (d2.deployment_id, d2.leaving, d2.eligible) == ("d2", True, False)
    assert str(d1.urls["/v1/chat/completions"]) == "http://h:1/v1/chat/completions"


def test_routes_file_yaml_and_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    y = tmp_path / "routes.yaml"
    y.write_text("llama:\n  - endpoint: http://127.0.0.1:9001\n    weight: 2\n"
                 "  - {endpoint: 'http://127.0.0.1:9002/'}\n")
    table = load_routes_file(y)
    assert [e.weight for e in table.models["llama"]] == [2.0, 1.0]
    j = tmp_path / "routes.json"
    j.write_text(json.dumps({"qwen": [{"endpoint": "http://127.0.0.1:9003"}]}))
    assert load_routes_file(j).model_names() == ["qwen"]


@pytest.mark.parametrize(("text", "needle"), [
    ("llama: [{endpoint: 'http://x:1', wieght: 2}]", "llama[0]: wieght"),
    ("llama: [{endpoint: 'ftp://x:1'}]", "llama[0]: endpoint"),
    ("llama: [{endpoint: 'http://x:1', weight: -1}]", "llama[0]: weight"),
    ("llama: {endpoint: 'http://x:1'}", "llama: expected a list"),
    ("- just a list", "expected a mapping"),
    ("llama: [", "not valid"),
])
def test_bad_routes_file_names_what_and_where(tmp_path, text: str, needle: str) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "routes.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_routes_file(p)
    assert needle in err.value.message and str(p) in err.value.message


def test_missing_routes_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_routes_file("/nonexistent/routes.yaml")


@given(st.recursive(st.none() | st.integers() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                         max_size=3),
                    max_leaves=10))
def test_arbitrary_mappings_load_or_fail_cleanly(data: object) -> None:
    try:
        table_from_mapping(data)
    except ConfigError as err:
        assert err.message.startswith("routes")


def test_backoff_grows_caps_and_jitters() -> None:
    assert next_backoff_s(0, rng=lambda: 0.0, initial_s=0.5) == 0.25
    assert next_backoff_s(0, rng=lambda: 1.0, initial_s=0.5) == 0.5
    assert next_backoff_s(3, rng=lambda: 1.0, initial_s=0.5) == 4.0
    assert next_backoff_s(100, rng=lambda: 1.0, initial_s=0.5, max_s=30) == 30


def test_proto_endpoints_are_normalised() -> None:
    msg = control_pb2.RoutingTable(models=[control_pb2.ModelRoute(model="m", endpoints=[
        control_pb2.RouteEndpoint(deployment_id="d1", endpoint="10.0.0.1:8000",
                                  weight=float("nan")),
        control_pb2.RouteEndpoint(deployment_id="d2", endpoint="http://h:2", weight=-3),
        control_pb2.RouteEndpoint(deployment_id="d3", endpoint="", weight=1),
    ])])
    eps = table_from_proto(msg).models["m"]
    assert [(e.deployment_id, e.endpoint, e.weight) for e in eps] == [
        ("d1", "http://10.0.0.1:8000", 0.0), ("d2", "http://h:2", 0.0)]


def test_a_standby_takes_the_retry_when_every_weighted_endpoint_failed() -> None:
    from gearshift.gateway.routes import Endpoint, RoutingTable

    active = Endpoint(deployment_id="new", endpoint="http://127.0.0.1:1", weight=1.0)
    standby = Endpoint(deployment_id="old", endpoint="http://127.0.0.1:2", weight=0.0)
    leaving = Endpoint(deployment_id="gone", endpoint="http://127.0.0.1:3", weight=0.0, leaving=True)
    table = RoutingTable(models={"m": (active, leaving, standby)}, version=1, source="test")
    assert table.pick("m") is active  # a standby gets no new share
    assert table.pick("m", exclude=[active]) is standby
    assert table.pick("m", exclude=[active, standby]) is None  # never a leaving one
