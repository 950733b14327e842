#!/usr/bin/env bash
# Echo for tensor-parallel training on ONE GPU: a Qwen3-architecture
# model of tens of millions of parameters trained from scratch three times --
# exact 16-bit, naive 4-bit, Echo all-reduces -- at emulated TP=4, the three
# runs concurrently (same seed, same data order), then the report.
#
# Needs: torch with CUDA and triton (no vLLM, no network); tqdm and matplotlib if
# present (without them: plain progress lines, no PNG).
#
#   DATA_DIR=train-data OUT=/tmp/train bash scripts/gpu_train.sh [train-demo flags]
#
# DATA_DIR: the prepared corpus (train.txt.gz, val.txt.gz, corpus.json;
# ~4.5 MB), built on a machine with PyPI access by
#     echo-vllm train-demo --prepare-data train-data
# and copied into the repository checkout (the default DATA_DIR is
# ./train-data). BUDGET_S: seconds of training for the three concurrent runs
# (default 300). Before them each mode runs alone for CAL_STEPS steps (its
# uncontended step time, which also sizes the runs: ~1.5 minutes); the whole
# script takes about BUDGET_S + 2 minutes. Extra arguments go to every run
# (e.g. --bwd-first-exact-calls 0).
#
# $OUT receives (flat, 8 files): train_table.md (final train/validation loss,
# gap to exact in %, tokens/s and step time of the concurrent runs),
# train_timing_solo.md (each mode alone: tokens/s, step time split into
# compute and the all-reduces' kernels), train_results.json (all runs with
# their curves), train_loss.png, train_{exact,naive,echo}.log, train_env.txt.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."

: "${OUT:?set OUT to the output folder}"
DATA_DIR=${DATA_DIR:-train-data}
BUDGET_S=${BUDGET_S:-300}
CAL_STEPS=${CAL_STEPS:-25}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODES=(exact naive echo)
EXTRA=("$@")

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

demo() {  # one train-demo run of the gpu preset; the extra arguments last (they win)
  $PY -m echo_vllm.cli train-demo --preset gpu --data "$DATA_DIR" --no-report "$@" ${EXTRA[@]+"${EXTRA[@]}"}
}

# 1. each mode alone for CAL_STEPS steps (step 0, with its one-off costs, is not timed)
echo "gpu_train: timing each mode alone ($CAL_STEPS steps)" >&2
for m in "${MODES[@]}"; do
  demo --modes "$m" --out "$WORK/solo" --steps "$CAL_STEPS" --eval-every 0 --final-eval-windows 32 \
    --no-progress > "$WORK/solo_$m.log" 2>&1 || { tail -n 30 "$WORK/solo_$m.log" >&2; exit 1; }
done
$PY -m echo_vllm.cli train-demo --report "$WORK/solo" --out "$WORK/solo_report" > /dev/null
{
  echo "Each mode alone on the GPU for $CAL_STEPS steps: tokens/s and the step time split into compute and"
  echo "the residual all-reduces' kernels (CUDA events). Loss columns: $CAL_STEPS steps only, not comparable."
  echo
  cat "$WORK/solo_report/train_table.md"
} > "$OUT/train_timing_solo.md"

# the three runs share the GPU (time-sliced): size them for the sum of the solo step times
STEPS=$($PY -c '
import json, pathlib, sys
runs = [json.loads(p.read_text()) for p in pathlib.Path(sys.argv[1]).glob("train_*.json")]
step_s = sum(r["timing"]["step_s"] for r in runs)
print(max(int(0.9 * float(sys.argv[2]) / step_s) // 50 * 50, 100))
' "$WORK/solo" "$BUDGET_S")
echo "gpu_train: $STEPS steps per run, the three at once" >&2
echo "steps: $STEPS (from the solo step times)" >> "$OUT/train_env.txt"

# 2. the three runs concurrently
pids=()
for m in "${MODES[@]}"; do
  demo --modes "$m" --out "$WORK/runs" --steps "$STEPS" --max-time-s $((BUDGET_S * 3 / 2)) \
    > "$OUT/train_$m.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if [ $rc -ne 0 ]; then
  for m in "${MODES[@]}"; do echo "== train_$m.log"; tail -n 30 "$OUT/train_$m.log"; done >&2
  exit 1
fi

# 3. the report (also printed)
$PY -m echo_vllm.cli train-demo --report "$WORK/runs" --out "$OUT"
