#!/usr/bin/env bash
# Echo for tensor-parallel training on ONE GPU (issue 14): a Qwen3-architecture
# model of tens of millions of parameters trained from scratch three times --
# exact 16-bit, naive 4-bit, Echo all-reduces -- at emulated TP=4, the three
# runs concurrently (same seed, same data order), then the report.
#
# Needs: torch with CUDA, triton, numpy, matplotlib, tqdm (no vLLM, no network).
#
#   DATA_DIR=train-data OUT=/tmp/train bash scripts/gpu_train.sh
#
# DATA_DIR: the prepared corpus (train.txt.gz, val.txt.gz, corpus.json;
# ~4.5 MB), built on a machine with PyPI access by
#     echo-vllm train-demo --prepare-data train-data
# and copied into the repository checkout (the default DATA_DIR is
# ./train-data). BUDGET_S: training seconds per run (default 300); a short
# concurrent calibration sizes the number of steps so that the three runs
# finish in about BUDGET_S + 1-2 minutes of start-up, evaluation and report.
#
# $OUT receives (flat, 7 files): train_table.md (final train/validation loss,
# gap to exact in %, tokens/s, step time split into compute and the
# all-reduces' kernels), train_results.json (all runs with their curves),
# train_loss.png, train_{exact,naive,echo}.log, train_env.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${OUT:?set OUT to the output folder}"
DATA_DIR=${DATA_DIR:-train-data}
BUDGET_S=${BUDGET_S:-300}
CAL_STEPS=${CAL_STEPS:-25}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODES=(exact naive echo)
EXTRA=("$@")  # passed to every run, e.g. --bwd-first-exact-calls 1

if [ ! -f "$DATA_DIR/corpus.json" ]; then
  echo "gpu_train: no corpus in $DATA_DIR (run: echo-vllm train-demo --prepare-data $DATA_DIR, then copy it here)" >&2
  exit 2
fi
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/echo-train.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" || true
  git rev-parse HEAD 2>/dev/null || true
  echo "BUDGET_S=$BUDGET_S CAL_STEPS=$CAL_STEPS extra: ${EXTRA[*]:-}"
} > "$OUT/train_env.txt" 2>&1

run_all() {  # $1 = folder for the runs' JSON, $2 = log prefix, rest = train-demo flags
  local dir=$1 logs=$2; shift 2
  local pids=()
  for m in "${MODES[@]}"; do
    $PY -m echo_vllm.cli train-demo --preset gpu --data "$DATA_DIR" --modes "$m" --no-report \
      --out "$dir" "$@" ${EXTRA[@]+"${EXTRA[@]}"} > "${logs}_$m.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [ $rc -ne 0 ]; then
    for m in "${MODES[@]}"; do echo "== ${logs}_$m.log"; tail -n 30 "${logs}_$m.log"; done >&2
    exit 1
  fi
}

echo "gpu_train: calibrating ($CAL_STEPS steps, three runs at once)" >&2
run_all "$WORK/cal" "$WORK/cal" --steps "$CAL_STEPS" --eval-every 0 --final-eval-windows 32 --no-progress
STEPS=$($PY - "$WORK/cal" "$BUDGET_S" <<'EOF'
import json, pathlib, sys
runs = [json.loads(p.read_text()) for p in pathlib.Path(sys.argv[1]).glob("train_*.json")]
step_s = max(r["timing"]["step_s"] for r in runs)  # the slowest mode sets the pace
steps = int(0.9 * float(sys.argv[2]) / step_s) // 50 * 50
print(max(steps, 100))
EOF
)
echo "gpu_train: $STEPS steps per run" >&2
echo "steps: $STEPS (calibration: slowest mode's step time)" >> "$OUT/train_env.txt"

run_all "$WORK/runs" "$OUT/train" --steps "$STEPS" --max-time-s $((BUDGET_S * 3 / 2))
$PY -m echo_vllm.cli train-demo --report "$WORK/runs" --out "$OUT"
