#!/usr/bin/env bash
# GPU-host check of Echo across two hosts under vLLM's multi-node launch, on
# ONE machine of 4 GPUs (nvidia-h100-x4), ~6-10 minutes. CI has no GPU.
#
# Two "hosts" of 2 GPUs each: each node's processes run in a mount namespace
# of their own with their own /dev/shm (vLLM's node test, shared memory,
# sees two nodes, as on two machines) and their own NCCL_HOSTID (NCCL sees
# two hosts: its NET transport, sockets, between them; P2P/NVLink inside
# each). Then, as docs/multi-node.md tells a user (needs root: unshare, mount):
#   node 1: echo-vllm serve MODEL --tp-comm echo -tp 4 --nnodes 2 --node-rank 1
#             --master-addr 127.0.0.1 --master-port P --headless
#   node 0: echo-vllm serve MODEL --tp-comm echo -tp 4 --nnodes 2 --node-rank 0
#             --master-addr 127.0.0.1 --master-port P --port PORT
# with vLLM's default torch.compile + CUDA graphs (FULL_AND_PIECEWISE): the
# TP group's pynccl and the two-level sub-groups' NCCL calls are captured.
# Checks (server/probe.py and this script), all on node 0's /metrics and both
# nodes' logs:
#   1. both nodes log "two_level topology on tp:0 (2 hosts x 2 ranks)";
#   2. requests answer (probe), and a short load (vllm bench serve) completes;
#   3. echo:topology{topology="two_level"} for node 0's ranks 0 and 1;
#      echo:level_bytes_total{level="cross_host"} > 0 (bytes crossed the hosts);
#   4. echo:forwards_total{kind="replayed"} > 0: Echo's calls were captured
#      into CUDA graphs and replayed (counted from the captured plans);
#   5. no echo:nonfinite_total.
#
# Usage (repository root):  OUT=/some/dir bash server/gpu_multinode_check.sh
# Knobs (environment): PORT=8766 NUM_PROMPTS=64 CONCURRENCY=16 HEALTH_TIMEOUT=600
#   PYTHON=python3  SERVE_EXTRA="..." (extra flags for both nodes, e.g.
#   "--enforce-eager" for the eager baseline, "--echo-topology flat").
# Everything lands in $OUT (node0.log, node1.log, probe.json, bench.json,
# metrics_*.txt, summary.txt, checks.txt). Exit status 0 = every check passed.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$(mktemp -d /tmp/echo-multinode-check.XXXXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-$(command -v python3 || command -v python)}
PORT=${PORT:-8766}
NUM_PROMPTS=${NUM_PROMPTS:-64}
CONCURRENCY=${CONCURRENCY:-16}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
SERVE_EXTRA=${SERVE_EXTRA:-}
BASE=http://127.0.0.1:$PORT
WORK=$(mktemp -d /tmp/echo-multinode-work.XXXXXX)
PIDS=()
T0=$(date +%s)

log() { echo "[gpu_multinode_check +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }

stop_nodes() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done  # each node leads its own session
  for _ in $(seq 30); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
  PIDS=()
}
trap 'stop_nodes; rm -rf "$WORK"' EXIT

NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "${NGPU:-0}" -lt 4 ]; then echo "gpu_multinode_check: $NGPU GPU(s) visible; this needs 4 (two hosts of 2)" >&2; exit 2; fi
if [ "$(id -u)" != 0 ]; then echo "gpu_multinode_check: needs root (a mount namespace per host)" >&2; exit 2; fi

source server/entry_points.sh
register_entry_points "$WORK/site" || { echo "cannot register the echo-vllm entry points"; exit 1; }
{ nvidia-smi topo -m; "$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
  git -C "$REPO" rev-parse --short HEAD 2>/dev/null; } > "$OUT/env.txt" 2>&1

MODEL_DIR=$("$PY" -c "from echo_vllm.testing_models import make_tiny_qwen3; print(make_tiny_qwen3('$WORK/tiny-qwen3'))" \
  2> "$OUT/tiny_model.log" | tail -1) || { log "FAIL: building the tiny model"; exit 1; }
MASTER_PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
COMMON=("$MODEL_DIR" --served-model-name tiny --tp-comm echo --echo-min-bytes 0 -tp 4 --nnodes 2
  --master-addr 127.0.0.1 --master-port "$MASTER_PORT" --gpu-memory-utilization 0.3
  --kv-cache-memory-bytes 1073741824 --max-model-len 1024 --max-num-seqs "$CONCURRENCY" $SERVE_EXTRA)

# node RANK GPUS ARGS...: a host of its own (mount namespace, /dev/shm, NCCL host id), in its own session
node() {
  local rank=$1 gpus=$2; shift 2
  mkdir -p "$WORK/shm$rank"
  setsid env CUDA_VISIBLE_DEVICES="$gpus" NCCL_HOSTID="echo-node$rank" \
    unshare --mount --propagation private sh -c 'mount --bind "$0" /dev/shm && exec "$@"' "$WORK/shm$rank" \
    "$PY" -m echo_vllm.cli serve "${COMMON[@]}" --node-rank "$rank" "$@" > "$OUT/node$rank.log" 2>&1 &
  PIDS+=($!)
}
log "node 1 (GPUs 2,3, headless) and node 0 (GPUs 0,1, API on $PORT): echo-vllm serve ${COMMON[*]}"
node 1 2,3 --headless
node 0 0,1 --host 127.0.0.1 --port "$PORT"
if ! "$PY" -m echo_vllm.server.probe wait --base-url "$BASE" --timeout "$HEALTH_TIMEOUT" --pid "${PIDS[1]}" \
     2>&1 | tee -a "$OUT/steps.log"; then
  log "FAIL: node 0 not healthy"; tail -40 "$OUT/node0.log"; tail -40 "$OUT/node1.log"; exit 1
fi
"$PY" -m echo_vllm.server.probe probe --base-url "$BASE" --model tiny --out "$OUT" 2>&1 | tee -a "$OUT/steps.log"
timeout 300 "$PY" -m vllm.entrypoints.cli.main bench serve --backend openai-chat --endpoint /v1/chat/completions \
  --base-url "$BASE" --model tiny --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len 256 \
  --random-output-len 64 --num-prompts "$NUM_PROMPTS" --max-concurrency "$CONCURRENCY" --ignore-eos --seed 0 \
  --save-result --result-dir "$OUT" --result-filename bench.json --disable-tqdm > "$OUT/bench.log" 2>&1
"$PY" -m echo_vllm.server.probe summary --base-url "$BASE" --out "$OUT" --bench "$OUT/bench.json" > "$OUT/summary.txt" 2>&1
STATUS=$?
cat "$OUT/summary.txt"

# the checks only this launch has: both hosts two-level, bytes across hosts, CUDA-graph replays
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/checks.txt"
import pathlib, sys
from echo_vllm.server.probe import echo_samples, total
out = pathlib.Path(sys.argv[1])
s = echo_samples((out / "metrics_final.txt").read_text())
checks = [(f"node {n} log: two_level topology (2 hosts x 2 ranks)",
           "two_level topology on tp:0 (2 hosts x 2 ranks)" in (out / f"node{n}.log").read_text()) for n in (0, 1)]
checks += [
    ("echo:topology two_level on ranks 0 and 1", total(s, "echo:topology", topology="two_level") == 2),
    ("echo:level_bytes_total{level=cross_host} > 0", total(s, "echo:level_bytes_total", level="cross_host") > 0),
    ("echo:forwards_total{kind=replayed} > 0 (CUDA graphs)", total(s, "echo:forwards_total", kind="replayed") > 0),
    ("no echo:nonfinite_total", total(s, "echo:nonfinite_total") == 0),
]
for name, ok in checks:
    print(f"[{'PASS' if ok else 'FAIL'}] {name}")
sys.exit(0 if all(ok for _, ok in checks) else 1)
PYEOF
CHECKS=$?
stop_nodes
log "done in $(( $(date +%s) - T0 )) s; outputs in $OUT"
[ "$STATUS" = 0 ] && [ "$CHECKS" = 0 ]
