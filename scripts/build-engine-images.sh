#!/usr/bin/env bash
# Build the emulated engine images (deploy/images/engine-emulated.Containerfile) with podman
# or docker: each engine's real executables and entrypoint running the gearshift emulator, so
# the agent can run engines as containers without GPUs. `make image-engines` runs it.
#
# They are built FROM the emulator agent image (`make image-emulator`), which is (re)built
# here first (scripts/build-images.sh IMAGES=agent ENGINE=emulator: seconds from the layer
# cache when gearshift's sources are unchanged), so the images carry the working tree's
# gearshift; REBUILD_AGENT=0 keeps an existing one as it is.
#
# Environment (all optional):
#   CONTAINER            podman or docker (default: podman when installed, else docker)
#   AGENT_BASE_IMAGE     base of the emulator agent image when it is built here
#                        (default localhost/gearshift-debian:bookworm, scripts/podman-setup.sh
#                        --with-base makes it)
#   REBUILD_AGENT        0: keep the emulator agent image when it exists (default 1)
#   VLLM_VERSION         vLLM release emulated (default 0.11.0)
#   TRTLLM_VERSION       TensorRT-LLM release emulated (default 1.2.0)
#   SGLANG_VERSION       SGLang release emulated (default 0.5.7)
#   IMAGE_PREFIX         name prefix of the images (default localhost/)
#   CA_BUNDLE            CA bundle passed as the build secret `ca`, as scripts/build-images.sh
#                        does (default: the host's, when it exists)
# Prints the names of the engine images, one a line, on stdout; logs go to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

CONTAINER="${CONTAINER:-$(command -v podman >/dev/null 2>&1 && echo podman || echo docker)}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"
PREFIX="${IMAGE_PREFIX:-localhost/}"
AGENT_BASE_IMAGE="${AGENT_BASE_IMAGE:-localhost/gearshift-debian:bookworm}"
AGENT_IMAGE="${PREFIX}gearshift-agent:$VERSION-emulator"
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
# flavour (the emulator's and the agent's engine name) and the release it emulates
ENGINES=("vllm ${VLLM_VERSION:-0.11.0}"
         "tensorrt-llm ${TRTLLM_VERSION:-1.2.0}"
         "sglang ${SGLANG_VERSION:-0.5.7}")
log() { echo "build-engine-images: $*" >&2; }

if [ "$CONTAINER" = docker ]; then
    export DOCKER_BUILDKIT=1  # build secrets need BuildKit
fi

if [ "${REBUILD_AGENT:-1}" = 1 ] || ! "$CONTAINER" image inspect "$AGENT_IMAGE" >/dev/null 2>&1; then
    log "building $AGENT_IMAGE on $AGENT_BASE_IMAGE"
    CONTAINER="$CONTAINER" IMAGES=agent ENGINE=emulator ENGINE_IMAGE="$AGENT_BASE_IMAGE" \
        IMAGE_PREFIX="$PREFIX" CA_BUNDLE="$CA_BUNDLE" scripts/build-images.sh >/dev/null
fi

common=(--file deploy/images/engine-emulated.Containerfile --build-arg "BASE_IMAGE=$AGENT_IMAGE")
if [ -s "$CA_BUNDLE" ]; then
    common+=(--secret "id=ca,src=$CA_BUNDLE")
fi

for engine in "${ENGINES[@]}"; do
    read -r flavor engine_version <<<"$engine"
    name="${PREFIX}gearshift-emulated-$flavor:$engine_version"
    log "$CONTAINER build $name"
    "$CONTAINER" build "${common[@]}" --target "$flavor" \
        --build-arg "FLAVOR=$flavor" --build-arg "ENGINE_VERSION=$engine_version" \
        --tag "$name" . >&2
    echo "$name"
done
