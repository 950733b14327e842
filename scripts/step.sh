# Sourced by the GPU scripts: `step NAME SECONDS CMD...` runs CMD under a
# time limit into $OUT/NAME.log, prints its tail, and appends a line to the
# `status` array (name, exit code, seconds) for the script's summary.
status=()

step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${STEP_TAIL:-30}" "$OUT/$name.log"
  status+=("$(printf '%-22s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}
