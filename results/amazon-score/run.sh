#!/usr/bin/env bash
# Amazon by label likelihood: re-score fine-tuned amazon runs (results/amazon-lr/run.sh leaves
# them in runs/amazon-lr/NAME/) on the same 1,000 test reviews, choosing the label whose answer
# (" positive" / " negative" + EOS) is more likely, corrected for the label prior the model gives
# 300 training-side reviews (their labels unused). The uncorrected decision is in each row too
# (scoring.uncorrected_balanced_accuracy).
# Usage: bash results/amazon-score/run.sh RUN_DIR [RUN_DIR...]
# Writes results/amazon-score/NAME.json, NAME = the run folder's name (copied in when the script
# exits, so a later run never records '-dirty' because an earlier one rewrote a tracked file).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
[ $# -gt 0 ] || { echo "usage: $0 RUN_DIR [RUN_DIR...]" >&2; exit 2; }
stage=runs/amazon-score
mkdir -p "$stage"
done_runs=()
publish() {
  local r
  for r in "${done_runs[@]}"; do cp "$stage/$r.json" "results/amazon-score/$r.json"; done
}
trap publish EXIT
for run in "$@"; do
  [ -d "$run/checkpoint" ] || { echo "$run/checkpoint: no checkpoint there" >&2; exit 2; }
  name=$(basename "$run")
  ktm eval --checkpoint "$run/checkpoint" --task amazon --prompt-mode context \
    --task-option max_chars=400 --n-eval 1000 --n-train 640 --threads 1 \
    --scoring likelihood --n-calibrate 300 --method "$name" --json "$stage/$name.json"
  done_runs+=("$name")
done
