#!/usr/bin/env bash
# Runs reader-recipe probes one after another, one thread each (the machine's other core is for
# development). Each line of QUEUE is "NAME ktm-pretrain-flags..."; lines are taken from the top,
# so lines can be appended while it runs. Metrics go to runs/probes/NAME; when a run ends its
# metrics.jsonl and run.json are copied to results/readers/probes/NAME/, with queue.log, its
# start and end lines. Those lines are written nowhere tracked while a run starts: a tracked file
# changed then would mark the revision the run records as dirty (results/readers/queue.log holds
# the lines of the runs before 2026-11-26; runs/probes/queue.log has every line as it happens).
# Usage: bash results/readers/queue.sh results/readers/QUEUE
set -uo pipefail
queue=$1
common=(--threads 1 --batch-size 4 --lr 5e-4 --encoder-lr 5e-5 --warmup-steps 5 --seed 0
        --save-every 50 --eval-every 50 --n-eval-windows 32 --no-progress)
export OMP_NUM_THREADS=1
mkdir -p runs/probes
while true; do
  line=$(head -n 1 "$queue" 2>/dev/null || true)
  [ -z "$line" ] && break
  sed -i '1d' "$queue"
  read -r name args <<< "$line"
  out=runs/probes/$name
  lines=("$(date -Is) start $name: $args")
  echo "${lines[0]}" >> runs/probes/queue.log
  # shellcheck disable=SC2086
  if ktm pretrain "${common[@]}" $args --out-dir "$out" $( [ -d "$out/checkpoint" ] && echo --resume ) \
      > "runs/probes/$name.log" 2>&1; then
    mkdir -p "results/readers/probes/$name"
    cp "$out/metrics.jsonl" "$out/run.json" "results/readers/probes/$name/"
    lines+=("$(date -Is) done $name")
  else
    mkdir -p "results/readers/probes/$name"
    lines+=("$(date -Is) FAILED $name (see runs/probes/$name.log)")
  fi
  echo "${lines[1]}" >> runs/probes/queue.log
  printf '%s\n' "${lines[@]}" >> "results/readers/probes/$name/queue.log"
done
