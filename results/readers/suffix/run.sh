#!/usr/bin/env bash
# Readability R of the shipped readers read with another prompt layout (no training, the readers
# as shipped), on the same 64 held-out windows per set as results/readers/k2_readability.json and
# k4e_readability.json:
#   a plain suffix: the last N context tokens stay plain (ktm eval --plain-suffix N), into
#     results/readers/suffix/kK-sN.json (N=0 is the files above);
#   ALIGN=lines: line by line as well, no merged block spanning a line break (ktm eval
#     --align-lines), into results/readers/lines/kK-sN.json (N=0: no suffix).
# Usage: [ALIGN=lines] bash results/readers/suffix/run.sh [K:N ...]
#   (default: 4:4 4:8 4:16 2:4 2:8 2:16; with ALIGN=lines 4:0 2:0)
# Each file is copied into results/ when the script exits, so no later row records '-dirty'
# because an earlier one rewrote a tracked file.
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
case ${ALIGN:-} in
  '') out=suffix; layout=(); defaults=(4:4 4:8 4:16 2:4 2:8 2:16) ;;
  lines) out=lines; layout=(--align-lines); defaults=(4:0 2:0) ;;
  *) echo "ALIGN=$ALIGN: expected lines" >&2; exit 2 ;;
esac
[ $# -gt 0 ] || set -- "${defaults[@]}"
stage=runs/readers-$out
mkdir -p "$stage"
done_files=()
publish() { local f; for f in "${done_files[@]}"; do cp "$stage/$f" "results/readers/$out/$f"; done; }
trap publish EXIT
for spec in "$@"; do
  k=${spec%%:*}; n=${spec#*:}
  case $k:$n in [24]:[0-9]*) ;; *) echo "$spec: expected K:N with K 2 or 4, e.g. 4:8" >&2; exit 2 ;; esac
  ktm eval --checkpoint "smollm2-135m-k$k" "${layout[@]}" --plain-suffix "$n" \
    --readability reviews code --n-windows 64 --threads 1 \
    --method "reader-k$k${ALIGN:+-lines}-suffix$n" --json "$stage/k$k-s$n.json"
  done_files+=("k$k-s$n.json")
done
