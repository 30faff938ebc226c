"""A controller port that accepts connections and never answers fails the CLI fast,
with a clear message and the exit code of a refused port."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from gearshift.cli.client import CONNECT_TIMEOUT_S
from gearshift.cli.main import cli

EXIT_UNAVAILABLE = 5


@pytest.fixture
def silent_port() -> Iterator[int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])  # held open, never answered
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: connections are refused


def test_a_silent_port_fails_like_a_refused_one(silent_port: int) -> None:
    runner = CliRunner()
    silent = runner.invoke(cli, ["--controller", f"127.0.0.1:{silent_port}", "fleet", "hosts"])
    refused = runner.invoke(cli, ["--controller", f"127.0.0.1:{refused_port()}", "fleet", "hosts"])
    assert refused.exit_code == EXIT_UNAVAILABLE
    assert silent.exit_code == EXIT_UNAVAILABLE, silent.output
    assert "accepted but nothing answered" in silent.output
    assert f"within {CONNECT_TIMEOUT_S:g} s" in silent.output
    assert "Traceback" not in silent.output
