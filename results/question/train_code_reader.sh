#!/usr/bin/env bash
# The question reader for code questions: the question reader for chats
# (smollm2-135m-k4-qa-chat) fine-tuned on `codeqa` questions drawn from the training code, never
# from the standard library the questions are evaluated on; one thread.
#   bash results/question/train_code_reader.sh natural   # 100 steps of 8 on the four natural
#        kinds in turn (assign, default, params, within), 45 CPU-minutes; packed as
#        smollm2-135m-k4-qa-code, read by default at ratio 4 with the scope allocator
#   bash results/question/train_code_reader.sh assign    # run.sh's qacode-question: 50 steps of
#        8 on assign questions (what a module's or class's name is set to), 22 CPU-minutes
# The run lands in runs/codeqa-KIND-qachat (not committed: this command makes it again, its
# examples fixed by the seed; a stopped run resumes), its curve in results/readers/runs/.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
kind=${1:-natural}
case $kind in
  assign) steps=50; n=400 ;;
  natural) steps=100; n=800 ;;
  *) echo "unknown kind $kind: expected natural or assign" >&2; exit 2 ;;
esac
out=runs/codeqa-$kind-qachat
resume=()
[ -d "$out/checkpoint" ] && resume=(--resume)
ktm train --task codeqa --task-option "variant=$kind" --task-option length=1024 \
  --init smollm2-135m-k4-qa-chat --max-steps "$steps" --n-train "$n" --n-eval 4 --batch-size 8 \
  --out-dir "$out" --threads 1 --eval-every 0 --save-every 25 --seed 3 --no-progress \
  ${resume[@]+"${resume[@]}"}
mkdir -p "results/readers/runs/codeqa-$kind"
cp "$out/metrics.jsonl" "$out/run.json" "results/readers/runs/codeqa-$kind/"
if [ "$kind" = natural ]; then
  after=()
  for stage in k2 k4r k4c k4e k4s k4s2 k4qa k4qae; do after+=("results/readers/runs/$stage"); done
  ktm pack-reader "$out" --name smollm2-135m-k4-qa-code --after "${after[@]}" --ratio 4 \
    --allocator scope
fi
