#!/usr/bin/env bash
# Echo's Triton kernels on a GPU host: bit-exact tests, kernel benchmark,
# projection, all-reduce benchmark. Run from the repository root; installs
# nothing (torch + triton + pytest must be importable; vLLM is not needed).
#
#   OUT=/tmp/echo-gpu bash scripts/gpu_kernels.sh
#
# Writes logs, JSON and PNGs under $OUT and prints a short summary last.
# Budget: at most ~10 minutes on one H200 (step timeouts 220 + 240 + 150 s; the one-GPU run
# skips the multi-GPU step).
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d /tmp/echo-gpu-XXXX)}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET ECHO_KERNELS
STEP_TAIL=40
source scripts/step.sh

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. bit-exact kernel tests: small awkward shapes, large shapes, CUDA-graph replay
step tests 220 "$PY" -m pytest -q -p no:cacheprovider tests/kernels -rs \
  --junitxml="$OUT/tests.xml"

# 2. every kernel, P = 4 and 8, 8 KiB .. 1 GiB, device time (graph replay)
#    and eager call time (host launch included), and the projection
step bench_kernels 240 "$PY" -m echo_vllm.cli bench kernels --world-sizes 4,8 \
  --min-size 8K --max-size 1G --iters 20 --timing both --out "$OUT/kernels"

# 3. the all-reduce benchmark: NCCL under torchrun when several GPUs are
#    visible, otherwise its one-GPU form (the kernel table) on a few sizes
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ]; then
  step bench_allreduce 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
    -m echo_vllm.cli bench allreduce --backend nccl --min-size 8K --max-size 1G --out "$OUT/allreduce"
else
  step bench_allreduce 50 "$PY" -m echo_vllm.cli bench allreduce --sizes 1M,64M,1G --out "$OUT/allreduce"
fi

echo
echo "=================== summary ($OUT) ==================="
printf '%s\n' "${status[@]}"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 2
echo "--- kernels at >= 64 MiB (% of copy bandwidth), P=8:"
grep -E "^ 8 +(64 MiB|256 MiB|1 GiB)" "$OUT/bench_kernels.log" || true
grep -E "copy bandwidth" "$OUT/bench_kernels.log" || true
echo "--- projection at 1 GiB:"
grep -E "1 GiB" "$OUT/bench_kernels.log" | grep -E "busbw" || true
echo "--- eager call time / device time, P=8 (us):"
grep -A40 "^Eager call time" "$OUT/bench_kernels.log" | grep -E "^ 8 +(1 MiB|16 MiB|64 MiB|1 GiB)" || true
echo "--- thread layouts (% of copy):"
grep -A6 "^thread layouts" "$OUT/bench_kernels.log" | tail -n +2 || true
