#!/usr/bin/env bash
# GPU-host evaluation: lm-eval's vLLM backend (SmolLM2-135M at emulated TP=3, the others TP=4) on
# one GPU, exact vs naive 4-bit vs Echo, the seven benchmarks from local data.
# The host has no internet: everything arrives as bundle parts (<= 56 MiB each).
#
# Prepared on a machine with registry access (repo root):
#   bash ../shared/gpu-wheelhouse/build.sh .gpu-bundle 56 eval/gpu_eval_pins.txt   # vLLM + lm-eval
#   .venv/bin/echo-vllm eval bundle --models smollm2-135m --out .gpu-bundle/echo      # model + data
#
# On the GPU host, from the repo root (state lives in $ECHO_GPU_STATE, default
# /tmp/echo-gpu, outside the transferred tree; it survives while the machine is warm):
#   eval/gpu_eval.sh stash DIR KIND        # copy DIR/bundle.part.* (+SHA256SUMS) aside; KIND = vllm, or
#                                             # a name per cache bundle (echo, echo-gemma3, echo-qwen)
#   eval/gpu_eval.sh setup                 # unpack the bundles, register the plugin entry point
#                                             # (MODELS="smollm2-135m gemma3-270m" checks each model)
#   eval/gpu_eval.sh run [LIMIT] [VARIANTS...]   # lm-eval, all variants in parallel on the GPU
#   eval/gpu_eval.sh ttft                  # TTFT/ITL, exact vs Echo, emulated TP servers
#   REAL_TP=2 MODEL=qwen2.5-coder-1.5b eval/gpu_eval.sh ttft   # real TP=2: nccl vs Echo
#   eval/gpu_eval.sh perplexity            # HF-backend perplexity table on the GPU (optional)
#   eval/gpu_eval.sh bg MODEL... [-- VARIANTS]  # `run` for each model in turn, in its own process
#                                             # session (outlives the call and its 10-minute limit);
#                                             # each waits until `setup` has verified its model
#   OUT=$OUT eval/gpu_eval.sh collect      # progress of `bg`, and its results as $OUT/bg.tgz
#   OUT=$OUT eval/gpu_eval.sh wait [S]     # keep the call in flight until the queue ends (or S s,
#                                             # default 540), then collect: a host with only
#                                             # background work counts as idle and goes back in 30 s
# Results (Markdown, JSON, PNG) go to $OUT/results when OUT is set.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${ECHO_GPU_STATE:-/tmp/echo-gpu}"
# The model and its emulated TP size (SmolLM2's 9 heads split 3 ways; the others 4):
#   MODEL=gemma3-270m TP=4 eval/gpu_eval.sh run none
MODEL="${MODEL:-smollm2-135m}"
case "$MODEL" in smollm2-135m) TP="${TP:-3}"; MODEL_STEM="" ;; *) TP="${TP:-4}"; MODEL_STEM="_$MODEL" ;; esac
PY="${PYTHON:-python3}"
mkdir -p "$STATE"

env_setup() {
  export PYTHONPATH="$STATE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export ECHO_VLLM_CACHE="$STATE/cache"
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export HF_DATASETS_CACHE="$STATE/hf_datasets" TOKENIZERS_PARALLELISM=false
}

copy_out() {
  if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && cp -r "$@" "$OUT"/; fi
}

cmd="${1:-}"; shift || true
case "$cmd" in
  stash)
    src="${1:?stash DIR KIND}"; kind="${2:?stash DIR KIND (vllm or a cache bundle name)}"
    mkdir -p "$STATE/parts-$kind"
    cp -v "$src"/bundle.part.* "$STATE/parts-$kind"/ 2>/dev/null || true
    [ -f "$src/SHA256SUMS" ] && cp -v "$src/SHA256SUMS" "$STATE/parts-$kind"/
    ls -la "$STATE/parts-$kind"
    ;;
  setup)
    # Each bundle unpacks in its own process (xz is one core each; the 2.1 GB
    # Qwen bundle alone takes ~4.5 min). PART_WAIT_S=N waits up to N s for each
    # part still in transit, so a bundle unpacks while its parts arrive.
    unpack() {  # TARGET PARTS_DIR MARKER
      "$PY" -c "import sys; sys.path.insert(0, '.'); from echo_vllm.eval.bundle import unpack; from pathlib import Path; \
unpack(Path('$1'), [Path('$2')], wait_s=float('${PART_WAIT_S:-0}'))" && touch "$3"
    }
    pids=()
    if [ ! -f "$STATE/site/.unpacked" ]; then
      unpack "$STATE/site" "$STATE/parts-vllm" "$STATE/site/.unpacked" & pids+=($!)
    fi
    # every other stashed kind (echo, echo-gemma3, echo-qwen, ...) is a cache bundle
    mkdir -p "$STATE/cache"
    for parts in "$STATE"/parts-*; do
      kind="${parts##*/parts-}"
      [ "$kind" = vllm ] && continue
      [ -f "$STATE/cache/.unpacked-$kind" ] || { unpack "$STATE/cache" "$parts" "$STATE/cache/.unpacked-$kind" & pids+=($!); }
    done
    for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a failed unpack fails setup
    # vLLM finds plugins through entry points: a dist-info on PYTHONPATH
    # registers echo_vllm.vllm_glue.plugin:register without installing the package.
    di="$STATE/site/echo_vllm-0.1.0.dist-info"
    mkdir -p "$di"
    printf 'Metadata-Version: 2.1\nName: echo-vllm\nVersion: 0.1.0\n' > "$di/METADATA"
    printf '[vllm.general_plugins]\necho_vllm = echo_vllm.vllm_glue.plugin:register\n' > "$di/entry_points.txt"
    env_setup
    MODELS="${MODELS:-$MODEL}" "$PY" - <<'EOF'
import importlib.metadata as md, vllm, lm_eval, torch
from echo_vllm.eval.models import prepare_model, verify_model
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
print("vllm", vllm.__version__, "lm_eval", lm_eval.__version__, "torch", torch.__version__,
      "gpu", torch.cuda.get_device_name(0), "plugins", eps)
import os
for name in os.environ.get("MODELS", "smollm2-135m").split():
    print("model", prepare_model(name), verify_model(name)["gguf_sha256"][:16])
    open(os.path.join(os.environ["ECHO_VLLM_CACHE"], f"ready-{name}"), "w").close()
EOF
    ;;
  run)
    env_setup
    limit="${1:-none}"; shift || true
    variants=("$@"); [ ${#variants[@]} -eq 0 ] && variants=(exact naive default)
    lim=(); [ "$limit" != "none" ] && lim=(--limit "$limit")
    # Straight into $OUT when set: each variant's file is written as soon as
    # it finishes, so a call stopped by its time limit keeps what finished
    # (merge later with `echo-vllm eval accuracy --merge --out DIR --stem gpu_accuracy`).
    res="${OUT:-$STATE}/results"
    # REAL_TP=N: real tensor parallelism on N GPUs instead of the emulation
    [ "${REAL_TP:-1}" -gt 1 ] && MODEL_STEM="${MODEL_STEM}_tp$REAL_TP"
    "$PY" -m echo_vllm.eval.cli accuracy --backend vllm --model "$MODEL" --tp "$TP" --real-tp "${REAL_TP:-1}" \
      --variants "${variants[@]}" "${lim[@]}" --parallel --enforce-eager --batch-size auto \
      --out "$res" --stem "gpu_accuracy${MODEL_STEM}"
    ;;
  ttft)
    # One GPU: both servers emulate TP=3 (same extra work); `exact` sends
    # every call down the 16-bit path (--echo-min-bytes 2^60), `echo` runs
    # Echo's shipped defaults. vLLM's default torch.compile + CUDA graphs.
    # REAL_TP=N (N >= 2 GPUs): real tensor parallelism, stock vLLM (`nccl`)
    # vs Echo, optionally with BG_DUTY=0.5 NCCL background traffic on the
    # same GPUs; MODEL must split N ways (qwen2.5-coder-1.5b: 12 q / 2 kv heads).
    env_setup
    model="$STATE/cache/models/$MODEL"
    res="${OUT:-$STATE}/results/ttft${MODEL_STEM}${REAL_TP:+_tp$REAL_TP}"
    serve="$PY -m echo_vllm.cli serve $model --host 127.0.0.1 --port 8123 --max-model-len 8192 \
--gpu-memory-utilization 0.5 --no-enable-prefix-caching"
    if [ "${REAL_TP:-1}" -gt 1 ]; then
      launch=(--launch "$serve -tp $REAL_TP --tp-comm {mode}" --labels nccl echo --baseline nccl)
      [ -n "${BG_DUTY:-}" ] && launch+=(--background-traffic "$BG_DUTY")
    else
      launch=(--launch "$serve --tp-comm echo --echo-emulate-tp $TP {mode_args}" --labels exact echo
              --mode-args "exact=--echo-min-bytes 1152921504606846976")
    fi
    "$PY" -m echo_vllm.eval.cli ttft --base-url http://127.0.0.1:8123 --tokenizer "$model" "${launch[@]}" \
      --input-lens ${TTFT_INPUT_LENS:-512 2048 7936} --concurrency ${TTFT_CONCURRENCY:-1 8} \
      --num-prompts 16 --output-len 32 --server-timeout 300 --out "$res"
    ;;
  perplexity)
    env_setup
    "$PY" -m echo_vllm.eval.cli perplexity --model "$MODEL" --tp "$TP" --device cuda \
      --variants exact naive echo echo+last echo+hadamard echo+hadamard+last default \
      --group-sizes 16 32 64 128 --lambada 500 --out "$STATE/results" --stem "gpu_perplexity$MODEL_STEM"
    copy_out "$STATE/results"
    ;;
  bg)
    # The device tool ends a command's processes when it returns, except those
    # in a new process session: setsid lets the runs go on between calls.
    models=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do models+=("$1"); shift; done
    [ "${1:-}" = "--" ] && shift
    mkdir -p "$STATE/bg"
    # one queue file per call: a second `bg` must not rerun the first one's models
    q="$STATE/bg/queue.$(date +%s%N).sh"
    for m in "${models[@]}"; do
      cat >> "$q" <<EOS
for i in \$(seq ${BG_WAIT_S:-1800}); do [ -f "$STATE/cache/ready-$m" ] && break; sleep 1; done
if [ ! -f "$STATE/cache/ready-$m" ]; then
  echo "[bg] \$(date -u +%T) $m: exit not-ready (setup never verified it)" >> "$STATE/bg/status.txt"
else
  echo "[bg] \$(date -u +%T) $m: start" >> "$STATE/bg/status.txt"
  OUT="$STATE/bg/$m" MODEL="$m" bash "$PWD/eval/gpu_eval.sh" run ${LIMIT:-none} $* > "$STATE/bg/$m.log" 2>&1
  echo "[bg] \$(date -u +%T) $m: exit \$?" >> "$STATE/bg/status.txt"
fi
EOS
    done
    setsid nohup bash "$q" > "$q.log" 2>&1 < /dev/null &
    echo "[bg] queued: ${models[*]} (pid $!)"
    ;;
  wait)
    deadline=$((SECONDS + ${1:-540}))
    while [ $SECONDS -lt $deadline ]; do
      # the queue ends when every model it started has an exit line
      starts=$(grep -c ": start" "$STATE/bg/status.txt" 2>/dev/null || true)
      exits=$(grep -c ": exit" "$STATE/bg/status.txt" 2>/dev/null || true)
      queued=$(cat "$STATE"/bg/queue.*.sh 2>/dev/null | grep -c "gpu_eval.sh\" run" || true)
      [ "${exits:-0}" -ge "${queued:-0}" ] && [ "${queued:-0}" -gt 0 ] && break
      sleep 10
      [ $((SECONDS % 60)) -lt 10 ] && echo "[wait] ${SECONDS}s: ${starts:-0} started, ${exits:-0} of ${queued:-0} done"
    done
    exec bash "$0" collect
    ;;
  collect)
    cat "$STATE/bg/status.txt" 2>/dev/null || echo "[bg] nothing started yet"
    for f in "$STATE"/bg/*.log "$STATE"/bg/*/results/*.log.*.txt; do
      [ -f "$f" ] && { echo "== $f"; tail -c 600 "$f" | tr '\r' '\n' | tail -n 3; }
    done
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader || true
    if [ -n "${OUT:-}" ]; then tar czf "$OUT/bg.tgz" -C "$STATE" bg; fi
    ;;
  *)
    sed -n '2,24p' "$0"; exit 2
    ;;
esac
