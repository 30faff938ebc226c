"""Enrolment through the real listeners, in one process: an enrolled host's id is not
given to a new key, `gearshift hosts reset` (the CLI, as an operator runs it) lets it
enrol again and refuses its old certificate until then, and a flood of requests from
one address is refused RESOURCE_EXHAUSTED, counted, and not logged one line each.

The controller serves mutual TLS on --listen and its enrolment listener (server TLS
only) on --enrol-listen, signing with --ca-key; the test calls it as an agent does
(`gearshift.agents.enrolment.make_csr`), with no agent process."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from grpc import aio

from gearshift.agents.enrolment import make_csr, new_key
from gearshift.common.credentials import TlsFiles, secure_channel
from gearshift.controller.enrolment.certificate_authority import init_certs
from gearshift.controller.server import Controller, ControllerConfig
from gearshift.v1 import control_pb2_grpc, enrol_pb2, enrol_pb2_grpc


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[tuple[Controller, Path]]:
    certs = tmp_path / "certs"
    init_certs(certs, hosts=[], sans=["localhost", "127.0.0.1"], days=1)
    ctl = Controller(ControllerConfig(
        listen="127.0.0.1:0", data_dir=tmp_path / "data", report_interval_s=0.5,
        tls_cert=certs / "controller.pem", tls_key=certs / "controller-key.pem",
        tls_ca=certs / "ca.pem", tokens_file=certs / "tokens.yaml",
        ca_key=certs / "ca-key.pem", enrol_listen="127.0.0.1:0"))
    await ctl.start()
    try:
        yield ctl, certs
    finally:
        await ctl.stop(0.1)


def _cli(ctl: Controller, certs: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
    env.update({"GEARSHIFT_TLS_CA": str(certs / "ca.pem"),
                "GEARSHIFT_TLS_CERT": str(certs / "cli.pem"),
                "GEARSHIFT_TLS_KEY": str(certs / "cli-key.pem"),
                "GEARSHIFT_TOKEN_FILE": str(certs / "admin.token")})
    return subprocess.run([sys.executable, "-m", "gearshift.cli.main", "--controller",
                           f"localhost:{ctl.port}", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def _save(path: Path, cert_pem: bytes, key: Any) -> tuple[Path, Path]:
    (path / "old.pem").write_bytes(cert_pem)
    (path / "old-key.pem").write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8,
                                                         NoEncryption()))
    return path / "old.pem", path / "old-key.pem"


async def test_no_reissue_reset_then_rate_limited(secured: tuple[Controller, Path],
                                                  tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    ctl, certs = secured
    caplog.set_level(logging.INFO, logger="gearshift.controller.enrolment.service")
    admin = (certs / "admin.token").read_text().strip()
    tls = TlsFiles(certs / "ca.pem", certs / "cli.pem", certs / "cli-key.pem", "localhost")
    async with secure_channel(f"127.0.0.1:{ctl.port}", tls, admin) as control, \
            secure_channel(f"127.0.0.1:{ctl.enrol_port}",
                           TlsFiles(certs / "ca.pem", server_name="localhost")) as listener:
        created = await control_pb2_grpc.ControlServiceStub(control).CreateBootstrapToken(
            enrol_pb2.CreateBootstrapTokenRequest(host_pattern="gpu-*", auto_approve=True))
        token = created.secret_token
        enrol = enrol_pb2_grpc.EnrolServiceStub(listener).Enrol

        old_key = new_key()
        first = await enrol(enrol_pb2.EnrolRequest(bootstrap_token=token,
                                                   csr_pem=make_csr("gpu-1", old_key)))
        assert first.status == enrol_pb2.ENROL_STATUS_ISSUED
        # The reusable, auto-approving token does not give gpu-1's id to another key.
        with pytest.raises(aio.AioRpcError) as refused:
            await enrol(enrol_pb2.EnrolRequest(bootstrap_token=token,
                                               csr_pem=make_csr("gpu-1", new_key())))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "`gearshift hosts reset gpu-1`" in (refused.value.details() or "")

        reset = await asyncio.to_thread(_cli, ctl, certs, "hosts", "reset", "gpu-1",
                                        "--reason", "disk wiped")
        assert reset.returncode == 0, reset.stderr
        assert reset.stdout.startswith("host gpu-1: reset;"), reset.stdout
        listed = await asyncio.to_thread(_cli, ctl, certs, "hosts", "list")
        assert "reset: disk wiped" in listed.stdout, listed.stdout
        # Until it enrols again, its old certificate renews nothing (mutual-TLS port).
        old = _save(tmp_path, first.certificate_pem, old_key)
        async with secure_channel(f"127.0.0.1:{ctl.port}",
                                  TlsFiles(certs / "ca.pem", *old, "localhost")) as mine:
            with pytest.raises(aio.AioRpcError) as renewal:
                await enrol_pb2_grpc.EnrolServiceStub(mine).Renew(
                    enrol_pb2.RenewRequest(csr_pem=make_csr("gpu-1", new_key())))
        assert renewal.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "was reset" in (renewal.value.details() or "")
        again = await enrol(enrol_pb2.EnrolRequest(bootstrap_token=token,
                                                   csr_pem=make_csr("gpu-1", new_key())))
        assert again.status == enrol_pb2.ENROL_STATUS_ISSUED

        # A flood of wrong tokens from one address: refused by rate before the token is
        # looked at, counted, and not logged one line each.
        wrong = enrol_pb2.EnrolRequest(bootstrap_token=token[:9] + "x" * 43,
                                       csr_pem=make_csr("gpu-2", new_key()))
        results = await asyncio.gather(*(enrol(wrong) for _ in range(60)),
                                       return_exceptions=True)
    codes = collections.Counter(r.code() for r in results if isinstance(r, aio.AioRpcError))
    assert sum(codes.values()) == 60, results
    assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 30, codes
    assert codes[grpc.StatusCode.PERMISSION_DENIED] >= 10, codes
    limited = next(r for r in results if isinstance(r, aio.AioRpcError)
                   and r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "too many enrolment requests from 127.0.0.1" in (limited.details() or "")
    sample = ctl.metrics.registry.get_sample_value
    assert sample("gearshift_controller_enrolments_total", {"outcome": "rate_limited"}) == \
        codes[grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert sample("gearshift_controller_enrolments_total", {"outcome": "refused"}) == \
        codes[grpc.StatusCode.PERMISSION_DENIED] + 2  # and the re-issue, the renewal
    assert sample("gearshift_controller_enrolments_total", {"outcome": "issued"}) == 2
    # Only the reset and the (authenticated) renewal are logged so far: the enrolment
    # refusals come in one summary line per REFUSAL_LOG_INTERVAL_S.
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and warnings[0].startswith("host gpu-1 reset (disk wiped)") \
        and warnings[1].startswith("renewal refused"), warnings
    line = ctl.enrol.log_refusals()
    assert line is not None and line.startswith("refused 61 enrolment requests"), line
    assert "from 1 source" in line, line
