#!/usr/bin/env bash
# GPU-host check of `echo-vllm serve --tp-comm echo` (CI has no GPU), ~5-8 minutes
# on one H200:
#   1. build a tiny random-weight Qwen3 (echo_vllm.testing_models),
#   2. start `echo-vllm serve` with Echo on in one-GPU emulation of TP=4,
#   3. /v1/completions, /v1/chat/completions, malformed requests (4xx, and
#      the server keeps serving), /metrics before/after,
#   4. load: vLLM's own `vllm bench serve`, streaming chat completions,
#      random prompt lengths, 64 concurrent streams,
#   5. /metrics again: Echo's counters must have moved, and with the norm
#      fusion asked for under compilation (--echo-fuse-norm in SERVE_EXTRA,
#      no --enforce-eager) calls must have run the norm fused into Echo
#      (echo:norm_calls_total{how="fused"}),
#   6. a short summary, last.
#
# Usage (repository root):  OUT=/some/dir bash server/gpu_serve_check.sh
# Knobs (environment): PORT=8765 EMULATE_TP=4 (TP=N: real tensor parallelism on N GPUs
#   instead) NUM_PROMPTS=256 CONCURRENCY=64
#   INPUT_LEN=256 OUTPUT_LEN=64 HEALTH_TIMEOUT=420 PYTHON=python3
#   SERVE_EXTRA="..."  extra `echo-vllm serve` flags; default none, i.e. vLLM's
#       default torch.compile + CUDA graphs. "--enforce-eager --echo-emulate-measure"
#       also fills the error metrics (the emulation measures in eager mode only).
# Everything it produces lands in $OUT (server.log, probe.json, bench.json,
# metrics_*.txt, summary.json/.txt). Exit status 0 = every check passed.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$(mktemp -d /tmp/echo-serve-check.XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-$(command -v python3 || command -v python)}
PORT=${PORT:-8765}
EMULATE_TP=${EMULATE_TP:-4}
NUM_PROMPTS=${NUM_PROMPTS:-256}
CONCURRENCY=${CONCURRENCY:-64}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-64}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-420}
SERVE_EXTRA=${SERVE_EXTRA:-}
BASE=http://127.0.0.1:$PORT
WORK=$(mktemp -d /tmp/echo-serve-work.XXXXXX)
SERVER_PID=
T0=$(date +%s)

log() { echo "[gpu_serve_check +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }

stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID" 2>/dev/null
  fi
  SERVER_PID=
}
trap 'stop_server; rm -rf "$WORK"' EXIT

# -- 0. echo-vllm importable from this checkout, and visible to vLLM as a
#       plugin (entry point) without pip or network: a dist-info next to it.
source server/entry_points.sh
register_entry_points "$WORK/site" || { echo "cannot register the echo-vllm entry points"; exit 1; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import sys, torch, vllm; print('python', sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__)"
  git -C "$REPO" rev-parse --short HEAD 2>/dev/null
} > "$OUT/env.txt" 2>&1
log "env: $(tr '\n' ' ' < "$OUT/env.txt")"

# -- 1. tiny model (random weights, local tokenizer with a chat template)
MODEL_DIR=$WORK/tiny-qwen3
if ! "$PY" -c "
from echo_vllm.testing_models import make_tiny_qwen3
print(make_tiny_qwen3('$MODEL_DIR'))" > "$OUT/tiny_model.log" 2>&1; then
  log "FAIL: building the tiny model"; tail -20 "$OUT/tiny_model.log"; exit 1
fi
MODEL_DIR=$(tail -1 "$OUT/tiny_model.log")
log "tiny model at $MODEL_DIR"

# -- 2. server: Echo on every all-reduce (--echo-min-bytes 0), emulated TP; a fixed 1 GiB KV cache
# (64 streams x 1024 tokens need 128 MiB) skips vLLM's free-memory profile, which fails when another
# process on the GPU frees memory meanwhile (the vLLM check beside it in gpu_accept.sh's run 4)
# TP=N (N >= 2 GPUs) serves with real tensor parallelism instead of the emulation
if [ "${TP:-1}" -gt 1 ]; then PARALLEL=(-tp "$TP"); else PARALLEL=(--echo-emulate-tp "$EMULATE_TP"); fi
SERVE_CMD=("$PY" -m echo_vllm.cli serve "$MODEL_DIR" --served-model-name tiny
  --tp-comm echo "${PARALLEL[@]}" --echo-min-bytes 0
  --host 127.0.0.1 --port "$PORT" --gpu-memory-utilization 0.3 --kv-cache-memory-bytes 1073741824
  --max-model-len 1024 --max-num-seqs "$CONCURRENCY" $SERVE_EXTRA)
echo "${SERVE_CMD[*]}" > "$OUT/serve_command.txt"
log "starting: ${SERVE_CMD[*]}"
"${SERVE_CMD[@]}" > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
if ! "$PY" -m echo_vllm.server.probe wait --base-url "$BASE" --timeout "$HEALTH_TIMEOUT" \
     --pid "$SERVER_PID" 2>&1 | tee -a "$OUT/steps.log"; then
  log "FAIL: server not healthy; last log lines:"; tail -40 "$OUT/server.log"; exit 1
fi

# -- 3. requests, malformed requests, metrics before/after
"$PY" -m echo_vllm.server.probe probe --base-url "$BASE" --model tiny --out "$OUT" 2>&1 | tee -a "$OUT/steps.log"

# -- 4. load: vLLM's benchmark client, streaming chat, 64 concurrent streams
log "load test: $NUM_PROMPTS chat requests, concurrency $CONCURRENCY"
timeout 300 "$PY" -m vllm.entrypoints.cli.main bench serve \
  --backend openai-chat --endpoint /v1/chat/completions --base-url "$BASE" \
  --model tiny --tokenizer "$MODEL_DIR" \
  --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
  --random-range-ratio 0.5 --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" \
  --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
  --save-result --result-dir "$OUT" --result-filename bench.json --disable-tqdm \
  > "$OUT/bench.log" 2>&1
log "load test exit status $? (log: bench.log)"

# -- 5./6. final scrape and summary (summary prints last); the norm fusion
#    pass runs where it is asked for and vLLM compiles
case " $SERVE_EXTRA " in
  *" --enforce-eager "*|*" --no-echo-fuse-norm "*) EXPECT_NORM=() ;;
  *" --echo-fuse-norm "*) EXPECT_NORM=(--expect-fused-norm) ;;
  *) EXPECT_NORM=() ;;
esac
"$PY" -m echo_vllm.server.probe summary --base-url "$BASE" --out "$OUT" --bench "$OUT/bench.json" \
  ${EXPECT_NORM[@]+"${EXPECT_NORM[@]}"} > "$OUT/summary.txt" 2>&1
STATUS=$?
stop_server
grep -iE "echo|error|traceback" "$OUT/server.log" | grep -v "GET /metrics\|POST /v1" | tail -15 > "$OUT/server_echo_lines.txt"
log "done in $(( $(date +%s) - T0 )) s; outputs in $OUT"
echo "==== server log lines about echo / errors (last 15) ===="
cat "$OUT/server_echo_lines.txt"
echo "==== summary ($( [ $STATUS -eq 0 ] && echo PASS || echo FAIL )) ===="
cat "$OUT/summary.txt"
exit $STATUS
