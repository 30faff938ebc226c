#!/usr/bin/env bash
# Build the gearshift images (deploy/images/*.Containerfile) with podman or docker.
#
# Environment (all optional; `make image` and `make image-emulator` set them):
#   CONTAINER            podman or docker (default: podman when installed, else docker)
#   CONTROL_BASE_IMAGE   base of the control-plane image (default: the Containerfile's)
#   ENGINE_IMAGE         base of the agent image: an engine's serving image (default: the
#                        Containerfile's, vLLM's official image)
#   ENGINE               engine the agent image serves: vllm, tensorrt-llm, sglang, emulator
#   IMAGE_PREFIX         name prefix of the images (default localhost/)
#   CA_BUNDLE            CA bundle pip trusts inside the build, passed as a build secret
#                        (default: the host's, when it exists)
#   IMAGES               which images: "control-plane agent" (default) or one of them
# Prints the names of the images built, one a line, on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

CONTAINER="${CONTAINER:-$(command -v podman >/dev/null 2>&1 && echo podman || echo docker)}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "$REVISION" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    REVISION="$REVISION-dirty"
fi
SOURCE="${SOURCE:-https://github.com/gearshift/gearshift}"
ENGINE="${ENGINE:-vllm}"
PREFIX="${IMAGE_PREFIX:-localhost/}"
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
IMAGES="${IMAGES:-control-plane agent}"

common=(--build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION"
        --build-arg "SOURCE=$SOURCE")
if [ -s "$CA_BUNDLE" ]; then
    common+=(--secret "id=ca,src=$CA_BUNDLE")
fi
if [ "$CONTAINER" = docker ]; then
    export DOCKER_BUILDKIT=1  # build secrets and RUN --mount need BuildKit
fi

for image in $IMAGES; do
    case "$image" in
    control-plane)
        name="${PREFIX}gearshift:$VERSION"
        args=()
        [ -n "${CONTROL_BASE_IMAGE:-}" ] && args+=(--build-arg "BASE_IMAGE=$CONTROL_BASE_IMAGE")
        ;;
    agent)
        name="${PREFIX}gearshift-agent:$VERSION-$ENGINE"
        args=(--build-arg "ENGINE=$ENGINE")
        [ -n "${ENGINE_IMAGE:-}" ] && args+=(--build-arg "ENGINE_IMAGE=$ENGINE_IMAGE")
        ;;
    *)
        echo "build-images: unknown image $image (control-plane, agent)" >&2
        exit 2
        ;;
    esac
    echo "build-images: $CONTAINER build $name" >&2
    "$CONTAINER" build --file "deploy/images/$image.Containerfile" --tag "$name" \
        "${common[@]}" "${args[@]}" . >&2
    echo "$name"
done
