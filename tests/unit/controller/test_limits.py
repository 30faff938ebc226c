"""The controller lifts its open-files soft limit to the hard one (one descriptor per
agent host), and never lowers or fails on it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

resource = pytest.importorskip("resource")

PROBE = ("import json, resource; from gearshift.controller.limits import raise_open_files_limit; "
         "r = raise_open_files_limit(); "
         "print(json.dumps([list(r), list(resource.getrlimit(resource.RLIMIT_NOFILE))]))")


def _run_with_soft_limit(soft: int) -> tuple[list[int], list[int]]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    returned, actual = json.loads(out.stdout)
    return returned, actual


def test_a_low_soft_limit_is_raised_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"hard open-files limit {hard} leaves nothing to raise")
    returned, actual = _run_with_soft_limit(256)
    assert actual[0] > 256 and returned == actual
    assert actual[1] == hard  # the hard limit is left alone


def test_a_soft_limit_already_at_the_hard_one_is_unchanged() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no finite hard limit to sit at")
    returned, actual = _run_with_soft_limit(hard)
    assert actual == [hard, hard] == returned
