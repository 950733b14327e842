#!/usr/bin/env bash
# The measurements one GPU cannot make (a real link between GPUs), one command:
# run it the moment a multi-GPU machine is lent (nvidia-h200-x2 / -x4 / -x8).
#
#   OUT=/tmp/m bash scripts/gpu_multi.sh
#
# 1. the fused backend's correctness with one rank per GPU (P2P, no overlap);
# 2. nccl-tests-style table: NCCL bf16 vs Echo (auto = fused here) vs Echo on
#    the composed Triton path vs the fused one, 8 KiB .. 1 GiB, P = all GPUs;
# 3. the same through the host (NCCL_P2P_DISABLE=1, the PCIe-class link;
#    the fused backend needs P2P, so composed only);
# 4. with 4 GPUs or more, two-level Echo with the GPUs told they sit on two
#    hosts (--host-map): its ranks against the reference bit for bit over NCCL
#    (tests/core/test_two_level.py, -m gpu), then the table with the bytes
#    each host sends inside and out of itself.
# Needs torch + Triton (no vLLM). Real-TP TTFT and the real-model TP=2 vs
# emulation run need vLLM: `REAL_TP=2 MODEL=qwen2.5-coder-1.5b eval/gpu_eval.sh ttft`
# after its setup steps (eval/gpu_eval.sh). Budget: ~9 minutes.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d /tmp/echo-multi-XXXX)}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "${NGPU:-0}" -lt 2 ]; then echo "gpu_multi: $NGPU GPU(s) visible; this needs at least 2" >&2; exit 2; fi
STEP_TAIL=25
source scripts/step.sh
{ nvidia-smi; nvidia-smi topo -m; } > "$OUT/topology.txt" 2>&1
step fused_check 200 "$PY" scripts/gpu_fused_check.py --gpus "$NGPU" --worlds "$NGPU" --json "$OUT/fused_check.json"
step nccl 200 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m echo_vllm.cli bench allreduce \
  --backend nccl --min-size 8K --max-size 1G --factor 4 --echo-backends triton,fused --out "$OUT/nccl"
step nccl_no_p2p 150 env NCCL_P2P_DISABLE=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" \
  -m echo_vllm.cli bench allreduce --backend nccl --min-size 64K --max-size 1G --factor 4 --echo-backends triton \
  --out "$OUT/nccl_no_p2p"
if [ "$NGPU" -ge 4 ]; then
  HOSTS=$("$PY" -c "import sys; n = int(sys.argv[1]); print(','.join(str(2 * r // n) for r in range(n)))" "$NGPU")
  step two_level_check 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/core/test_two_level.py
  step two_level 200 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m echo_vllm.cli bench \
    allreduce --backend nccl --min-size 64K --max-size 1G --factor 4 --host-map "$HOSTS" --out "$OUT/two_level"
fi
echo; echo "=================== summary ($OUT) ==================="
printf '%s\n' "${status[@]}"
grep -E '"ok"' "$OUT/fused_check.json" | tail -n 1 || true
for s in nccl nccl_no_p2p two_level; do echo "--- $s:"; grep -E "^ +[0-9]+ [KMG]iB \|" "$OUT/$s.log" || true; done
