#!/usr/bin/env bash
# The reader trained to be read stacked (results/presses/train_reader.sh), merged alone and
# stacked; the shipped readers at 1,024 tokens with each press stacked at 0.5 (on K=2: a quarter
# of the plain prompt's KV), then the same stacks at 256 tokens: which presses work on merged
# prompts. Into results/presses/heldout.json beside run.sh's rows (resumable: a finished reading
# is never read again).
#   bash results/presses/run_stacked.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-results/presses/heldout.json}  # OUT: another file (merged in after)
stack="expected_attention=0.5 keydiff=0.5 snapkv=0.5 tova=0.5 streaming_llm=0.5 knorm=0.5"
if [ -d runs/presses/k2-stack/checkpoint ]; then
  python results/presses/sweep.py --resume --contexts 256 --sets code stdlib --n 24 \
      --readers runs/presses/k2-stack/checkpoint --stack expected_attention=0.5 --out $out
  python results/presses/sweep.py --resume --contexts 1024 --sets code --n 12 \
      --readers runs/presses/k2-stack/checkpoint --stack expected_attention=0.5 --out $out
fi
python results/presses/sweep.py --resume --contexts 1024 --sets code --n 12 \
    --readers smollm2-135m-k2-seq --stack $stack --out $out
python results/presses/sweep.py --resume --contexts 1024 --sets code --n 12 \
    --readers smollm2-135m-k4-seq --stack expected_attention=0.5 --out $out
python results/presses/sweep.py --resume --contexts 256 --sets code stdlib --n 24 \
    --readers smollm2-135m-k2-seq --stack $stack --out $out
# KVzip on merged prompts, and ktm's readings at 2,048 tokens
python results/presses/sweep.py --resume --contexts 256 --sets code stdlib --n 24 \
    --readers smollm2-135m-k2-seq --stack kvzip=0.5 --out $out
python results/presses/sweep.py --resume --contexts 1024 --sets code --n 12 \
    --readers smollm2-135m-k2-seq --stack kvzip=0.5 --out $out
python results/presses/sweep.py --resume --contexts 2048 --sets code --n 12 \
    --readers smollm2-135m-k2-seq --stack expected_attention=0.5 knorm=0.5 tova=0.5 kvzip=0.5 \
    --out $out
python results/presses/sweep.py --resume --contexts 2048 --sets code --n 12 \
    --readers smollm2-135m-k4-seq --out $out
