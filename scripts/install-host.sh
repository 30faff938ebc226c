#!/usr/bin/env bash
# Install gearshift on a systemd host for one or more roles (README, "Run on real hosts").
#
#   sudo scripts/install-host.sh controller          # or agent, gateway; several: agent gateway
#
# - makes a venv at PREFIX/.venv (default /opt/gearshift) and installs this checkout into it
#   (or --wheel FILE), with pip from the package index as configured on the host;
# - installs deploy/systemd/gearshift.sysusers.conf as /etc/sysusers.d/gearshift.conf and
#   runs systemd-sysusers: the unprivileged user `gearshift` the units run as;
# - copies each role's unit, deploy/systemd/gearshift-ROLE.service, to /etc/systemd/system
#   (its ExecStart pointed at PREFIX when that is not /opt/gearshift) and reloads systemd;
# - makes /etc/gearshift (0755: agent.yaml is read by the service user) and
#   /etc/gearshift/tls (0700: systemd reads the certificates as root, LoadCredential=);
# - lists the files each role still needs there, and how to start it. It enables nothing.
#
# --root DIR writes /etc (units, sysusers, /etc/gearshift) under DIR instead, for a test or an
# image being built: systemd-sysusers then works on DIR (--root) and systemd is not reloaded.
# The venv always goes to PREFIX as given (a venv cannot move). Idempotent: run it again to
# upgrade (pip reinstalls gearshift; existing files under /etc/gearshift are left alone).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/install-host.sh [OPTIONS] ROLE [ROLE...]

Install gearshift for systemd: ROLE is controller, agent or gateway.

Options:
  --prefix DIR     the venv goes to DIR/.venv (default: $GEARSHIFT_PREFIX or /opt/gearshift)
  --wheel FILE     install this wheel instead of the checkout this script is in
  --python PY      the Python (>= 3.11) to make the venv with (default: python3)
  --root DIR       write /etc/... under DIR (a test or an image); systemd is not reloaded
  --no-sysusers    do not run systemd-sysusers (the user `gearshift` exists already)
  -h, --help       show this help
EOF
}

die() { echo "install-host: $*" >&2; exit 2; }
say() { echo "install-host: $*"; }

CHECKOUT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHIPPED_PREFIX=/opt/gearshift
PREFIX="${GEARSHIFT_PREFIX:-$SHIPPED_PREFIX}"
WHEEL=
PYTHON=python3
ROOT=
SYSUSERS=1
ROLES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX="$2"; shift 2 ;;
        --prefix=*) PREFIX="${1#*=}"; shift ;;
        --wheel) [ $# -ge 2 ] || die "--wheel needs a file"; WHEEL="$2"; shift 2 ;;
        --wheel=*) WHEEL="${1#*=}"; shift ;;
        --python) [ $# -ge 2 ] || die "--python needs an executable"; PYTHON="$2"; shift 2 ;;
        --python=*) PYTHON="${1#*=}"; shift ;;
        --root) [ $# -ge 2 ] || die "--root needs a directory"; ROOT="$2"; shift 2 ;;
        --root=*) ROOT="${1#*=}"; shift ;;
        --no-sysusers) SYSUSERS=; shift ;;
        -h|--help) usage; exit 0 ;;
        controller|agent|gateway) ROLES+=("$1"); shift ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) die "unknown role '$1': controller, agent or gateway" ;;
    esac
done
[ ${#ROLES[@]} -gt 0 ] || { usage >&2; exit 2; }
case "$PREFIX" in /*) ;; *) die "--prefix must be an absolute path (the units name it); found '$PREFIX'" ;; esac
PREFIX="${PREFIX%/}"
if [ -n "$ROOT" ]; then
    mkdir -p "$ROOT"
    ROOT="$(cd "$ROOT" && pwd)"
fi
if [ -n "$WHEEL" ]; then
    [ -f "$WHEEL" ] || die "--wheel $WHEEL: no such file"
    WHEEL="$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")"
fi
if [ -z "$ROOT" ] && [ "$(id -u)" != 0 ]; then
    die "writing /etc and $PREFIX needs root (or --root DIR for a trial)"
fi
command -v "$PYTHON" >/dev/null || die "no $PYTHON on PATH (--python PY)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is $("$PYTHON" -V 2>&1): gearshift needs Python >= 3.11 (--python PY)"

ETC="$ROOT/etc/gearshift"
UNIT_DIR="$ROOT/etc/systemd/system"
SYSUSERS_DIR="$ROOT/etc/sysusers.d"
VENV="$PREFIX/.venv"

# 1. The venv, and gearshift in it. pip's output goes to a log shown only on failure. The
# checkout is built from a copy: the build writes into the tree it builds (egg-info, build/).
mkdir -p "$PREFIX"
LOG="$PREFIX/install.log"
SOURCE="$WHEEL"
if [ -z "$WHEEL" ]; then
    SOURCE="$(mktemp -d)"
    trap 'rm -rf "$SOURCE"' EXIT
    tar -C "$CHECKOUT" --exclude=./.git --exclude=./.venv --exclude=./build \
        --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$SOURCE" -xf -
fi
say "installing gearshift into $VENV (log: $LOG)"
{
    "$PYTHON" -m venv "$VENV" \
        && "$VENV/bin/pip" install --upgrade pip \
        && "$VENV/bin/pip" install --upgrade "$SOURCE"
} >"$LOG" 2>&1 || { tail -30 "$LOG" >&2; die "pip could not install gearshift (log: $LOG)"; }
"$VENV/bin/gearshift" --help >/dev/null || die "$VENV/bin/gearshift --help failed"

# 2. The service user.
install -d -m 0755 "$SYSUSERS_DIR"
install -m 0644 "$CHECKOUT/deploy/systemd/gearshift.sysusers.conf" "$SYSUSERS_DIR/gearshift.conf"
if [ -n "$SYSUSERS" ]; then
    command -v systemd-sysusers >/dev/null \
        || die "no systemd-sysusers: create the user gearshift yourself and pass --no-sysusers"
    if [ -n "$ROOT" ]; then
        systemd-sysusers --root "$ROOT" "$SYSUSERS_DIR/gearshift.conf"
    else
        systemd-sysusers "$SYSUSERS_DIR/gearshift.conf"
    fi
    say "user gearshift: $SYSUSERS_DIR/gearshift.conf"
fi

# 3. The units, pointed at this venv.
install -d -m 0755 "$UNIT_DIR"
for role in "${ROLES[@]}"; do
    unit="gearshift-$role.service"
    sed "s#$SHIPPED_PREFIX/.venv/bin/gearshift#$VENV/bin/gearshift#g" \
        "$CHECKOUT/deploy/systemd/$unit" >"$UNIT_DIR/$unit.tmp"
    chmod 0644 "$UNIT_DIR/$unit.tmp"
    mv "$UNIT_DIR/$unit.tmp" "$UNIT_DIR/$unit"
    say "unit: $UNIT_DIR/$unit"
done
if [ -z "$ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi

# 4. /etc/gearshift, and what the operator still puts there (README's table).
install -d -m 0755 "$ETC"
install -d -m 0700 "$ETC/tls"
secret="install -m 0600"       # read by systemd as root (LoadCredential=), never by the user
public="install -m 0644"       # read by the service itself
needs() {  # needs ROLE: "how  path  what" lines
    case "$1" in
        controller)
            echo "$secret|/etc/gearshift/tls/ca.pem|the CA (gearshift certs init)"
            echo "$secret|/etc/gearshift/tls/ca-key.pem|the CA's key: signs enrolled agents"
            echo "$secret|/etc/gearshift/tls/controller.pem|the controller's certificate"
            echo "$secret|/etc/gearshift/tls/controller-key.pem|its key"
            echo "$secret|/etc/gearshift/tokens.yaml|the bearer tokens"
            echo "$secret|/etc/gearshift/controller.env|optional: GEARSHIFT_DB=postgresql+psycopg://… (HA)" ;;
        agent)
            echo "$secret|/etc/gearshift/tls/ca.pem|the CA"
            echo "$secret|/etc/gearshift/bootstrap.token|gearshift tokens create --hosts …; may go once joined"
            echo "$public|/etc/gearshift/agent.yaml|deploy/examples/agent.yaml with controller: and enrol_controller: (no secrets)" ;;
        gateway)
            echo "$secret|/etc/gearshift/tls/ca.pem|the CA"
            echo "$secret|/etc/gearshift/tls/gateway.pem|the gateway's certificate"
            echo "$secret|/etc/gearshift/tls/gateway-key.pem|its key"
            echo "$secret|/etc/gearshift/gateway.token|a token of role read (certs/read.token)"
            echo "$secret|/etc/gearshift/gateway.env|GEARSHIFT_CONTROLLER=HOST:50051 (the unit names controller.internal)" ;;
    esac
}
declare -A missing=()
echo
for role in "${ROLES[@]}"; do
    echo "gearshift-$role: files in place (x) and still needed ( ):"
    while IFS='|' read -r how path what; do
        if [ -e "$ROOT$path" ]; then
            mark=x
        else
            mark=" "
            case "$what" in optional:*) ;; *) missing[$path]=1 ;; esac
        fi
        printf '  [%s] %-40s %s  (%s)\n' "$mark" "$path" "$what" "$how"
    done < <(needs "$role")
    echo "  then: systemctl enable --now gearshift-$role"
done
[ ${#missing[@]} -eq 0 ] || echo "(${#missing[@]} file(s) still needed; README, \"Run on real hosts\")"
