#!/usr/bin/env bash
# The question reader for code questions (run.sh's qacode-question): the question reader for
# chats (smollm2-135m-k4-qa-chat) fine-tuned 50 steps of 8 on `codeqa` assign questions (what a
# module's or class's name is set to) drawn from the training code, never from the standard
# library the questions are evaluated on. 22 CPU-minutes on one thread; the checkpoint lands in
# runs/codeqa-assign-qachat/checkpoint (not committed: this command makes it again, its
# examples fixed by the seed).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
ktm train --task codeqa --task-option variant=assign --task-option length=1024 \
  --init smollm2-135m-k4-qa-chat --max-steps 50 --n-train 400 --n-eval 4 --batch-size 8 \
  --out-dir runs/codeqa-assign-qachat --threads 1 --eval-every 0 --save-every 25 --seed 3 \
  --no-progress
