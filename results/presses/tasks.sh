#!/usr/bin/env bash
# KV presses on the three tasks (results/presses/tasks/TASK/PRESS-RATIO.json): the uncompressed
# fine-tuned model of each task (results/experiment.sh TASK uncompressed, the shared-budget
# recipe; its checkpoint in runs/exp/TASK-uncompressed, trained here when missing) evaluated
# with each press on its context at ratio 0.5 and 0.75, the KV share ktm K=2 and K=4 keep of
# it; each row records the KV it kept (kv_after). One thread, resumable (a finished row is
# never read again); a press that refuses a task (SnapKV's 64-token window on short
# contexts) is logged and skipped.
# Usage: bash results/presses/tasks.sh [TASK...]   (default: tree amazon commitpack)
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
presses=${PRESSES:-"expected_attention keydiff snapkv streaming_llm tova knorm"}
ratios=${RATIOS:-"0.5 0.75"}
for task in ${*:-tree amazon commitpack}; do
  case $task in
    tree)       data=(--task tree --stage small --prompt-mode context --n-eval 128 --n-train 1920) ;;
    amazon)     data=(--task amazon --prompt-mode context --task-option max_chars=400
                      --n-eval 300 --n-train 640) ;;
    commitpack) data=(--task commitpack --prompt-mode context --task-option max_chars=1500
                      --n-eval 40 --n-train 120) ;;
    *) echo "unknown task $task: expected tree, amazon or commitpack" >&2; exit 2 ;;
  esac
  ckpt=runs/exp/$task-uncompressed/checkpoint
  if [ ! -d "$ckpt" ]; then
    bash results/experiment.sh "$task" uncompressed
    git checkout -- "results/tasks/shared-budget/$task"  # the committed row stays as it is
  fi
  mkdir -p "results/presses/tasks/$task"
  for press in $presses; do
    for ratio in $ratios; do
      out=results/presses/tasks/$task/$press-$ratio.json
      [ -f "$out" ] && continue
      ktm eval --checkpoint "$ckpt" "${data[@]}" --threads 1 --method "uncompressed+$press" \
        --press "$press" --press-ratio "$ratio" --json "$out.tmp" \
        && mv "$out.tmp" "$out" || { rm -f "$out.tmp"; echo "$task: $press=$ratio refused"; }
    done
  done
done
