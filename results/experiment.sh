#!/usr/bin/env bash
# The three-task experiment at CPU scale, every method on the same fine-tuning recipe:
#   uncompressed; k2, k3, k4 (K-Token Merging, each fine-tuned from its pretrained reader:
#   smollm2-135m-k2 / -k4 shipped in the package, K=3 from $K3_READER, default
#   runs/readers/k3/checkpoint, made by results/readers/train_readers.sh; $K2_READER / $K4_READER
#   point k2 / k4 at a reader folder instead of the shipped names); k4-scratch (K=4 with
#   the readers' encoder settings but no reader: the ablation); and the baselines mean_pool
#   (K=4 mean pooling), selective_context, llmlingua (both to ratio 0.5, i.e. K=2's length), ltsc.
# Every method gets the same LoRA (r=16, alpha=64, as the readers), learning rates and steps.
# Usage: bash results/experiment.sh TASK [METHOD...]
#   TASK: tree (stage small) | tree-long (3x the fine-tuning: 360 steps over 5,760 pairs) |
#         tree-xlong (6x: 720 steps over 11,520 pairs) |
#         tree-xmedium | tree-xmedium-long (4x: 480 steps over 7,680 pairs) | amazon | amazon-long (3x the fine-tuning: 240
#         steps over 1,920 reviews) | commitpack
# Each run: ktm train -> runs/exp/TASK-METHOD, then ktm eval -> results/TASK/METHOD.json, and the
# run's metrics.jsonl -> results/TASK/METHOD.metrics.jsonl (loss and the fine-tuning curve).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
name=$1; shift
methods=${*:-"uncompressed k2 k3 k4"}
# --eval-every: the task metric on the run's --n-eval examples every 30 steps, in metrics.jsonl
# (the fine-tuning curve; greedy evaluation, it does not change the training)
common=(--lr 5e-4 --encoder-lr 5e-5 --warmup-steps 5 --seed 0 --save-every 0 --no-progress
        --lora-r 16 --lora-alpha 64 --threads 1 --eval-every 30)
case $name in
  tree)         task=tree; data=(--stage small --prompt-mode context)
                train=(--max-steps 120 --batch-size 16 --n-train 1920 --n-eval 32)
                eval=(--n-eval 128) ;;
  tree-long)    task=tree; data=(--stage small --prompt-mode context)
                train=(--max-steps 360 --batch-size 16 --n-train 5760 --n-eval 32)
                eval=(--n-eval 128) ;;
  tree-xlong)   task=tree; data=(--stage small --prompt-mode context)
                train=(--max-steps 720 --batch-size 16 --n-train 11520 --n-eval 32)
                eval=(--n-eval 128) ;;
  tree-xmedium) task=tree; data=(--stage xmedium --prompt-mode context)
                train=(--max-steps 120 --batch-size 16 --n-train 1920 --n-eval 32)
                eval=(--n-eval 128) ;;
  tree-xmedium-long) task=tree; data=(--stage xmedium --prompt-mode context)
                train=(--max-steps 480 --batch-size 16 --n-train 7680 --n-eval 32)
                eval=(--n-eval 128) ;;
  amazon)       task=amazon; data=(--prompt-mode context --task-option max_chars=400)
                train=(--max-steps 80 --batch-size 8 --n-train 640 --n-eval 32)
                eval=(--n-eval 300) ;;
  amazon-long)  task=amazon; data=(--prompt-mode context --task-option max_chars=400)
                train=(--max-steps 240 --batch-size 8 --n-train 1920 --n-eval 32)
                eval=(--n-eval 300) ;;
  commitpack)   task=commitpack; data=(--prompt-mode context --task-option max_chars=1500)
                train=(--max-steps 60 --batch-size 2 --n-train 120 --n-eval 8)
                eval=(--n-eval 40) ;;
  *) echo "unknown task $name" >&2; exit 2 ;;
esac
reader_encoder=(--slot-weights --mlp-ratio 0.5 --plain-prefix 1 --spread-positions)
mkdir -p "results/$name"
for m in $methods; do
  comp=()
  case $m in
    uncompressed) model=(--k 1 --no-mlp) ;;
    k2) model=(--k 2 --init "${K2_READER:-smollm2-135m-k2}") ;;
    k3) model=(--k 3 --init "${K3_READER:-runs/readers/k3/checkpoint}") ;;
    k4) model=(--k 4 --init "${K4_READER:-smollm2-135m-k4}") ;;
    k4-scratch) model=(--k 4 "${reader_encoder[@]}") ;;
    mean_pool) model=(--k 4); comp=(--compressor mean_pool) ;;
    selective_context|llmlingua) model=(); comp=(--compressor "$m" --compressor-option ratio=0.5) ;;
    ltsc) model=(); comp=(--compressor ltsc) ;;
    *) echo "unknown method $m" >&2; exit 2 ;;
  esac
  out=runs/exp/$name-$m
  rm -rf "$out"
  ktm train --task "$task" "${data[@]}" "${model[@]}" "${comp[@]}" "${common[@]}" "${train[@]}" \
    --out-dir "$out"
  ktm eval --checkpoint "$out/checkpoint" --task "$task" "${data[@]}" "${eval[@]}" "${comp[@]}" \
    "${train[@]:4:2}" --threads 1 --method "$m" --json "results/$name/$m.json"
  cp "$out/metrics.jsonl" "results/$name/$m.metrics.jsonl"
done
