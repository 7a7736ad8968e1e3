#!/usr/bin/env bash
# KV presses beside ktm on held-out text (results/presses/heldout.json), one thread, resumable
# (a finished reading is never read again): bash results/presses/run.sh
# At 2,048 tokens: held-out code, 12 windows.
# At 1,024 tokens only held-out code has documents long enough (stdlib's are cut every 100
# lines): 12 windows there.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-results/presses/heldout.json}  # OUT: another file (merged in after)
presses="expected_attention keydiff snapkv streaming_llm tova knorm"
readers="smollm2-135m-k2-seq smollm2-135m-k4-seq"
stack="expected_attention=0.5 keydiff=0.5"
python results/presses/sweep.py --resume --contexts 256 --sets code stdlib --n 24 \
    --presses $presses --ratios 0.5 0.75 --readers $readers --stack $stack --out $out
python results/presses/sweep.py --resume --contexts 1024 --sets code --n 12 \
    --presses $presses --ratios 0.5 0.75 --out $out  # ktm's readings: run_stacked.sh
python results/presses/sweep.py --resume --contexts 256 --sets code stdlib --n 24 \
    --presses expected_attention keydiff snapkv --ratios 0.875 --out $out
# the query-agnostic press (KVzip), then 2,048-token contexts: a quarter of the KV first
python results/presses/sweep.py --resume --contexts 256 --sets code stdlib --n 24 \
    --presses kvzip --ratios 0.5 0.75 0.875 --out $out
python results/presses/sweep.py --resume --contexts 1024 --sets code --n 12 \
    --presses kvzip --ratios 0.5 0.75 --out $out
python results/presses/sweep.py --resume --contexts 2048 --sets code --n 12 \
    --presses $presses kvzip --ratios 0.75 --out $out
python results/presses/sweep.py --resume --contexts 2048 --sets code --n 12 \
    --presses $presses kvzip --ratios 0.5 --out $out
