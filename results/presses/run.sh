#!/usr/bin/env bash
# KV presses beside ktm on held-out text (results/presses/heldout.json), one thread, resumable:
#   bash results/presses/run.sh            (about 2 CPU-hours on one core)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/presses/heldout.json
presses="expected_attention keydiff snapkv streaming_llm tova knorm"
readers="smollm2-135m-k2-seq smollm2-135m-k4-seq"
stack="expected_attention=0.5 keydiff=0.5 knorm=0.5 expected_attention=0.75"
python results/presses/sweep.py --resume --contexts 256 --sets code stdlib reviews --n 24 \
    --presses $presses --ratios 0.5 0.75 0.875 --readers $readers --stack $stack --out $out
python results/presses/sweep.py --resume --contexts 1024 --sets code stdlib --n 12 \
    --presses $presses --ratios 0.5 0.75 0.875 --readers $readers --stack $stack --out $out
