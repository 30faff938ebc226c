"""Names that identify parties on the wire: certificate URIs, headers, metadata keys.

The certificate authority (`cli/certs.py`) writes them into certificates, the
controller (`controller/api/security.py`) checks them, and every client sends them;
keeping them in one place keeps the three in step.
"""

from __future__ import annotations

SPIFFE_TRUST_DOMAIN = "gearshift"
HOST_URI_PREFIX = f"spiffe://{SPIFFE_TRUST_DOMAIN}/host/"  # + host id: an agent's URI SAN
GATEWAY_URI = f"spiffe://{SPIFFE_TRUST_DOMAIN}/gateway"  # a gateway's URI SAN
ROLE_URI_PREFIX = f"spiffe://{SPIFFE_TRUST_DOMAIN}/role/"  # + read | admin: a person's
LEGACY_CLI_URI = f"spiffe://{SPIFFE_TRUST_DOMAIN}/cli"  # before roles: counts as read
AUTHORIZATION_HEADER = "authorization"  # gRPC metadata key of the bearer token
BEARER_PREFIX = "bearer "  # compared in lower case
LEADER_METADATA_KEY = "gearshift-leader"  # trailing metadata of a follower's refusal
TOKEN_ENV = "GEARSHIFT_TOKEN"
TOKEN_FILE_ENV = "GEARSHIFT_TOKEN_FILE"
TLS_ENV_PREFIX = "GEARSHIFT_TLS"
