"""The controller process's settings (`ControllerConfig`) and their validation.

The CLI (`gearshift controller run`) fills a `ControllerConfig` from its flags;
`validate()` refuses bad values with a message naming the flag and the value found.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from gearshift.common.errors import ConfigError
from gearshift.common.ops_http import parse_listen

DEFAULT_REPORT_INTERVAL_S = 10.0
DEFAULT_ENROLLED_CERT_TTL_S = 86400.0  # a day: renewed by the agent at two thirds
MIN_ENROLLED_CERT_TTL_S = 2.0
MAX_ENROLLED_CERT_TTL_S = 90 * 86400.0


@dataclass
class ControllerConfig:
    """How one controller process runs (the CLI's flags); `validate()` checks it."""

    listen: str = "127.0.0.1:50051"
    db_url: str = ""                       # empty: SQLite under data_dir
    data_dir: Path = field(default_factory=lambda: Path("./data"))
    metrics_port: int | None = None        # /metrics etc. on 127.0.0.1:PORT (0: pick one)
    metrics_listen: str = ""               # HOST:PORT of /metrics, /healthz, /readyz;
                                           # wins over metrics_port
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S
    history_resolution_s: float = 60.0     # request-rate samples kept for the policy
    gpu_price_per_hour: float | None = None  # USD, the fleet's: for policies that set none
    canary_steps: tuple[float, ...] = (0.1, 0.25, 0.5)
    analysis_intervals: int = 3            # good report intervals per canary step
    tls_cert: Path | None = None           # server certificate (PEM); None: plaintext, loopback only
    tls_key: Path | None = None
    tls_ca: Path | None = None             # with TLS: clients (agents, gateway, CLI) must present
                                           # a certificate from this CA (mutual TLS)
    tokens_file: Path | None = None        # bearer tokens (read/admin); else $GEARSHIFT_TOKENS
    controller_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    advertise: str = ""                    # HOST:PORT clients reach this controller at;
                                           # empty: the listen address (its bound port)
    lease_ttl_s: float = 10.0              # HA on PostgreSQL: leadership lease
    enrol_listen: str = ""                 # HOST:PORT of the enrolment listener (server TLS
                                           # only: agents with a bootstrap token); empty: none
    ca_key: Path | None = None             # the CA's private key: sign enrolled agents' and
                                           # renewed certificates (docs/enrolment.md)
    enrolled_cert_ttl_s: float = DEFAULT_ENROLLED_CERT_TTL_S

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def validate(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key: give both or neither")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-ca needs --tls-cert and --tls-key")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"--listen: expected HOST:PORT, found {self.listen!r}")
        if not (0.1 <= self.report_interval_s <= 3600):
            raise ConfigError(
                f"--report-interval: expected 0.1..3600 seconds, found {self.report_interval_s}")
        if not (0.1 <= self.history_resolution_s <= 3600):
            raise ConfigError(
                f"--history-resolution: expected 0.1..3600 seconds, found {self.history_resolution_s}")
        if self.gpu_price_per_hour is not None and not (
                math.isfinite(self.gpu_price_per_hour) and self.gpu_price_per_hour > 0):
            raise ConfigError(f"--gpu-price-per-hour: expected a positive number of USD per "
                              f"GPU-hour, found {self.gpu_price_per_hour}")
        if not self.canary_steps or any(not (0 < s < 1) for s in self.canary_steps) \
                or list(self.canary_steps) != sorted(self.canary_steps):
            raise ConfigError(
                f"--canary-steps: expected increasing traffic shares between 0 and 1, "
                f"found {','.join(str(s) for s in self.canary_steps)}")
        if self.advertise:
            a_host, a_sep, a_port = self.advertise.rpartition(":")
            if not a_sep or not a_host or not a_port.isdigit() or not 0 < int(a_port) <= 65535:
                raise ConfigError(f"--advertise: expected HOST:PORT, found {self.advertise!r}")
        if not (1.0 <= self.lease_ttl_s <= 300):
            raise ConfigError(f"--lease-ttl: expected 1..300 seconds, found {self.lease_ttl_s}")
        if self.metrics_port is not None and not (0 <= self.metrics_port <= 65535):
            raise ConfigError(f"--metrics-port: expected 0..65535, found {self.metrics_port}")
        if self.ca_key is not None and self.tls_ca is None:
            raise ConfigError("--ca-key needs --tls-ca (the CA certificate it belongs to) and "
                              "--tls-cert/--tls-key")
        if self.enrol_listen:
            if self.ca_key is None:
                raise ConfigError("--enrol-listen needs --ca-key (the CA key that signs "
                                  "enrolled agents' certificates) and --tls-ca")
            e_host, e_sep, e_port = self.enrol_listen.rpartition(":")
            if not e_sep or not e_host or not e_port.isdigit() or int(e_port) > 65535:
                raise ConfigError(f"--enrol-listen: expected HOST:PORT, found "
                                  f"{self.enrol_listen!r}")
        if not (MIN_ENROLLED_CERT_TTL_S <= self.enrolled_cert_ttl_s <= MAX_ENROLLED_CERT_TTL_S):
            raise ConfigError(f"--enrolled-cert-ttl: expected {MIN_ENROLLED_CERT_TTL_S:g}.."
                              f"{MAX_ENROLLED_CERT_TTL_S:g} seconds, found "
                              f"{self.enrolled_cert_ttl_s:g}")
        if self.metrics_listen:
            try:
                parse_listen(self.metrics_listen)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

    def ops_address(self) -> tuple[str, int] | None:
        """Where /metrics, /healthz and /readyz are served (None: nowhere)."""
        if self.metrics_listen:
            return parse_listen(self.metrics_listen)
        if self.metrics_port is not None:
            return "127.0.0.1", self.metrics_port
        return None
