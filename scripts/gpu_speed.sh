#!/usr/bin/env bash
# Speed on one GPU host, one command: kernel tests, the fused kernel against
# its memory roofline (bench fused), the stage-kernel table next to an old
# package's (OLD), and the all-reduce over a real bandwidth-bound link (P
# processes on the one GPU, Echo's kernels on the GPU, bytes over gloo/TCP)
# against the 16-bit all-reduce over the same link.
#
#   OUT=/tmp/s bash scripts/gpu_speed.sh            # OLD=.bench_old: a checkout of the old package
#
# Budget: ~9 minutes on one H200 (step limits below). Installs nothing.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d /tmp/echo-speed-XXXX)}"
PY="${PYTHON:-python3}"
OLD="${OLD:-.bench_old}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET ECHO_KERNELS
STEP_TAIL=30
source scripts/step.sh

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc; \
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. the GPU-marked kernel tests: bit-exact at prefill sizes, row layout, batch invariance, graphs
step tests 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/kernels -rs -x

# 2. kernel table: new layout (rows of 4096) and the old package (flat), P=8, same sizes
SIZES=1M,16M,64M,256M,1G
step fused 150 "$PY" -m echo_vllm.cli bench fused --world-sizes 8,2,4 --sizes 64M,1G --out "$OUT/fused"
step kernels_new 110 "$PY" -m echo_vllm.cli bench kernels --world-sizes 8 --sizes "$SIZES" --iters 10 \
  --hidden 4096 --out "$OUT/kernels_new"
if [ -d "$OLD/echo_vllm" ]; then
  step kernels_old 110 env PYTHONPATH="$PWD/$OLD" "$PY" -m echo_vllm.cli bench kernels --world-sizes 8 \
    --sizes "$SIZES" --iters 10 --no-layout-compare --out "$OUT/kernels_old"
fi

# 3. a real bandwidth-bound link: P processes on this GPU, gloo over TCP
for P in 2 4; do
  step "gloo_p$P" 110 "$PY" -m echo_vllm.cli bench allreduce --backend gloo --device cuda --world-size "$P" \
    --sizes 1M,4M,16M,64M,256M,1G --iters 3 --warmup 1 --out "$OUT/gloo"
done

echo
echo "=================== summary ($OUT) ==================="
printf '%s\n' "${status[@]}"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 2
echo "--- fused kernel vs roofline:"; grep -E "^ [248] +[0-9]+ [MG]iB \|" "$OUT/fused.log" || true
for k in new old; do
  echo "--- kernels ($k), P=8, % of copy:"; grep -E "^ 8 +[0-9]+ [MG]iB" "$OUT/kernels_$k.log" | head -n 5 || true
done
for P in 2 4; do echo "--- gloo P=$P:"; grep -E "^ +[0-9]+ [MG]iB \|" "$OUT/gloo_p$P.log" || true; done
