#!/bin/sh
# Build steps shared by the gearshift images; run by the Containerfiles, never on a host.
#
#   install.sh system   python3 (>= 3.11, with venv), tini and CA certificates from the base's
#                       apt where the base lacks them; the unprivileged user gearshift (10001)
#   install.sh deps     /opt/gearshift/.venv with the pinned dependencies (requirements.txt)
#   install.sh app      gearshift itself from /tmp/src, without touching the dependencies
#
# pip reaches PyPI; when the build passes a CA bundle as the secret `ca` (a host behind a
# TLS-inspecting proxy), pip uses it from /run/secrets/ca: it is never copied into a layer.
set -eu
PREFIX=/opt/gearshift
VENV=$PREFIX/.venv
APP_UID=10001

pip_cert() {
    if [ -s /run/secrets/ca ]; then echo "--cert /run/secrets/ca"; fi
}

case "${1:-}" in
system)
    need=""
    if ! python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' \
            2>/dev/null; then
        need="python3 python3-venv"
    fi
    command -v tini >/dev/null 2>&1 || need="$need tini"
    [ -s /etc/ssl/certs/ca-certificates.crt ] || need="$need ca-certificates"
    if [ -n "$need" ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        # shellcheck disable=SC2086 # word splitting intended: a list of packages
        apt-get install -y -q --no-install-recommends $need
        apt-get clean
        rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /var/log/apt /var/log/dpkg.log
    fi
    command -v tini
    if ! python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))'; then
        echo "install.sh: this base's python3 ($(python3 --version 2>&1)) is older than 3.11" \
             "or has no venv module: gearshift needs 3.11 or newer" >&2
        exit 1
    fi
    if ! getent passwd gearshift >/dev/null; then
        if command -v useradd >/dev/null 2>&1; then
            useradd --system --uid "$APP_UID" --user-group --home-dir /var/lib/gearshift \
                --no-create-home --shell /usr/sbin/nologin gearshift
        else
            echo "gearshift:x:$APP_UID:$APP_UID::/var/lib/gearshift:/usr/sbin/nologin" >> /etc/passwd
            echo "gearshift:x:$APP_UID:" >> /etc/group
        fi
    fi
    mkdir -p /var/lib/gearshift /var/cache/gearshift /etc/gearshift
    chown "$APP_UID:$APP_UID" /var/lib/gearshift /var/cache/gearshift
    ;;
deps)
    python3 -m venv "$VENV"
    # shellcheck disable=SC2046 # $(pip_cert) is empty or two words
    "$VENV/bin/pip" install --no-cache-dir --disable-pip-version-check --no-input \
        $(pip_cert) -r /tmp/requirements.txt
    ;;
app)
    # setuptools and wheel come pinned with the dependencies: no network here.
    "$VENV/bin/pip" install --no-cache-dir --disable-pip-version-check --no-input \
        --no-deps --no-build-isolation --no-index /tmp/src
    "$VENV/bin/python" -m compileall -q "$VENV/lib" >/dev/null || true
    ln -sf "$VENV/bin/gearshift" /usr/local/bin/gearshift
    gearshift --version >/dev/null 2>&1 || gearshift --help >/dev/null
    ;;
*)
    echo "usage: install.sh system|deps|app" >&2
    exit 2
    ;;
esac
