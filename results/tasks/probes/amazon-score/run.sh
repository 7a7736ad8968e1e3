#!/usr/bin/env bash
# Amazon by label likelihood: re-score fine-tuned amazon runs on 1,000 test reviews (the same
# ones as results/tasks/budgets/amazon-n1000/ and results/tasks/budgets/amazon-lr/), choosing the label whose answer
# (" positive" / " negative" + EOS) is more likely, corrected for the label prior the model gives
# 300 training-side reviews (their labels unused). The uncorrected decision is in each row too
# (scoring.uncorrected_balanced_accuracy).
# Usage: bash results/tasks/probes/amazon-score/run.sh RUN_DIR [RUN_DIR...]
#   RUN_DIR: a run folder of results/tasks/budgets/amazon-lr/run.sh (runs/amazon-lr/NAME) or of
#   results/experiment.sh amazon (runs/exp/amazon-METHOD; a baseline compressor's run is scored
#   with its compressor, as experiment.sh evaluates it).
# A run kept with a weight average (experiment.sh with EMA=D) is scored twice: the average as NAME,
# its last iterate (RUN_DIR/checkpoint/live) as NAME-live.
# Writes results/tasks/probes/amazon-score/NAME.json, NAME = the run folder's name (copied in when the script
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
  for r in "${done_runs[@]}"; do cp "$stage/$r.json" "results/tasks/probes/amazon-score/$r.json"; done
}
trap publish EXIT
for run in "$@"; do
  [ -d "$run/checkpoint" ] || { echo "$run/checkpoint: no checkpoint there" >&2; exit 2; }
  name=$(basename "$run")
  case ${name#amazon-} in
    mean_pool) comp=(--compressor mean_pool) ;;
    selective_context|llmlingua) comp=(--compressor "${name#amazon-}" --compressor-option ratio=0.5) ;;
    ltsc) comp=(--compressor ltsc) ;;
    *) comp=() ;;
  esac
  ckpts=("$run/checkpoint"); names=("$name")
  [ -d "$run/checkpoint/live" ] && { ckpts+=("$run/checkpoint/live"); names+=("$name-live"); }
  for i in "${!ckpts[@]}"; do
    ktm eval --checkpoint "${ckpts[$i]}" --task amazon --prompt-mode context \
      --task-option max_chars=400 --n-eval 1000 --n-train 640 --threads 1 "${comp[@]}" \
      --scoring likelihood --n-calibrate 300 --method "${names[$i]}" --json "$stage/${names[$i]}.json"
    done_runs+=("${names[$i]}")
  done
done
