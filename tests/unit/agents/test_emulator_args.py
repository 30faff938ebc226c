"""The emulator reads the real engines' command lines and its own fault specs."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from gearshift.agents.emulator.args import EngineArgsError, parse_engine_argv
from gearshift.agents.emulator.batching import derive_max_batch
from gearshift.agents.emulator.cli import emulate
from gearshift.agents.emulator.config import FaultError, Faults, apply_faults, parse_faults_json


def test_vllm_serve_command_line_is_understood():
    args = parse_engine_argv("vllm", [
        "serve", "meta/llama-8b", "--host", "127.0.0.1", "--port", "8123",
        "--served-model-name", "llama", "--tensor-parallel-size", "2",
        "--gpu-memory-utilization", "0.85", "--shutdown-timeout", "30",
        "--max-model-len", "4096", "--enforce-eager"])
    assert (args.model, args.served_model_name, args.host, args.port) == (
        "meta/llama-8b", "llama", "127.0.0.1", 8123)
    assert args.tensor_parallel_size == 2
    assert args.gpu_memory_fraction == 0.85
    assert args.shutdown_timeout_s == 30.0
    assert args.ignored == ("--max-model-len", "4096", "--enforce-eager")


def test_vllm_defaults_and_spelling_variants():
    args = parse_engine_argv("vllm", ["serve", "--model=m", "--tensor_parallel_size=4"])
    assert (args.model, args.served_model_name, args.port, args.host) == ("m", "m", 8000, "0.0.0.0")
    assert args.tensor_parallel_size == 4
    assert args.shutdown_timeout_s is None


def test_trtllm_serve_command_line_reads_the_config(tmp_path):
    config = tmp_path / "extra.yaml"
    config.write_text("enable_iter_perf_stats: true\nreturn_perf_metrics: true\n")
    args = parse_engine_argv("tensorrt-llm", [
        "hub/model", "--port", "9000", "--backend", "tensorrt", "--tp_size", "2",
        "--kv_cache_free_gpu_memory_fraction", "0.8", "--config", str(config)])
    assert (args.model, args.served_model_name, args.host) == ("hub/model", "hub/model", "localhost")
    assert (args.backend, args.tensor_parallel_size, args.gpu_memory_fraction) == ("tensorrt", 2, 0.8)
    assert args.enable_iter_perf_stats and args.return_perf_metrics


def test_trtllm_names_a_local_checkpoint_by_its_basename(tmp_path):
    ckpt = tmp_path / "Llama-3-8B"
    ckpt.mkdir()
    args = parse_engine_argv("tensorrt-llm", ["serve", str(ckpt) + "/"])
    assert args.served_model_name == "Llama-3-8B"
    assert args.backend == "pytorch"
    assert not args.enable_iter_perf_stats


@pytest.mark.parametrize(("flavor", "argv", "needle"), [
    ("vllm", ["run", "m"], "'serve'"),
    ("vllm", ["serve"], "missing MODEL"),
    ("vllm", ["serve", "m", "--port", "http"], "--port"),
    ("vllm", ["serve", "m", "--port", "70000"], "outside"),
    ("vllm", ["serve", "m", "--gpu-memory-utilization", "1.5"], "(0, 1]"),
    ("vllm", ["serve", "m", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
    ("vllm", ["serve", "m", "--port"], "needs a value"),
    ("tensorrt-llm", ["m", "--backend", "onnx"], "--backend"),
    ("tensorrt-llm", [], "missing MODEL"),
    ("tensorrt-llm", ["m", "--config", "/nonexistent/extra.yaml"], "cannot read"),
])
def test_bad_engine_arguments_name_the_problem(flavor, argv, needle):
    with pytest.raises(EngineArgsError, match=None) as info:
        parse_engine_argv(flavor, argv)
    assert needle in str(info.value)


def test_bad_yaml_config_is_a_clear_error(tmp_path):
    config = tmp_path / "extra.yaml"
    config.write_text("- just\n- a list\n")
    with pytest.raises(EngineArgsError, match="must hold a mapping"):
        parse_engine_argv("tensorrt-llm", ["m", "--config", str(config)])


@given(st.lists(st.text(max_size=12), max_size=8), st.sampled_from(["vllm", "tensorrt-llm"]))
def test_any_argv_parses_or_fails_cleanly(argv, flavor):
    try:
        args = parse_engine_argv(flavor, ["serve", *argv] if flavor == "vllm" else argv)
    except EngineArgsError as exc:
        assert str(exc)
    else:
        assert args.flavor == flavor


def test_cli_exits_2_on_bad_engine_arguments():
    result = CliRunner().invoke(emulate, ["--flavor", "vllm", "--", "serve"])
    assert result.exit_code == 2
    assert "missing MODEL" in result.output


def test_cli_exits_2_on_bad_faults_env():
    result = CliRunner().invoke(emulate, ["--flavor", "vllm", "--", "serve", "m"],
                                env={"GEARSHIFT_EMULATOR_FAULTS": '{"explode": 1}'})
    assert result.exit_code == 2
    assert "explode" in result.output and "crash_after_s" in result.output


def test_faults_parse_and_update():
    faults = parse_faults_json('{"latency_factor": 3, "health": "fail", "slow_start_s": 2}',
                               where="env")
    assert faults == Faults(latency_factor=3.0, health_ok=False, slow_start_s=2.0)
    updated, crash = apply_faults(faults, {"health": "ok", "crash": True}, where="POST")
    assert updated.health_ok and crash and updated.latency_factor == 3.0
    assert parse_faults_json("", where="env") == Faults()


@pytest.mark.parametrize(("text", "needle"), [
    ("{", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"latency_factor": 0}', "finite and > 0"),
    ('{"latency_factor": "x"}', "expected a number"),
    ('{"health": "bad"}', "health"),
    ('{"crash": true}', "run-time switch"),
    ('{"ignore_sigterm": 1}', "true or false"),
])
def test_bad_faults_are_rejected(text, needle):
    with pytest.raises(FaultError) as info:
        parse_faults_json(text, where="GEARSHIFT_EMULATOR_FAULTS")
    assert needle in str(info.value)
    assert "GEARSHIFT_EMULATOR_FAULTS" in str(info.value)


@given(st.dictionaries(st.sampled_from(["crash", "health", "latency_factor", "slow_start_s",
                                        "ignore_sigterm", "crash_after_s", "other"]),
                       st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True),
                                 st.integers(), st.text(max_size=5)), max_size=4))
def test_fault_updates_never_crash(spec):
    try:
        apply_faults(Faults(), json.loads(json.dumps(spec)), where="POST /emulator/faults")
    except FaultError as exc:
        assert "POST /emulator/faults" in str(exc)


def test_batch_size_is_derived_from_capacity():
    # 40 req/s, 20 ms TTFT, 15 more tokens at 5 ms, 1.5x slower at a full batch: 0.1425 s each.
    assert derive_max_batch(40.0, 0.020, 0.005, 16) == 6
    assert derive_max_batch(0.1, 0.001, 0.001, 1) == 1
