"""Tokens, roles, the method map, client-side address and secret handling, `certs init`."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from gearshift.common.credentials import (
    TlsFiles,
    address_host,
    channel_credentials,
    check_plaintext,
    is_loopback_address,
    load_token,
    secure_channel,
)
from gearshift.common.errors import ConfigError
from gearshift.controller.api.security import (
    AuthInterceptor,
    Role,
    TokenStore,
    bearer_token,
    check_plaintext_listen,
    server_credentials,
    token_fingerprint,
)

ADMIN = "admin-token-0123456789abcdef"
READ = "read-token-0123456789abcdef"
CONTROL = "/gearshift.v1.ControlService/"


def store() -> TokenStore:
    return TokenStore.from_mapping({"admin": ADMIN, "read": [READ]})


def auth(token: str | None) -> list[tuple[str, str]]:
    return [] if token is None else [("authorization", f"Bearer {token}")]


# -- tokens ---------------------------------------------------------------------------


def test_token_file_yaml_and_lines(tmp_path: Path) -> None:
    yaml_file = tmp_path / "tokens.yaml"
    yaml_file.write_text(f'# comment\nadmin: "{ADMIN}"\nread: [{READ}, {READ}x]\n')
    lines_file = tmp_path / "tokens.txt"
    lines_file.write_text(f"admin:{ADMIN}\n\nread:{READ}\n")
    for path in (yaml_file, lines_file):
        tokens = TokenStore.from_file(path)
        assert tokens.authenticate(ADMIN).role == Role.ADMIN  # type: ignore[union-attr]
        assert tokens.authenticate(READ).role == Role.READ  # type: ignore[union-attr]
        assert tokens.authenticate(READ[:-1]) is None
    assert TokenStore.from_file(yaml_file).authenticate(READ + "x") is not None


def test_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GS_TEST_TOKENS", f"admin:{ADMIN},read:{READ}")
    tokens = TokenStore.from_env("GS_TEST_TOKENS")
    assert tokens.authenticate(READ).role == Role.READ  # type: ignore[union-attr]
    monkeypatch.delenv("GS_TEST_TOKENS")
    with pytest.raises(ConfigError, match=r"\$GS_TEST_TOKENS: not set"):
        TokenStore.from_env("GS_TEST_TOKENS")


@pytest.mark.parametrize(("text", "message"), [
    (f"root: {ADMIN}\n", "unknown role 'root'; known roles: admin, read"),
    ("admin: short\n", "at least 16 characters"),
    ("admin:\n", "expected a non-empty token string"),
    ("just-a-token-without-role\n", ":1: expected 'role: token'"),
    ("", "no tokens given"),
])
def test_bad_token_files_name_what_and_where(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        TokenStore.from_file(path)
    if text:
        assert str(path) in str(err.value)


def test_missing_token_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"token file .*nope\.yaml: cannot read"):
        TokenStore.from_file(tmp_path / "nope.yaml")


def test_tokens_never_show_in_repr_or_logs(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                           ) -> None:
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "t.yaml"
    path.write_text(f"admin: {ADMIN}\nread: {READ}\n")
    tokens = TokenStore.from_file(path)
    interceptor = AuthInterceptor(tokens)
    interceptor.check(CONTROL + "ApplyPolicy", auth(READ))
    interceptor.check(CONTROL + "ApplyPolicy", auth(ADMIN))
    interceptor.check(CONTROL + "ApplyPolicy", auth("unknown-token-0123456789"))
    text = caplog.text + repr(tokens)
    assert ADMIN not in text and READ not in text and "unknown-token" not in text
    assert token_fingerprint(READ) in caplog.text
    assert len(token_fingerprint(READ)) == 8


def test_bearer_token_parsing() -> None:
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("Authorization", b"bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token(None) is None


# -- roles ----------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "token", "expected"), [
    ("ListHosts", READ, None),
    ("ListHosts", ADMIN, None),
    ("WatchRoutes", READ, None),
    ("ApplyPolicy", ADMIN, None),
    ("ApplyPolicy", READ, (grpc.StatusCode.PERMISSION_DENIED,
                           "role read cannot call ApplyPolicy (needs admin)")),
    ("SetPaused", READ, (grpc.StatusCode.PERMISSION_DENIED,
                         "role read cannot call SetPaused (needs admin)")),
    ("ListHosts", None, (grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")),
    ("ListHosts", "x" * 20, (grpc.StatusCode.UNAUTHENTICATED, "invalid token")),
    ("SomeFutureMethod", READ, (grpc.StatusCode.PERMISSION_DENIED,
                                "role read cannot call SomeFutureMethod (needs admin)")),
])
def test_interceptor_decisions(method: str, token: str | None,
                               expected: tuple[grpc.StatusCode, str] | None) -> None:
    assert AuthInterceptor(store()).check(CONTROL + method, auth(token)) == expected


def test_exempt_services_need_no_token() -> None:
    interceptor = AuthInterceptor(store())
    for method in ("/gearshift.v1.AgentService/Connect", "/grpc.health.v1.Health/Check",
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        assert interceptor.check(method, []) is None


# -- credentials and addresses ----------------------------------------------------------


@pytest.mark.parametrize(("addr", "host", "loopback"), [
    ("127.0.0.1:50051", "127.0.0.1", True),
    ("127.3.4.5:1", "127.3.4.5", True),
    ("localhost:50051", "localhost", True),
    ("[::1]:50051", "::1", True),
    ("ipv4:127.0.0.1:9", "127.0.0.1", True),
    ("unix:/tmp/gs.sock", "unix", True),
    ("0.0.0.0:50051", "0.0.0.0", False),
    ("10.0.0.5:50051", "10.0.0.5", False),
    ("controller.internal:50051", "controller.internal", False),
])
def test_loopback_addresses(addr: str, host: str, loopback: bool) -> None:
    if not addr.startswith("unix:"):
        assert address_host(addr) == host
    assert is_loopback_address(addr) is loopback


def test_plaintext_refused_off_loopback_and_loud_on_it(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match=r"plaintext gRPC to 10\.0\.0\.5:50051 refused"):
        secure_channel("10.0.0.5:50051", None, READ)
    with caplog.at_level(logging.WARNING):
        check_plaintext("127.0.0.1:50051")
        check_plaintext_listen("127.0.0.1:0")
    assert "PLAINTEXT gRPC to 127.0.0.1:50051: for loopback development only" in caplog.text
    assert "PLAINTEXT gRPC listening on 127.0.0.1:0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a client reconnecting is not warned again
        for _ in range(3):
            check_plaintext("127.0.0.1:50052")
    assert caplog.text.count("PLAINTEXT gRPC to 127.0.0.1:50052") == 1
    with pytest.raises(ConfigError, match=r"listening on 0\.0\.0\.0:50051 refused.*--tls-cert"):
        check_plaintext_listen("0.0.0.0:50051")


def test_load_token_sources(tmp_path: Path) -> None:
    path = tmp_path / "read.token"
    path.write_text(READ + "\n")
    assert load_token(path, environ={}) == READ
    assert load_token(environ={"GEARSHIFT_TOKEN_FILE": str(path)}) == READ
    assert load_token(environ={"GEARSHIFT_TOKEN": f" {ADMIN} "}) == ADMIN
    assert load_token(environ={}) is None
    path.write_text("two tokens\n")
    with pytest.raises(ConfigError, match="expected one token on one line"):
        load_token(path, environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_token(tmp_path / "missing", environ={})


def test_tls_files_from_env_and_bad_pem(tmp_path: Path) -> None:
    assert TlsFiles.from_env(environ={}) is None
    tls = TlsFiles.from_env(environ={"GEARSHIFT_TLS_CA": "/c/ca.pem",
                                     "GEARSHIFT_TLS_CERT": "/c/cli.pem",
                                     "GEARSHIFT_TLS_KEY": "/c/cli-key.pem"})
    assert tls == TlsFiles(Path("/c/ca.pem"), Path("/c/cli.pem"), Path("/c/cli-key.pem"))
    with pytest.raises(ConfigError, match="without"):
        TlsFiles.from_env(environ={"GEARSHIFT_TLS_CERT": "/c/cli.pem"})
    with pytest.raises(ConfigError, match="give both or neither"):
        TlsFiles(Path("ca.pem"), cert=Path("cli.pem"))
    junk = tmp_path / "ca.pem"
    junk.write_text("hello")
    with pytest.raises(ConfigError, match=r"--tls-ca .*ca\.pem: not a PEM file"):
        channel_credentials(junk)
    with pytest.raises(ConfigError, match=r"--tls-cert .*nope\.pem: cannot read"):
        server_credentials(tmp_path / "nope.pem", junk, junk)
    with pytest.raises(ConfigError, match="a CA is needed"):
        server_credentials(junk, junk, None, require_client_cert=True)


# -- gearshift certs init ---------------------------------------------------------------


def test_certs_init_writes_private_files_and_refuses_to_overwrite(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from cryptography import x509

    from gearshift.cli.certs import certs

    out = tmp_path / "pki"
    runner = CliRunner()
    args = ["init", "--out", str(out), "--hosts", "host-a,host-b", "--days", "2"]
    result = runner.invoke(certs, args)
    assert result.exit_code == 0, result.output
    expected = {"ca", "controller", "agent-host-a", "agent-host-b", "gateway", "cli"}
    for stem in expected:
        assert stat.S_IMODE((out / f"{stem}-key.pem").stat().st_mode) == 0o600
        assert (out / f"{stem}.pem").read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    for name in ("tokens.yaml", "admin.token", "read.token"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600
    tokens = TokenStore.from_file(out / "tokens.yaml")
    principal = tokens.authenticate((out / "admin.token").read_text().strip())
    assert principal is not None and principal.role == Role.ADMIN

    agent = x509.load_pem_x509_certificate((out / "agent-host-a.pem").read_bytes())
    uris = agent.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert uris.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://gearshift/host/host-a"]
    controller = x509.load_pem_x509_certificate((out / "controller.pem").read_bytes())
    sans = controller.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]

    before = (out / "ca.pem").read_bytes()
    again = runner.invoke(certs, args)
    assert again.exit_code != 0
    assert "refusing to overwrite" in again.output and "--force" in again.output
    assert (out / "ca.pem").read_bytes() == before
    forced = runner.invoke(certs, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert (out / "ca.pem").read_bytes() != before

    issued = runner.invoke(certs, ["issue", "--out", str(out), "--host", "host-c"])
    assert issued.exit_code == 0, issued.output
    assert stat.S_IMODE((out / "agent-host-c-key.pem").stat().st_mode) == 0o600
    again = runner.invoke(certs, ["issue", "--out", str(out), "--host", "host-c"])
    assert again.exit_code != 0 and "refusing to overwrite" in again.output
    no_ca = runner.invoke(certs, ["issue", "--out", str(tmp_path / "empty"), "--host", "h"])
    assert no_ca.exit_code != 0 and "ca.pem: not found" in no_ca.output


@pytest.mark.parametrize(("args", "message"), [
    (["--hosts", "bad host"], "is not a host id"),
    (["--hosts", "a,a"], "duplicate host ids"),
    (["--controller-san", "not a name!"], "neither an IP address nor a DNS name"),
    (["--days", "0"], "--days: expected at least 1"),
])
def test_certs_init_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    pytest.importorskip("cryptography")
    from gearshift.cli.certs import certs

    result = CliRunner().invoke(certs, ["init", "--out", str(tmp_path / "pki"), *args])
    assert result.exit_code != 0
    assert message in result.output
    assert not (tmp_path / "pki" / "ca-key.pem").exists()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_token_file_text_gives_a_store_or_a_config_error(text: str) -> None:
    try:
        tokens = TokenStore.parse(text, "fuzz.yaml")
    except ConfigError as exc:
        assert "fuzz.yaml" in str(exc) or "no tokens" in str(exc)
    else:
        assert "TokenStore(" in repr(tokens)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["authorization", "Authorization", "x-other"]),
                          st.one_of(st.text(max_size=40), st.binary(max_size=40))), max_size=3))
def test_any_metadata_is_checked_without_crashing(metadata: list[tuple[str, object]]) -> None:
    refusal = AuthInterceptor(store()).check(CONTROL + "ApplyPolicy", metadata)
    assert refusal is None or refusal[0] in (grpc.StatusCode.UNAUTHENTICATED,
                                             grpc.StatusCode.PERMISSION_DENIED)
