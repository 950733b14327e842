#!/usr/bin/env bash
# Makes .gpu-bundle/, what the GPU acceptance runs carry (scripts/gpu_accept.sh):
# the offline vLLM bundle of the shared wheelhouse (its build.sh, from PyPI),
# cut into 4 parts, one per run, so that the tree and one part fit the 64 MiB
# a device call carries; their SHA256SUMS; and the wheelhouse's install.py,
# which unpacks them on the host (run 4). On a machine that reaches PyPI,
# about 5 minutes. The folder is git-ignored and made fresh each session.
#
# Usage: bash scripts/gpu_bundle.sh [WHEELHOUSE]   (default ../shared/gpu-wheelhouse)
# Refuses an existing .gpu-bundle/ that holds anything (remove it first).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
WHEELHOUSE=${1:-../shared/gpu-wheelhouse}
OUT=.gpu-bundle
PARTS=4
MAX_PART_MIB=48  # the tree and one part within a call's 64 MiB
for f in build.sh install.py; do
  [ -f "$WHEELHOUSE/$f" ] || { echo "gpu_bundle.sh: no $f in $WHEELHOUSE" >&2; exit 2; }
done
if [ -e "$OUT" ] && [ -n "$(find "$OUT" -mindepth 1 -print -quit)" ]; then
  echo "gpu_bundle.sh: $OUT holds files already: remove it first (it is made whole, never mixed)" >&2
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
bash "$WHEELHOUSE/build.sh" "$work/whole" 100000 > "$work/build.log"  # one part: cut here
mkdir -p "$OUT"
whole=("$work"/whole/bundle.part.*)
[ "${#whole[@]}" = 1 ] || { echo "gpu_bundle.sh: build.sh made ${#whole[@]} parts, not one" >&2; exit 1; }
split -n "$PARTS" -d -a 2 "${whole[0]}" "$OUT/bundle.part."  # -n: equal sizes, from a file
cp "$WHEELHOUSE/install.py" "$OUT/"
(cd "$OUT" && sha256sum bundle.part.* > SHA256SUMS)
too_big=$(find "$OUT" -name 'bundle.part.*' -size +"$MAX_PART_MIB"M)
if [ -n "$too_big" ]; then
  echo "gpu_bundle.sh: parts over $MAX_PART_MIB MiB (a call could not carry the tree beside one): $too_big" >&2
  exit 1
fi
ls -l "$OUT"
