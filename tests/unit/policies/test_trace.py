"""Trace reader: the shipped traces load; malformed input fails with file, line and reason."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from gearshift.common.errors import InvalidArgument
from gearshift.policies.trace import TraceError, parse_trace, read_trace

TRACES = Path(__file__).parent / "traces"


def test_every_shipped_trace_loads_with_one_sample_per_model_per_step() -> None:
    for path in sorted(TRACES.glob("*.jsonl.gz")):
        trace = read_trace(path)
        assert trace.name == path.name.removesuffix(".jsonl.gz")
        assert trace.n_steps > 0
        assert all(len(s.rps) == trace.n_steps for s in trace.series.values())


def test_plain_and_gzipped_files_read_the_same(tmp_path: Path, lines_of) -> None:
    text = "\n".join(lines_of({"m": [1.0, 2.0, 3.0]}, revisions={"m": [1]})) + "\n"
    (tmp_path / "t.jsonl").write_text(text)
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    a, b = read_trace(tmp_path / "t.jsonl"), read_trace(tmp_path / "t.jsonl.gz")
    assert a == b
    assert a.series["m"].rps == (1.0, 2.0, 3.0)
    assert a.series["m"].revision_steps == (1,)


@pytest.mark.parametrize(("mutate", "line", "reason"), [
    (lambda ls: ls.__setitem__(2, "{not json"), 3, "not valid JSON"),
    (lambda ls: ls.__setitem__(2, ls[2].replace('"m"', '"other"')), 3, "not in the header"),
    (lambda ls: ls.__setitem__(1, ls[1].replace("2026-03-02T00:00:00Z", "2026-03-01T00:00:00Z")),
     2, "before the trace start"),
    (lambda ls: ls.__setitem__(3, ls[3].replace("2026-03-02T00:10:00Z", "2026-03-02T00:00:00Z")),
     4, "goes back in time"),
    (lambda ls: ls.__setitem__(2, ls[2].replace("00:05:00Z", "00:06:00Z")), 3, "step boundary"),
    (lambda ls: ls.__setitem__(2, ls[1]), 3, "second traffic record"),
    (lambda ls: ls.__setitem__(2, ls[2].replace('"rps": 2.0', '"rps": -1')), 3, "rps"),
    (lambda ls: ls.__setitem__(2, ls[2].replace('"traffic"', '"trafic"')), 3, "kind"),
    (lambda ls: ls.__setitem__(0, ls[0].replace('"version": 1', '"version": 2')), 1, "version"),
    (lambda ls: ls.__setitem__(0, ls[0].replace('"vllm": 10.0', '"vllm": 0')), 1, "capacity_rps.vllm"),
    (lambda ls: ls.insert(0, ls[1]), 1, "first line must be the header"),
])
def test_malformed_lines_fail_with_the_line_number_and_reason(lines_of, mutate, line, reason) -> None:
    lines = lines_of({"m": [1.0, 2.0, 3.0]})
    mutate(lines)
    with pytest.raises(TraceError) as err:
        parse_trace(lines, source="t.jsonl")
    assert err.value.message.startswith(f"t.jsonl:{line}: ")
    assert reason in err.value.message
    assert isinstance(err.value, InvalidArgument)


def test_a_missing_step_is_named(lines_of) -> None:
    lines = lines_of({"a": [1.0, 2.0], "b": [1.0, 2.0]})
    del lines[3]  # a's second sample
    with pytest.raises(TraceError, match=r"model 'a' has no traffic record at 2026-03-02T00:05:00Z"):
        parse_trace(lines, source="t")


def test_unreadable_files_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl")
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"\x1f\x8b" + b"garbage")
    with pytest.raises(TraceError, match="not a valid gzip file"):
        read_trace(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match="empty trace"):
        read_trace(empty)


def test_header_requires_every_engine_fact(lines_of) -> None:
    lines = lines_of({"m": [1.0]})
    head = json.loads(lines[0])
    del head["models"]["m"]["build_s"]["tensorrt-llm"]
    lines[0] = json.dumps(head)
    with pytest.raises(TraceError, match=r"t:1: models.m.build_s.tensorrt-llm: missing"):
        parse_trace(lines, source="t")


def test_corrupt_truncated_and_inflating_gzip_are_one_line_errors(tmp_path: Path) -> None:
    from gearshift.policies.trace import MAX_TRACE_LINES

    good = (Path(__file__).parent / "traces" / "steady-70b.jsonl.gz").read_bytes()
    corrupt = bytearray(good)
    corrupt[len(corrupt) // 2] ^= 0xFF
    cases = {"corrupt.gz": bytes(corrupt), "truncated.gz": good[:-12],
             "lines.gz": gzip.compress(b"\n" * (MAX_TRACE_LINES + 1), compresslevel=1)}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TraceError) as err:
            read_trace(tmp_path / name)
        assert err.value.message.startswith(str(tmp_path / name)) and "\n" not in err.value.message
    two = tmp_path / "two-members.gz"
    raw = gzip.decompress(good)
    two.write_bytes(gzip.compress(raw[:1000]) + gzip.compress(raw[1000:]))
    assert read_trace(two) == read_trace(Path(__file__).parent / "traces" / "steady-70b.jsonl.gz")


def test_huge_rates_or_gpu_counts_are_refused_not_priced_negative(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from gearshift.cli.policy_cmds import policy

    raw = gzip.decompress((Path(__file__).parent / "traces" / "steady-70b.jsonl.gz").read_bytes())
    lines = raw.decode().splitlines()
    traffic = json.loads(lines[1])
    traffic["rps"] = 1e300
    huge_rate = tmp_path / "huge-rate.jsonl"
    huge_rate.write_text("\n".join([lines[0], json.dumps(traffic), *lines[2:]]) + "\n")
    head = json.loads(lines[0])
    for profile in head["models"].values():
        profile["gpus_per_replica"] = 10**30
    huge_gpus = tmp_path / "huge-gpus.jsonl"
    huge_gpus.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    policy_file = Path(__file__).parents[3] / "policies" / "examples" / "default.yaml"
    for trace, needle in ((huge_rate, "priced exactly"), (huge_gpus, "gpus_per_replica")):
        out = CliRunner().invoke(policy, ["backtest", str(policy_file), "--trace", str(trace)])
        assert out.exit_code == 1, out.output
        assert needle in out.output and "Traceback" not in out.output and "$-" not in out.output
