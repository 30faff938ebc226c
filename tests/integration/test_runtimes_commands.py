"""Engine runtimes build the REAL command lines of docs/engines.md; specs validate and round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gearshift.agents.emulator.args import parse_engine_argv
from gearshift.agents.runtimes.base import (
    RUNTIMES,
    HealthState,
    classify_health,
    endpoints_for,
    get_runtime,
)
from gearshift.agents.runtimes.trtllm import TrtllmRuntime
from gearshift.common.engines import ENGINE_NAMES, HealthSemantics, engine_entry
from gearshift.common.errors import InvalidArgument
from gearshift.common.spec import DeploymentSpec, Phase
from gearshift.v1 import agent_pb2


def make_spec(**overrides) -> DeploymentSpec:
    fields = {"deployment_id": "d1", "model": "llama", "engine": "vllm", "source": "meta/llama-8b",
              "port": 8123, "tensor_parallel_size": 2, "gpu_memory_fraction": 0.85,
              "gpu_indices": (2, 3)}
    fields.update(overrides)
    return DeploymentSpec(**fields)


def test_vllm_command_line(tmp_path):
    spec = make_spec(shutdown_timeout_s=30.0, extra_args=("--max-model-len", "4096"))
    plan = get_runtime("vllm").launch_plan(spec, executable=["vllm"], host="0.0.0.0", port=8123,
                                           workdir=tmp_path)
    assert plan.argv == ("vllm", "serve", "meta/llama-8b", "--host", "0.0.0.0", "--port", "8123",
                         "--served-model-name", "llama", "--tensor-parallel-size", "2",
                         "--gpu-memory-utilization", "0.85", "--shutdown-timeout", "30",
                         "--max-model-len", "4096")
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert plan.served_model_name == "llama"
    # Without a shutdown timeout vLLM aborts in-flight requests on SIGTERM: no flag.
    plain = get_runtime("vllm").launch_plan(make_spec(gpu_indices=()), executable=["vllm"],
                                            host="h", port=1, workdir=tmp_path)
    assert "--shutdown-timeout" not in plain.argv and plain.env == {}


def test_trtllm_command_line_and_extra_config(tmp_path):
    spec = make_spec(engine="tensorrt-llm", backend="tensorrt", gpu_indices=(0, 1))
    plan = get_runtime("tensorrt-llm").launch_plan(spec, executable=["trtllm-serve"],
                                                   host="0.0.0.0", port=8123, workdir=tmp_path)
    config = tmp_path / "d1.extra-llm-api-options.yaml"
    assert plan.argv == ("trtllm-serve", "meta/llama-8b", "--host", "0.0.0.0", "--port", "8123",
                         "--backend", "tensorrt", "--tp_size", "2",
                         "--kv_cache_free_gpu_memory_fraction", "0.85", "--config", str(config))
    assert yaml.safe_load(config.read_text()) == {"enable_iter_perf_stats": True,
                                                  "return_perf_metrics": True}
    assert plan.files == (config,)
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert plan.served_model_name == "meta/llama-8b"
    named = TrtllmRuntime(pass_served_model_name=True).launch_plan(
        spec, executable=["trtllm-serve"], host="h", port=1, workdir=tmp_path)
    assert named.argv[-2:] == ("--served-model-name", "llama")
    assert named.served_model_name == "llama"


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_the_emulator_understands_what_the_runtime_builds(tmp_path, engine):
    drains = engine_entry(engine).drains_gracefully
    spec = make_spec(engine=engine, shutdown_timeout_s=5.0 if drains else 0.0)
    plan = get_runtime(engine).launch_plan(spec, executable=["X"], host="127.0.0.1", port=9,
                                           workdir=tmp_path)
    args = parse_engine_argv(engine, list(plan.argv[1:]))
    assert (args.host, args.port, args.tensor_parallel_size) == ("127.0.0.1", 9, 2)
    assert args.gpu_memory_fraction == 0.85
    assert args.served_model_name == plan.served_model_name
    assert args.ignored == ()
    if engine == "tensorrt-llm":
        assert args.enable_iter_perf_stats and args.return_perf_metrics


def test_endpoints_and_health_rules_come_from_the_catalog():
    v = endpoints_for("vllm", "http://127.0.0.1:8000/")
    assert v.health_urls == ("http://127.0.0.1:8000/health",)
    assert v.metric_urls == ("http://127.0.0.1:8000/metrics",)
    t = endpoints_for("tensorrt-llm", "http://127.0.0.1:8000")
    assert t.health_urls == ("http://127.0.0.1:8000/health", "http://127.0.0.1:8000/health_generate")
    assert t.metric_urls == ("http://127.0.0.1:8000/prometheus/metrics",
                             "http://127.0.0.1:8000/metrics")
    for name in ("vllm", "tensorrt-llm"):
        health = engine_entry(name).health
        for ready_before in (False, True):
            assert classify_health(health, None, ready_before=ready_before) is HealthState.LOADING
            assert classify_health(health, 200, ready_before=ready_before) is HealthState.READY
            assert classify_health(health, 503, ready_before=ready_before) is HealthState.DEAD


def test_a_loading_status_means_loading_only_before_the_first_ready_answer():
    health = HealthSemantics(paths=("/health",), loading_statuses=frozenset({503}))
    assert classify_health(health, 503, ready_before=False) is HealthState.LOADING
    assert classify_health(health, 503, ready_before=True) is HealthState.DEAD
    assert classify_health(health, 500, ready_before=False) is HealthState.DEAD


def test_every_catalog_engine_has_a_registered_runtime():
    for name in ENGINE_NAMES:
        assert get_runtime(name).name == name


def test_unknown_runtime_lists_the_known_ones():
    with pytest.raises(InvalidArgument, match=f"'tgi'; known: {', '.join(ENGINE_NAMES)}"):
        get_runtime("tgi")
    assert set(RUNTIMES) >= {"vllm", "tensorrt-llm"}


def test_spec_round_trips_through_proto_with_engine_defaults():
    msg = agent_pb2.DeploymentSpec(deployment_id="d2", model="m", engine="tensorrt-llm",
                                   gpu_indices=[4], extra_args=["--max_batch_size", "8"])
    spec = DeploymentSpec.from_proto(msg)
    assert (spec.source, spec.backend, spec.tensor_parallel_size, spec.gpu_memory_fraction) == (
        "m", "pytorch", 1, 0.9)
    assert spec.extra_args == ("--max_batch_size", "8")
    assert DeploymentSpec.from_proto(spec.to_proto()) == spec


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"deployment_id": "../etc"}, "deployment_id"),
    ({"deployment_id": ""}, "deployment_id"),
    ({"model": " "}, "model must not be empty"),
    ({"engine": "tgi"}, "engine 'tgi'"),
    ({"engine": "tensorrt-llm", "backend": "onnx"}, "backend 'onnx'"),
    ({"backend": "pytorch"}, "only to tensorrt-llm"),
    ({"port": 70000}, "port 70000"),
    ({"tensor_parallel_size": 0, "gpu_indices": ()}, "tensor_parallel_size 0"),
    ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction 1.5"),
    ({"gpu_indices": (1, 1)}, "distinct"),
    ({"gpu_indices": (1,)}, "do not match tensor_parallel_size 2"),
    ({"shutdown_timeout_s": -1.0}, "shutdown_timeout_s"),
    ({"shutdown_timeout_s": float("nan")}, "shutdown_timeout_s"),
])
def test_bad_specs_name_the_field(overrides, needle):
    with pytest.raises(InvalidArgument) as info:
        make_spec(**overrides)
    assert needle in info.value.message


@given(st.builds(agent_pb2.DeploymentSpec,
                 deployment_id=st.text(max_size=8), model=st.text(max_size=8),
                 engine=st.sampled_from(["vllm", "tensorrt-llm", "", "x"]),
                 backend=st.sampled_from(["", "pytorch", "tensorrt", "y"]),
                 port=st.integers(0, 2**32 - 1), tensor_parallel_size=st.integers(0, 16),
                 gpu_memory_fraction=st.floats(allow_nan=True),
                 gpu_indices=st.lists(st.integers(0, 8), max_size=4),
                 shutdown_timeout_s=st.floats(allow_nan=True)))
def test_any_proto_spec_is_accepted_or_rejected_cleanly(msg):
    try:
        spec = DeploymentSpec.from_proto(msg)
    except InvalidArgument as exc:
        assert exc.message
    else:
        assert DeploymentSpec.from_proto(spec.to_proto()) == spec


def test_phase_maps_to_proto_and_back():
    for phase in Phase:
        assert Phase.from_proto(phase.to_proto()) is phase
    assert Phase.READY.to_proto() == agent_pb2.DEPLOYMENT_PHASE_READY
    with pytest.raises(InvalidArgument):
        Phase.from_proto(agent_pb2.DEPLOYMENT_PHASE_UNSPECIFIED)


def test_workdir_is_created_for_the_trtllm_config(tmp_path):
    workdir = tmp_path / "new" / "dir"
    get_runtime("tensorrt-llm").launch_plan(make_spec(engine="tensorrt-llm"), executable=["t"],
                                            host="h", port=1, workdir=workdir)
    assert Path(workdir, "d1.extra-llm-api-options.yaml").is_file()
