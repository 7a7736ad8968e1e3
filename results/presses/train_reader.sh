#!/usr/bin/env bash
# A reader trained to be read stacked: the shipped K=2 reader (smollm2-135m-k2-seq) pretrained
# on with the readers' recipe, half its lm and ae windows read with their merged context's KV
# pressed by ExpectedAttention at 0.5 (--press; together a quarter of the plain prompt's KV).
# Writes runs/presses/k2-stack; results/presses/sweep.py reads it beside the shipped readers
# (results/presses/run_stacked.sh).
#   bash results/presses/train_reader.sh [MAX_STEPS]
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
ktm pretrain --init smollm2-135m-k2-seq --k 2 --slot-weights --mlp-ratio 0.5 --plain-prefix 1 \
  --lora-r 16 --lora-alpha 64 --sources code reviews trees=0.5 --objectives lm ae=0.5 \
  --batch-size 8 --schedule cosine --no-spread-positions --lr 3e-4 --encoder-lr 3e-5 \
  --warmup-steps 10 --press expected_attention --press-ratio 0.5 --press-share 0.5 \
  --eval-sets none --save-every 25 --seed 11 --threads 1 --no-progress \
  --max-steps "${1:-150}" --out-dir runs/presses/k2-stack
