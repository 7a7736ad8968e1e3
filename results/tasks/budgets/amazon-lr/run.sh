#!/usr/bin/env bash
# Amazon K=4: does the fine-tuning learning rate, not the reader, hold K=4 back? The experiment's
# recipe (80 steps x 8 reviews, lr 5e-4 / encoder 5e-5, results/experiment.sh) fine-tuned again
# at other LoRA rates (the encoder's stays a tenth of it) and two seeds, each evaluated on 1,000
# test reviews like results/tasks/budgets/amazon-n1000/ (whose k4.json and k4-seed1.json are the 5e-4 points).
# Usage: bash results/tasks/budgets/amazon-lr/run.sh METHOD LR [LR...]   METHOD: k4 (the shipped K=4 reader, or
#        $K4_READER) or uncompressed. Seeds: $SEEDS, default "0 1".
# Writes results/tasks/budgets/amazon-lr/METHOD-lrLR-seedS.json (copied in when the script exits, so a later
# run never records '-dirty' because an earlier one rewrote a tracked file).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
method=$1; shift
case $method in
  k4) model=(--k 4 --init "${K4_READER:-smollm2-135m-k4}") ;;
  uncompressed) model=(--k 1 --no-mlp) ;;
  *) echo "unknown method $method: expected k4 or uncompressed" >&2; exit 2 ;;
esac
data=(--task amazon --prompt-mode context --task-option max_chars=400)
done_runs=()
publish() {
  local r
  for r in "${done_runs[@]}"; do cp "runs/amazon-lr/$r/eval.json" "results/tasks/budgets/amazon-lr/$r.json"; done
}
trap publish EXIT
for lr in "$@"; do
  enc=$(python3 -c "print(f'{$lr / 10:g}')")
  for seed in ${SEEDS:-0 1}; do
    name=$method-lr$lr-seed$seed
    out=runs/amazon-lr/$name
    rm -rf "$out"
    ktm train "${data[@]}" "${model[@]}" --lr "$lr" --encoder-lr "$enc" --warmup-steps 5 \
      --seed "$seed" --save-every 0 --no-progress --lora-r 16 --lora-alpha 64 --threads 1 \
      --eval-every 30 --max-steps 80 --batch-size 8 --n-train 640 --n-eval 32 --out-dir "$out"
    ktm eval --checkpoint "$out/checkpoint" "${data[@]}" --n-eval 1000 --n-train 640 --threads 1 \
      --method "$name" --json "$out/eval.json"
    done_runs+=("$name")
  done
done
