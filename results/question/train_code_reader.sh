#!/usr/bin/env bash
# The question reader for code questions: the question reader for chats
# (smollm2-135m-k4-qa-chat) fine-tuned on `codeqa` questions drawn from the training code, never
# from the standard library the questions are evaluated on; one thread.
#   bash results/question/train_code_reader.sh assign    # run.sh's qacode-question: 50 steps of
#        8 on assign questions (what a module's or class's name is set to), 22 CPU-minutes
#   bash results/question/train_code_reader.sh natural   # run.sh's qanat-question: 100 steps of
#        8 on the four natural kinds in turn (assign, default, params, within)
# The checkpoint lands in runs/codeqa-KIND-qachat/checkpoint (not committed: this command makes
# it again, its examples fixed by the seed).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
kind=${1:-assign}
case $kind in
  assign) steps=50; n=400 ;;
  natural) steps=100; n=800 ;;
  *) echo "unknown kind $kind: expected assign or natural" >&2; exit 2 ;;
esac
ktm train --task codeqa --task-option "variant=$kind" --task-option length=1024 \
  --init smollm2-135m-k4-qa-chat --max-steps "$steps" --n-train "$n" --n-eval 4 --batch-size 8 \
  --out-dir "runs/codeqa-$kind-qachat" --threads 1 --eval-every 0 --save-every 25 --seed 3 \
  --no-progress
