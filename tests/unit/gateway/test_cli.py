"""`python -m gearshift.gateway` as a real child process: serves, stops on SIGTERM, clear errors."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner

from gearshift.gateway.cli import gateway

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serves_from_routes_file_and_stops_on_sigterm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    routes = tmp_path / "routes.yaml"
    routes.write_text("llama:\n  - endpoint: http://127.0.0.1:9\n")
    port, ops = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gearshift.gateway", "--routes", str(routes),
         "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{ops}",
         "--max-connections", "10", "--body-budget-mib", "8", "--max-body-mib", "2",
         "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        body = None
        while body is None:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    body = json.loads(r.read())
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        assert [m["id"] for m in body["data"]] == ["llama"]
        with urllib.request.urlopen(f"http://127.0.0.1:{ops}/readyz", timeout=5) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{ops}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "gearshift_gateway_client_connections_limit 10.0" in text
        assert "gearshift_gateway_request_body_budget_bytes 8.388608e+06" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_routes_file_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    routes = tmp_path / "routes.yaml"
    routes.write_text("llama:\n  - endpoint: http://127.0.0.1:9\n    wieght: 1\n")
    result = CliRunner().invoke(gateway, ["--routes", str(routes), "--listen", "127.0.0.1:0"])
    assert result.exit_code == 1
    assert "llama[0]: wieght" in result.output and "Traceback" not in result.output


def test_needs_a_source_of_routes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("GEARSHIFT_CONTROLLER", raising=False)
    result = CliRunner().invoke(gateway, ["--listen", "127.0.0.1:0"])
    assert result.exit_code == 1 and "--controller" in result.output
    result = CliRunner().invoke(gateway, ["--controller", "nohostport"])
    assert result.exit_code == 1 and "HOST:PORT" in result.output
    result = CliRunner().invoke(gateway, ["--routes", "x.yaml", "--listen", "bad"])
    assert result.exit_code == 2 and "--listen" in result.output
    result = CliRunner().invoke(gateway, ["--routes", "x.yaml", "--metrics-listen", "9401"])
    assert result.exit_code == 2 and "--metrics-listen" in result.output
    result = CliRunner().invoke(gateway, ["--routes", "x.yaml", "--max-body-mib", "200"])
    assert result.exit_code == 2 and "--body-budget-mib" in result.output
    result = CliRunner().invoke(gateway, ["--routes", "x.yaml", "--max-connections", "0"])
    assert result.exit_code == 2 and "--max-connections" in result.output
