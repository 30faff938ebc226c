"""Which releases the supervisor's drain holds SIGTERM for: those that would abort
in-flight requests on it (the version table's drain flag absent or not passed)."""

from __future__ import annotations

import pytest

from gearshift.agents.runtimes.drain import aborts_on_sigterm, exit_reserve_s
from gearshift.common.engine_versions import release_for


@pytest.mark.parametrize(("engine", "version", "shutdown_timeout_s", "aborts"), [
    ("vllm", "0.10.0", 30.0, True),    # no --shutdown-timeout before 0.18: the plan drops it
    ("vllm", "0.11.0", 30.0, True),
    ("vllm", "0.17.0", 30.0, True),
    ("vllm", "0.18.0", 30.0, False),   # the flag is passed: vLLM drains by itself
    ("vllm", "0.18.0", 0.0, True),     # the flag exists but no drain timeout was asked for
    ("vllm", "0.40.0", 30.0, False),   # newer than the table: the newest row's flag
    ("tensorrt-llm", "1.1.0", 30.0, False),  # no such flag: its own fixed grace on SIGTERM
])
def test_releases_that_abort_on_sigterm(engine: str, version: str, shutdown_timeout_s: float,
                                        aborts: bool) -> None:
    assert aborts_on_sigterm(release_for(engine, version).row, shutdown_timeout_s) is aborts


def test_the_exit_reserve_is_a_share_of_a_short_grace_and_capped() -> None:
    assert exit_reserve_s(2.0) == 0.5
    assert exit_reserve_s(60.0) == 5.0
    assert exit_reserve_s(0.0) == 0.0
