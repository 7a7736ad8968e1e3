#!/usr/bin/env bash
# The three-task experiment at CPU scale, every method on the same fine-tuning recipe:
#   uncompressed; k2, k3, k4 (K-Token Merging, each fine-tuned from its pretrained reader:
#   smollm2-135m-k2 / -k4 shipped in the package, K=3 from $K3_READER, default
#   runs/readers/k3/checkpoint, made by results/readers/train_readers.sh; $K2_READER / $K4_READER
#   point k2 / k4 at a reader folder instead of the shipped names); k4-scratch (K=4 with
#   the readers' encoder settings but no reader: the ablation); k2-teach, k4-teach (k2 / k4
#   with task distillation, ktm train --teacher: loss 0.5 CE + 0.5 KL to the uncompressed run
#   of the same task, runs/exp/TASK-uncompressed, so list uncompressed first; k4-teachW for
#   another weight W, e.g. k4-teach0.2); and the
#   baselines mean_pool (K=4 mean pooling), selective_context, llmlingua (both to ratio 0.5,
#   i.e. K=2's length), ltsc; and adaptive merging (ktm train --ratio R): ada-rR (e.g. ada-r4) fine-tunes
#   the mixed-level reader $ADAPTIVE_READER (default runs/adaptive/k8mix/checkpoint, made by
#   results/adaptive/train_reader.sh) reading each task's context at ratio R, its positions spent by
#   --allocator ${ALLOCATOR:-surprisal}; ada-kK reads it uniformly at K (the same reader's control);
#   and the question reader: qa-question fine-tunes smollm2-135m-k4-qa ($QA_READER for another)
#   reading each context at ratio 4 (K=4's positions) by the question allocator (the lines the
#   question names plain, the least relevant left out to pay), qa-k4 the same reader uniformly
#   at K=4 (its control).
# LR=RATE (environment) fine-tunes at another LoRA rate (the encoder's is a tenth of it) and
# writes to results/tasks/budgets/TASK-lrRATE/ and runs/exp/TASK-lrRATE-METHOD instead. SLOT_LR=RATE gives
# the encoder's slot weights their own rate (ktm train --slot-lr), into results/tasks/probes/TASK-slotRATE/.
# SCHEDULE=cosine decays the learning rate to 10 % over the run after the warm-up (ktm train
# --schedule cosine) instead of holding it constant, into results/tasks/probes/TASK-cosine/.
# SUFFIX=N keeps the last N prompt tokens of the merged text plain in the K-token-merging runs
# (ktm train --plain-suffix N; the other methods are unchanged), into results/tasks/probes/TASK-suffixN/.
# ALIGN=lines merges each line of the compressed text on its own in the K-token-merging runs, no
# block spanning a line break (ktm train --align-lines), into results/tasks/probes/TASK-lines/.
# SEED=N fine-tunes with another seed (ktm train --seed N; default 0), into results/tasks/probes/TASK-seedN/.
# EMA=D keeps an average of the weights (ktm train --ema-decay D), into results/tasks/probes/TASK-emaD/: each
# run's METHOD.json reads the average, METHOD-live.json the last iterate of the same run (a paired
# comparison: the average does not change the training).
# Every method gets the same LoRA (r=16, alpha=64, as the readers), learning rates and steps.
# Usage: bash results/experiment.sh TASK [METHOD...]
#   TASK: tree (stage small) | tree-xmedium | amazon | commitpack, or a longer budget of one:
#         tree-long (3x the fine-tuning: 360 steps over 5,760 pairs), tree-xlong (6x),
#         tree-xxlong (12x), tree-xmedium-long (4x), amazon-long (3x: 240 steps over 1,920 reviews),
#         amazon-xlong (6x),
#         commitpack-long (3x: 180 steps over 360 commits);
#         amazon-balanced: amazon with as many negative as positive training reviews (the test
#         set keeps its natural 4:1);
#         tree-xmedium-cur (1x), tree-xmedium-cur-long (3x): the tree curriculum, stage small
#         then xmedium: each method starts from its own stage-small run of the same variant
#         (runs/exp/tree-METHOD, so run `experiment.sh tree METHOD` first) instead of its reader
# Each run: ktm train -> runs/exp/TASK-METHOD, then ktm eval -> results/tasks/GROUP/TASK/METHOD.json
# (GROUP: shared-budget, budgets or probes, by the variant's name), and the run's metrics.jsonl
# -> results/tasks/GROUP/TASK/METHOD.metrics.jsonl (loss and the fine-tuning curve).
# The files reach results/ only when the script exits (each finished run's, also after a
# failure): rewriting a tracked result before the next run starts would make that run record
# its revision as '-dirty'.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
task_name=$1; shift
name=$task_name${LR:+-lr$LR}${SLOT_LR:+-slot$SLOT_LR}${SUFFIX:+-suffix$SUFFIX}${ALIGN:+-$ALIGN}${SEED:+-seed$SEED}${EMA:+-ema$EMA}
schedule=${SCHEDULE:-constant}
case $schedule in constant) ;; cosine) name+=-cosine ;;
  *) echo "SCHEDULE=$schedule: expected constant or cosine" >&2; exit 2 ;; esac
# where a variant's files go: the shared-budget experiment, the longer budgets, or a lever probe
case $name in
  tree|tree-xmedium|amazon|commitpack) group=shared-budget ;;
  *-long|*-xlong|*-xxlong|*-cur|*-lr*|*-n1000) group=budgets ;;
  *) group=probes ;;
esac
dest=results/tasks/$group/$name
lr=${LR:-5e-4}
case $lr in ''|*[!0-9.eE+-]*) echo "LR=$lr: expected a number such as 2e-4" >&2; exit 2 ;; esac
case ${SUFFIX:-1} in ''|*[!0-9]*) echo "SUFFIX=$SUFFIX: expected a number of tokens such as 4" >&2; exit 2 ;; esac
case ${SEED:-0} in ''|*[!0-9]*) echo "SEED=$SEED: expected a number such as 1" >&2; exit 2 ;; esac
case ${ALIGN:-lines} in lines) ;; *) echo "ALIGN=$ALIGN: expected lines" >&2; exit 2 ;; esac
case ${EMA:-0.5} in 0.[0-9]*) ;; *) echo "EMA=$EMA: expected a decay in (0, 1) such as 0.95" >&2; exit 2 ;; esac
case ${SLOT_LR:-1} in ''|*[!0-9.eE+-]*) echo "SLOT_LR=$SLOT_LR: expected a number such as 1e-2" >&2; exit 2 ;; esac
encoder_lr=$(python3 -c "print(f'{$lr / 10:g}')")
methods=${*:-"uncompressed k2 k3 k4"}
# --eval-every: the task metric on the run's --n-eval examples every 30 steps, in metrics.jsonl
# (the fine-tuning curve; greedy evaluation, it does not change the training)
common=(--lr "$lr" --encoder-lr "$encoder_lr" --warmup-steps 5 --schedule "$schedule" --seed "${SEED:-0}" --save-every 0 --no-progress
        --lora-r 16 --lora-alpha 64 --threads 1 --eval-every 30 ${SLOT_LR:+--slot-lr "$SLOT_LR"}
        ${EMA:+--ema-decay "$EMA"})
# the budget curves: a base task with N times its steps and training examples
declare -A longer=([tree-long]="tree 3" [tree-xlong]="tree 6" [tree-xxlong]="tree 12"
                   [tree-xmedium-long]="tree-xmedium 4" [commitpack-long]="commitpack 3"
                   [amazon-long]="amazon 3" [amazon-xlong]="amazon 6"
                   [tree-xmedium-cur]="tree-xmedium 1" [tree-xmedium-cur-long]="tree-xmedium 3")
read -r base n <<< "${longer[$task_name]:-$task_name 1}"
case $base in
  tree)         task=tree; data=(--stage small --prompt-mode context)
                steps=120; batch=16; n_train=1920; n_eval=32; eval=(--n-eval 128) ;;
  tree-xmedium) task=tree; data=(--stage xmedium --prompt-mode context)
                steps=120; batch=16; n_train=1920; n_eval=32; eval=(--n-eval 128) ;;
  amazon|amazon-balanced)
                task=amazon; data=(--prompt-mode context --task-option max_chars=400)
                [ "$base" = amazon ] || data+=(--task-option balance_train=true)
                steps=80; batch=8; n_train=640; n_eval=32; eval=(--n-eval 300) ;;
  commitpack)   task=commitpack; data=(--prompt-mode context --task-option max_chars=1500)
                steps=60; batch=2; n_train=120; n_eval=8; eval=(--n-eval 40) ;;
  *) echo "unknown task $name" >&2; exit 2 ;;
esac
steps=$((steps * n)); n_train=$((n_train * n))
train=(--max-steps "$steps" --batch-size "$batch" --n-train "$n_train" --n-eval "$n_eval")
reader_encoder=(--slot-weights --mlp-ratio 0.5 --plain-prefix 1 --spread-positions)
mkdir -p "$dest"
done_runs=()
publish() {
  local m
  for m in "${done_runs[@]}"; do
    cp "runs/exp/$name-$m/eval.json" "$dest/$m.json"
    cp "runs/exp/$name-$m/metrics.jsonl" "$dest/$m.metrics.jsonl"
    echo "wrote $dest/$m.json and $m.metrics.jsonl"
    if [ -f "runs/exp/$name-$m/eval-live.json" ]; then
      cp "runs/exp/$name-$m/eval-live.json" "$dest/$m-live.json"
      echo "wrote $dest/$m-live.json"
    fi
  done
}
trap publish EXIT
for m in $methods; do
  comp=(); teach=()
  case $m in
    uncompressed) model=(--k 1 --no-mlp) ;;
    k2|k2-teach*) model=(--k 2 --init "${K2_READER:-smollm2-135m-k2}") ;;
    k3) model=(--k 3 --init "${K3_READER:-runs/readers/k3/checkpoint}") ;;
    k4|k4-teach*) model=(--k 4 --init "${K4_READER:-smollm2-135m-k4}") ;;
    k4-scratch) model=(--k 4 "${reader_encoder[@]}") ;;
    mean_pool) model=(--k 4); comp=(--compressor mean_pool) ;;
    selective_context|llmlingua) model=(); comp=(--compressor "$m" --compressor-option ratio=0.5) ;;
    ltsc) model=(); comp=(--compressor ltsc) ;;
    ada-r*) model=(--k 8 --init "${ADAPTIVE_READER:-runs/adaptive/k8mix/checkpoint}"
                   --ratio "${m#ada-r}" --allocator "${ALLOCATOR:-surprisal}") ;;
    ada-k*) model=(--k "${m#ada-k}" --init "${ADAPTIVE_READER:-runs/adaptive/k8mix/checkpoint}") ;;
    qa-question) model=(--k 4 --init "${QA_READER:-smollm2-135m-k4-qa}" --ratio 4
                        --allocator question) ;;
    qa-k4) model=(--k 4 --init "${QA_READER:-smollm2-135m-k4-qa}" --ratio 4 --allocator even) ;;
    *) echo "unknown method $m" >&2; exit 2 ;;
  esac
  [[ $m == k[0-9]* && -n ${SUFFIX:-} ]] && model+=(--plain-suffix "$SUFFIX")
  [[ $m == k[0-9]* && -n ${ALIGN:-} ]] && model+=(--align-lines)
  if [[ $task_name == tree-xmedium-cur* ]]; then
    prev=runs/exp/tree${name#"$task_name"}-$m/checkpoint
    [ -d "$prev" ] || { echo "$task_name $m needs $prev: run experiment.sh tree $m first" >&2; exit 2; }
    kept=(); skip=0
    for a in "${model[@]}"; do   # the stage-small run replaces the reader as the start
      if ((skip)); then skip=0; elif [ "$a" = --init ]; then skip=1; else kept+=("$a"); fi
    done
    model=("${kept[@]}" --init "$prev")
  fi
  if [[ $m == *-teach* ]]; then
    teacher=runs/exp/$name-uncompressed/checkpoint
    [ -d "$teacher" ] || { echo "$m needs $teacher: run uncompressed first" >&2; exit 2; }
    w=${m#*-teach}
    teach=(--teacher "$teacher" --teacher-weight "${w:-0.5}")
  fi
  out=runs/exp/$name-$m
  rm -rf "$out"
  ktm train --task "$task" "${data[@]}" "${model[@]}" "${comp[@]}" "${teach[@]}" "${common[@]}" \
    "${train[@]}" --out-dir "$out"
  ktm eval --checkpoint "$out/checkpoint" --task "$task" "${data[@]}" "${eval[@]}" "${comp[@]}" \
    --n-train "$n_train" --threads 1 --method "$m" --json "$out/eval.json"
  if [ -n "${EMA:-}" ]; then   # the same run's last iterate
    ktm eval --checkpoint "$out/checkpoint/live" --task "$task" "${data[@]}" "${eval[@]}" "${comp[@]}" \
      --n-train "$n_train" --threads 1 --method "$m-live" --json "$out/eval-live.json"
  fi
  done_runs+=("$m")
done
