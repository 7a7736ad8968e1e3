#!/usr/bin/env bash
# The mixed-level reader of adaptive merging: the shipped K=4 reader (smollm2-135m-k4-seq, levels
# 4 and 2, consecutive positions) grown by an outer level to K=8 (levels 8, 4, 2; the new level
# starts as the mean of two K=4 merges), then pretrained on the readers' recipe with three windows
# in four read at a ratio drawn log-uniformly from 1.5 to 8 (--mixed-share), each laid out by an
# allocator drawn from random, rules, surprisal, recency and even, and the rest merged uniformly at
# K=8, 4 or 2 (--k-mix). Writes runs/adaptive/k8mix (its checkpoint holds the surprisal table it
# counted from its own text). About 45 CPU-minutes for 300 steps on one core, plus evaluations.
#   bash results/adaptive/train_reader.sh [MAX_STEPS]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
ktm pretrain --init smollm2-135m-k4-seq --k 8 --inner-k 4 2 --slot-weights --mlp-ratio 0.5 \
  --plain-prefix 1 --lora-r 16 --lora-alpha 64 --sources code reviews trees=0.5 \
  --objectives lm ae=0.5 --batch-size 8 --schedule cosine --no-spread-positions --lr 3e-4 \
  --encoder-lr 3e-5 --warmup-steps 10 --mixed-share 0.75 --ratio-range 1.5 8 --k-mix 8 4 2 \
  --eval-every 150 --n-eval-windows 16 --eval-ratios 4 2 --save-every 25 --seed 7 --threads 1 \
  --no-progress --max-steps "${1:-300}" --out-dir runs/adaptive/k8mix
