#!/usr/bin/env bash
# Amazon on 1,000 test reviews instead of 300 (about 200 negatives instead of 60, so balanced
# accuracy carries about +-0.02 of noise instead of +-0.04), for the K=4 reader question:
#   uncompressed.json  the experiment's uncompressed checkpoint (runs/exp/amazon-uncompressed,
#                      from `bash results/experiment.sh amazon uncompressed`)
#   k4.json            K=4 from the shipped reader k4e (runs/exp/amazon-k4, `experiment.sh amazon k4`)
#   k4-k4r.json        K=4 from the reader shipped before, k4r (the same, with K4_READER pointing
#                      at ktm/readers/smollm2-135m-k4 of revision e0b14c2)
#   k4-seed1.json, k4-k4r-seed1.json   the same two fine-tuned again with --seed 1 (this script)
# Usage: bash results/tasks/budgets/amazon-n1000/run.sh K4R_READER_DIR   (after experiment.sh amazon uncompressed k4
#        and K4_READER=K4R_READER_DIR experiment.sh amazon k4, moving that run to runs/exp/amazon-k4-k4r)
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
k4r=$1
data=(--task amazon --prompt-mode context --task-option max_chars=400)
evaluate() {  # NAME CHECKPOINT
  ktm eval --checkpoint "$2" "${data[@]}" --n-eval 1000 --n-train 640 --threads 1 --method "$1" \
    --json "results/tasks/budgets/amazon-n1000/$1.json"
}
evaluate uncompressed runs/exp/amazon-uncompressed/checkpoint
evaluate k4 runs/exp/amazon-k4/checkpoint
evaluate k4-k4r runs/exp/amazon-k4-k4r/checkpoint
for run in "k4-seed1 smollm2-135m-k4" "k4-k4r-seed1 $k4r"; do
  read -r name reader <<< "$run"
  ktm train "${data[@]}" --k 4 --init "$reader" --lr 5e-4 --encoder-lr 5e-5 --warmup-steps 5 \
    --seed 1 --save-every 0 --no-progress --lora-r 16 --lora-alpha 64 --threads 1 --eval-every 30 \
    --max-steps 80 --batch-size 8 --n-train 640 --n-eval 32 --out-dir "runs/$name"
  evaluate "$name" "runs/$name/checkpoint"
done
