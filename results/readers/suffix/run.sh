#!/usr/bin/env bash
# Readability R of the shipped readers read with a plain suffix: the last N context tokens stay
# plain (ktm eval --plain-suffix N; no training, the readers as shipped), on the same 64
# held-out windows per set as results/readers/k2_readability.json and k4e_readability.json
# (N=0). Usage: bash results/readers/suffix/run.sh [K:N ...]   (default: 4:4 4:8 4:16 2:4 2:8 2:16)
set -euo pipefail
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
[ $# -gt 0 ] || set -- 4:4 4:8 4:16 2:4 2:8 2:16
for spec in "$@"; do
  k=${spec%%:*}; n=${spec#*:}
  case $k:$n in [24]:[0-9]*) ;; *) echo "$spec: expected K:N with K 2 or 4, e.g. 4:8" >&2; exit 2 ;; esac
  ktm eval --checkpoint "smollm2-135m-k$k" --plain-suffix "$n" --readability reviews code \
    --n-windows 64 --threads 1 --method "reader-k$k-suffix$n" \
    --json "results/readers/suffix/k$k-s$n.json"
done
