#!/usr/bin/env bash
# Trains the readers: encoder + LoRA pretrained to read merged text, from unlabeled text only
# (the train sides of the shipped data: CommitPack code, Fashion review texts, tree texts).
# The recipe is the one the probes in results/README.md chose. Each run resumes if its folder
# holds a checkpoint, logs readability R on held-out text every EVAL steps, and ends with:
#   ktm pack-reader  -> ktm/readers/smollm2-135m-kK (fp16, shipped; K=2 and K=4)
#   ktm eval --readability -> results/readers/kK_readability.json (64 windows per held-out set)
#   metrics.jsonl + run.json -> results/readers/runs/kK/ (the R-per-CPU-minute curve)
# Usage: bash results/readers/train_readers.sh [k2] [k3] [k4] [k4r]   (default: k2 k3 k4)
# k4r: K=4 as recursive merging (--inner-k 2: a K=2 merge of two K=2 merges, the inner level
# loaded from the K=2 reader's encoder), packed as smollm2-135m-k4r.
# One thread per run. k2 comes first: k3 and k4 start their LoRA from the K=2 reader (the K
# curriculum, `--init-adapter`; results/README.md, "Readers"), by default the shipped one
# (K2_READER=DIR to use another), each with a fresh encoder of its own K.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
recipe=(--slot-weights --mlp-ratio 0.5 --plain-prefix 1 --spread-positions --lora-r 16 --lora-alpha 64
        --sources code reviews trees=0.5 --objectives lm ae=0.5
        --batch-size 8 --lr 1e-3 --encoder-lr 1e-4 --schedule cosine --warmup-steps 20
        --eval-every 100 --n-eval-windows 32 --save-every 25 --seed 0 --threads 1 --no-progress)
# k2 was started at 600 steps and resumed, at step 175, with this shorter schedule to fit one
# session (a stream's order does not depend on its length; only the cosine's span changed)
declare -A steps=([k2]=400 [k3]=400 [k4]=450 [k4r]=450)
[ $# -gt 0 ] || set -- k2 k3 k4
for name in "$@"; do
  k=${name#k}; k=${k%r}
  extra=()
  [ "$name" = k4r ] && extra=(--inner-k 2)
  out=runs/readers/$name
  start=()
  [ "$k" != 2 ] && start=(--init-adapter "${K2_READER:-smollm2-135m-k2}")
  [ -d "$out/checkpoint" ] && start=(--resume)
  ktm pretrain --k "$k" "${recipe[@]}" --max-steps "${steps[$name]}" --out-dir "$out" "${start[@]}" "${extra[@]}"
  mkdir -p "results/readers/runs/$name"
  cp "$out/metrics.jsonl" "$out/run.json" "results/readers/runs/$name/"
  ckpt=$out/checkpoint
  if [ "$k" != 3 ]; then
    ktm pack-reader "$out" --name "smollm2-135m-$name"
    ckpt=smollm2-135m-$name
  fi
  ktm eval --checkpoint "$ckpt" --readability reviews code --n-windows 64 --threads 1 \
    --method "reader-$name" --json "results/readers/${name}_readability.json"
done
