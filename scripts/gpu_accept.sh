#!/usr/bin/env bash
# The GPU acceptance run: everything a GPU path can break, on one GPU host (an
# H100 or an H200), in six runs of at most 9 minutes each, one device call
# each (the vLLM bundle travels one part per run: the tree and one part fit a
# call). Every change to a GPU path ends with all six passing on the tree it
# submits; BENCHMARKS.md, "GPU acceptance", holds the last result.
#
# Usage (repository root, on the GPU host):
#   ECHO_COMMIT=<sha> OUT=<dir> bash scripts/gpu_accept.sh RUN
# RUN (each step's time limit in brackets):
#   1  kernels: the kernel tests compiled on the GPU (test_kernels.py and the
#      shape sweep: widths 1-70, 127-129 and large, P = 2, 3, 4, 8,
#      bf16/fp16/fp32, bf16/int8/no feedback, chains, special values) [540 s].
#   2  the fused backend over P processes (scripts/gpu_fused_check.py:
#      eager, CUDA graphs, auto, too large, and the shape sweep at P = 2,
#      3 and 4) [300 s]; its lost peers (an absent and a killed peer: a
#      named timeout, never a hang) [45 s]; every other GPU-marked test that
#      needs no vLLM (health counters under CUDA-graph replay and in inference
#      mode, a training step through the kernels, the norm's division,
#      two-level Echo with 4 and 8 ranks as processes on the one GPU) [150 s];
#      `bench norm` (Echo + add + RMSNorm fused vs Echo then the norm, hidden
#      4096, T = 1k, 4k and 8k, P = 8, 4 and 2; verifies both first) [150 s].
#      Qwen3-8B's layer compute for the TTFT projection is measured apart
#      (`python3 -m echo_vllm.bench.layer_compute`).
#   3  the shape sweep through the fused backend at P = 8, alone (eight
#      processes on the one GPU) [530 s].
#   4  vLLM: the bundle unpacked (the parts stashed by runs 1, 5 and 2, and
#      its own) [90 s], then scripts/gpu_vllm_check.py (all phases) and
#      server/gpu_serve_check.sh (256 requests at 64 streams, malformed
#      requests, metrics) with the norm fusion on (--echo-fuse-norm: the
#      check requires fused calls in /metrics; vllm_check serves the
#      default path), side by side on the one GPU [440 s each].
#   6  the rest of tests/kernels (the fused kernel's phases, the norm
#      kernels, two-level on the Triton stages, layouts) [540 s]: with both
#      encoders and rotation seeds the kernel tests no longer fit one call.
#   5  `bench fused` at P = 8, 64 MiB [240 s] against the floor in
#      echo_vllm/bench/fused_floor.json (fails if > 10% slower, scaled by the
#      device's copy bandwidth; it verifies the kernel first) [10 s], alone.
# Bundle: .gpu-bundle/ holds the parts this run carries (bundle.part.NN: the
# wheelhouse's build.sh output split in 4, their SHA256SUMS, and install.py
# from ../shared/gpu-wheelhouse: `bash scripts/gpu_bundle.sh` makes it); each
# run stashes what it finds in $STASH (default /tmp/echo-accept/parts: the
# host keeps it while it stays warm between back-to-back runs).
# A host lost between runs loses the stash with it: `gpu_accept.sh stash`
# only stashes the part it carries (seconds), so calls carrying the missing
# parts, back to back on the fresh host, let run 4 go ahead without
# repeating runs 1-3. $BUNDLE names the folder of parts (default .gpu-bundle).
# Output: $OUT/accept_summary.txt (this run's lines, also appended to
# $STASH/../summary.txt and printed last), one log per step in $OUT, archived
# with every other small file as $OUT/accept_logs_runN.tgz.
# Exit status: 0 when every step of the run passed.
case "${1:-}" in -h|--help|"") sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
RUN=$1
case "$RUN" in 1|2|3|4|5|6|stash) ;; *) echo "gpu_accept.sh: RUN must be 1, 2, 3, 4, 5, 6 or stash, got '$RUN'" >&2; exit 2 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d /tmp/echo-accept.XXXXXX)}
mkdir -p "$OUT"
# the run ends by deleting every file in $OUT but the summary and the log archives: OUT=$HOME (or
# the repository, OUT=.) would lose everything in it, so a folder holding anything else is refused
# (-print -quit, not a pipe into grep -q: under pipefail find's SIGPIPE would let a full folder through)
if [ "$RUN" != stash ] && [ -n "$(find "$OUT" -mindepth 1 ! -name accept_summary.txt ! -name 'accept_logs_run*.tgz' \
    -print -quit)" ]; then
  echo "gpu_accept.sh: OUT=$OUT holds files of its own: the run ends by deleting every file in OUT but its" \
       "summary and log archives; give an empty or new folder" >&2
  exit 2
fi
PY=${PYTHON:-python3}
STASH=${STASH:-/tmp/echo-accept/parts}
BUNDLE=${BUNDLE:-.gpu-bundle}
mkdir -p "$STASH"
COMMIT=${ECHO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/step.sh
SUMMARY="$OUT/accept_summary.txt"

# the bundle part(s) this run carried, kept for run 4
cp -f "$BUNDLE"/bundle.part.* "$BUNDLE"/SHA256SUMS "$BUNDLE"/install.py "$STASH"/ 2>/dev/null
echo "stashed bundle parts: $(cd "$STASH" && ls bundle.part.* 2>/dev/null | tr '\n' ' ')"
[ "$RUN" = stash ] && exit 0

if [ "$RUN" = 1 ]; then
  # compile-bound: pytest-xdist spreads the compilations over the host's cores
  step kernel_tests 540 "$PY" -m pytest -q -p no:cacheprovider -n 14 tests/kernels/test_kernels.py \
    tests/kernels/test_shape_sweep.py -k "not test_gpu_check" --tb=line --durations=30
elif [ "$RUN" = 6 ]; then
  step kernel_tests_rest 540 "$PY" -m pytest -q -p no:cacheprovider -n 14 tests/kernels \
    --ignore=tests/kernels/test_kernels.py --ignore=tests/kernels/test_shape_sweep.py --tb=line --durations=30
elif [ "$RUN" = 2 ]; then
  step fused_check 300 "$PY" scripts/gpu_fused_check.py --worlds 2,4 --sweep-worlds 2,3,4 --skip-lost-peer \
    --json "$OUT/fused_check.json"
  # the fused backend's absent and killed peers
  step lost_peers 45 "$PY" scripts/gpu_fused_check.py --worlds "" --json "$OUT/lost_peers.json"
  step gpu_tests 150 "$PY" -m pytest -q -p no:cacheprovider -n 4 -m gpu tests/core tests/training tests/bench \
    tests/eval --tb=line
  # 9 cases, each verified bit for bit and timed in one pass and in two
  step bench_norm 150 "$PY" -m echo_vllm.cli bench norm --world-sizes 8,4,2 --tokens 1024,4096,8192 \
    --out "$OUT/norm"
elif [ "$RUN" = 5 ]; then
  # alone: a time measured beside other work would judge the kernel by the neighbours' load
  step bench_fused 240 "$PY" -m echo_vllm.bench.fused_bench --world-sizes 8 --sizes 64M --no-stages \
    --out "$OUT/bench"
  step fused_floor 10 "$PY" -m echo_vllm.bench.floor "$OUT/bench/fused.json"
elif [ "$RUN" = 3 ]; then
  # its own run: beside run 2's checks it does not fit one call; the sweep's own deadline (500 s)
  # names the late ranks before the step's limit kills them
  step fused_sweep_p8 530 "$PY" scripts/gpu_fused_check.py --worlds "" --sweep-worlds 8 --skip-lost-peer \
    --json "$OUT/fused_sweep_p8.json"
else
  [ -f "$STASH/install.py" ] || echo "no install.py in $STASH: carry ../shared/gpu-wheelhouse/install.py in .gpu-bundle" >&2
  step bundle 90 "$PY" "$STASH/install.py" /tmp/echo-accept/site "$STASH"
  export PYTHONPATH="/tmp/echo-accept/site:$PYTHONPATH"
  mkdir -p "$OUT/vllm" "$OUT/serve"
  # side by side: the vLLM check runs two engines at a time (the eager phase's cold start beside the
  # graph phases), the serve check one more; each holds a fixed 1 GiB KV cache, so no start-up measures
  # free memory that another engine's start or exit moves (vLLM fails the start-up when it does)
  ( step vllm_check 440 "$PY" scripts/gpu_vllm_check.py --out "$OUT/vllm" --budget-s 420 --parallel 2 \
      --gpu-memory-utilization 0.25
    printf '%s\n' "${status[-1]}" > "$OUT/.vllm_status" ) &  # its own line only: the bundle's is counted here
  vllm_pid=$!
  step serve_check 440 env OUT="$OUT/serve" SERVE_EXTRA=--echo-fuse-norm bash server/gpu_serve_check.sh
  wait $vllm_pid
  [ -f "$OUT/.vllm_status" ] && mapfile -t -O "${#status[@]}" status < "$OUT/.vllm_status"
fi

{
  echo "GPU acceptance run $RUN, commit $COMMIT, $(date -u +%Y-%m-%dT%H:%MZ), $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  for s in "${status[@]}"; do
    rc=$(sed -n 's/.* rc=\([0-9]*\).*/\1/p' <<<"$s")
    [ "$rc" = 0 ] && echo "  PASS $s" || echo "  FAIL $s"
  done
} > "$SUMMARY"
cat "$SUMMARY" >> "$STASH/../summary.txt"
# the device tool brings back at most 8 files of 16 MiB: every file under 2 MB in one archive (model
# weights and saved logits stay behind, listed in left_behind.txt), the summary beside it
(cd "$OUT" && find . -type f -size +2M > left_behind.txt
  find . -type f -size -2M ! -name accept_summary.txt ! -name 'accept_logs_run*.tgz' -print0 |
  tar czf "accept_logs_run$RUN.tgz" --null -T - && find . -mindepth 1 ! -name accept_summary.txt \
  ! -name 'accept_logs_run*.tgz' -delete)
echo "=== summary"
cat "$SUMMARY"
! grep -q "  FAIL" "$SUMMARY"
