#!/usr/bin/env bash
# Readability R of the shipped readers read line by line: no merged block spans a line break
# (ktm eval --align-lines; no training, the readers as shipped), on the same 64 held-out windows
# per set as results/readers/k2_readability.json and k4e_readability.json. N > 0 adds a plain
# suffix of N tokens as well. Usage: bash results/readers/lines/run.sh [K:N ...]  (default 4:0 2:0)
# Writes results/readers/lines/kK-sN.json when the script exits (so no row records '-dirty'
# because an earlier one rewrote a tracked file).
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
[ $# -gt 0 ] || set -- 4:0 2:0
stage=runs/readers-lines
mkdir -p "$stage"
done_files=()
publish() { local f; for f in "${done_files[@]}"; do cp "$stage/$f" "results/readers/lines/$f"; done; }
trap publish EXIT
for spec in "$@"; do
  k=${spec%%:*}; n=${spec#*:}
  case $k:$n in [24]:[0-9]*) ;; *) echo "$spec: expected K:N with K 2 or 4, e.g. 4:0" >&2; exit 2 ;; esac
  ktm eval --checkpoint "smollm2-135m-k$k" --align-lines --plain-suffix "$n" \
    --readability reviews code --n-windows 64 --threads 1 --method "reader-k$k-lines-suffix$n" \
    --json "$stage/k$k-s$n.json"
  done_files+=("k$k-s$n.json")
done
