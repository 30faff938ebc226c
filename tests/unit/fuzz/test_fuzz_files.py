"""Property tests on the file readers: any bytes, plain or gzipped, give a trace or a
one-line `TraceError`, and an agent config or a one-line `ConfigError`."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from fuzz_settings import FUZZ
from gearshift.agents.config import AgentConfig, load_agent_config
from gearshift.common.errors import ConfigError
from gearshift.policies.costmodel import CostModelError, ModelReplay
from gearshift.policies.trace import Trace, TraceError, parse_trace, read_trace

TRACE = Path(__file__).parents[1] / "policies" / "traces" / "steady-70b.jsonl.gz"
TRACE_LINES = gzip.decompress(TRACE.read_bytes()).decode().splitlines()
NUMBERS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                    st.integers(min_value=-(10**40), max_value=10**40))


def write(data: bytes, suffix: str) -> Path:
    with tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False) as f:
        f.write(data)
    return Path(f.name)


def read_trace_or_error(data: bytes) -> Trace | None:
    path = write(data, ".jsonl")
    try:
        return read_trace(path)
    except TraceError as err:
        assert err.message.startswith(str(path)) and "\n" not in err.message
        return None
    finally:
        path.unlink()


@FUZZ
@given(data=st.binary(max_size=2000), zipped=st.booleans())
def test_any_bytes_are_a_trace_or_a_trace_error(data: bytes, zipped: bool) -> None:
    read_trace_or_error(gzip.compress(data) if zipped else data)


@FUZZ
@given(cut=st.integers(min_value=0, max_value=len(TRACE.read_bytes())),
       flip=st.integers(min_value=0, max_value=255))
def test_a_damaged_gzip_trace_is_a_trace_or_a_trace_error(cut: int, flip: int) -> None:
    data = bytearray(TRACE.read_bytes())
    if cut < len(data):
        data[cut] ^= flip
    read_trace_or_error(bytes(data))


@FUZZ
@given(rps=NUMBERS, gpus=NUMBERS, capacity=NUMBERS, step=NUMBERS)
def test_trace_figures_are_priced_exactly_or_refused(rps: float, gpus: float, capacity: float,
                                                     step: float) -> None:
    head = json.loads(TRACE_LINES[0])
    head["step_s"] = step
    for profile in head["models"].values():
        profile["gpus_per_replica"] = gpus
        profile["capacity_rps"]["vllm"] = capacity
    traffic = json.loads(TRACE_LINES[1])
    traffic["rps"] = rps
    try:
        trace = parse_trace([json.dumps(head), json.dumps(traffic)], "fuzz")
    except TraceError:
        return
    for model in trace.profiles:
        try:
            replay = ModelReplay(trace, model)
        except CostModelError:
            continue
        for k in range(trace.n_steps):
            replay.step(k)
        outcome = replay.outcome()
        assert outcome.cost_usd >= 0 and outcome.gpu_hours >= 0


@FUZZ
@given(data=st.binary(max_size=2000))
def test_any_bytes_are_an_agent_config_or_a_config_error(data: bytes) -> None:
    path = write(data, ".yaml")
    try:
        assert isinstance(load_agent_config(path), AgentConfig)
    except ConfigError as err:
        assert err.message
    finally:
        path.unlink()


@FUZZ
@given(doc=st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(
                                ["gpus", "source", "emulated", "count", "deployments", "engines",
                                 "vllm", "host_id", "controller", "tls", "labels", "port"]),
                                inner, max_size=4)),
    max_leaves=20))
def test_any_yaml_document_is_an_agent_config_or_a_config_error(doc: object) -> None:
    path = write(json.dumps(doc).encode(), ".yaml")
    try:
        load_agent_config(path)
    except ConfigError as err:
        assert err.message
    finally:
        path.unlink()
