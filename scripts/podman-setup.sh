#!/usr/bin/env bash
# Make podman usable on this host for `make image` and the container test; idempotent.
#
# - installs podman, buildah, runc, debootstrap and docker-registry (the CNCF distribution
#   registry, /usr/bin/docker-registry: tests push and pull images through one on loopback) from
#   the distribution's packages where missing (Debian/Ubuntu: apt-get; nothing is done
#   elsewhere: have podman or docker installed), and Docker's engine (docker.io: the
#   engine-container test runs the same moves against a dockerd of its own); the registry and
#   docker services the packages may start are stopped and disabled: tests run their own;
# - writes a containers.conf under build/podman/ (runtime runc: crun cannot start containers on
#   hosts whose cgroups are in hybrid mode; default ulimits within this host's limits) and prints
#   `export CONTAINERS_CONF=...` for the caller; as root, the same as
#   /etc/containers/containers.conf where the host has none;
# - with --with-base: builds the local base image `localhost/gearshift-debian:bookworm` with
#   debootstrap when it is missing (no registry needed: `make image-emulator` and the container
#   test build both images FROM it).
#
# Usage: eval "$(scripts/podman-setup.sh [--with-base])"   (prints only the export line on stdout)
# With GEARSHIFT_PODMAN_NO_INSTALL=1 it installs nothing (exit 3 naming what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE="${GEARSHIFT_BASE_IMAGE:-localhost/gearshift-debian:bookworm}"
SUITE="${GEARSHIFT_BASE_SUITE:-bookworm}"
CONF_DIR="$PWD/build/podman"
CONF="$CONF_DIR/containers.conf"
WITH_BASE=
[ "${1:-}" = --with-base ] && WITH_BASE=1
log() { echo "podman-setup: $*" >&2; }

need=()
command -v podman >/dev/null || need+=(podman)
command -v buildah >/dev/null || need+=(buildah)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v docker-registry >/dev/null || need+=(docker-registry)
command -v dockerd >/dev/null || need+=(docker.io)
if [ ${#need[@]} -gt 0 ]; then
    if [ -n "${GEARSHIFT_PODMAN_NO_INSTALL:-}" ]; then
        log "missing ${need[*]} (scripts/podman-setup.sh installs them as root on Debian/Ubuntu)"
        exit 3
    fi
    if ! command -v apt-get >/dev/null; then
        log "missing ${need[*]} and no apt-get here: install them with the system's package manager"
        exit 1
    fi
    if [ "$(id -u)" != 0 ]; then
        log "missing ${need[*]}: run this script as root once (it installs them with apt-get)"
        exit 1
    fi
    log "installing ${need[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || true
    # -o DPkg::Lock::Timeout: wait for another apt run instead of failing.
    apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends \
        podman buildah runc debootstrap docker-registry docker.io uidmap slirp4netns netavark \
        aardvark-dns fuse-overlayfs containernetworking-plugins >&2
    if [[ " ${need[*]} " == *" docker-registry "* ]] && [ -d /run/systemd/system ]; then
        systemctl disable --now docker-registry.service >&2 2>/dev/null || true
    fi
    # Docker's engine likewise: the engine-container test starts a dockerd of its own.
    if [[ " ${need[*]} " == *" docker.io "* ]] && [ -d /run/systemd/system ]; then
        systemctl disable --now docker.socket docker.service >&2 2>/dev/null || true
    fi
fi

# nofile/nproc defaults must fit under the hard limits podman itself runs with.
nofile_hard=$(ulimit -Hn); nproc_hard=$(ulimit -Hu)
nofile=20000; nproc=32768
[ "$nofile_hard" != unlimited ] && [ "$nofile_hard" -lt "$nofile" ] && nofile=$nofile_hard
[ "$nproc_hard" != unlimited ] && [ "$nproc_hard" -lt "$nproc" ] && nproc=$nproc_hard
mkdir -p "$CONF_DIR"
want="[containers]
default_ulimits = [\"nofile=${nofile}:${nofile}\", \"nproc=${nproc}:${nproc}\"]

[engine]
runtime = \"runc\"
"
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$(printf '%s' "$want")" ]; then
    printf '%s' "$want" > "$CONF"
fi
export CONTAINERS_CONF="$CONF"
# The same settings for every podman on this host that has none of its own (an agent
# started without CONTAINERS_CONF, and the `podman system service` it may start).
if [ "$(id -u)" = 0 ] && [ ! -e /etc/containers/containers.conf ]; then
    mkdir -p /etc/containers
    cp "$CONF" /etc/containers/containers.conf
    log "wrote /etc/containers/containers.conf (runtime runc, default ulimits within this host's limits)"
fi

if [ -n "$WITH_BASE" ] && ! podman image exists "$BASE_IMAGE"; then
    command -v debootstrap >/dev/null || { log "debootstrap missing: cannot build $BASE_IMAGE"; exit 1; }
    log "building $BASE_IMAGE with debootstrap --variant=minbase $SUITE (about 30 s)"
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase "$SUITE" "$root" >&2
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import \
        --change 'CMD ["/bin/bash"]' \
        --message "debootstrap --variant=minbase $SUITE" - "$BASE_IMAGE" >&2
fi
echo "export CONTAINERS_CONF=$CONF"
