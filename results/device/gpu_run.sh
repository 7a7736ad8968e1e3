#!/usr/bin/env bash
# One call on a lent GPU machine (its own torch; ktm installed without dependencies, the pinned
# transformers / peft / tokenizers, the server's packages and the OpenAI client carried as wheels
# in .whl/). Steps, in the order STEPS names them (default: parity seven train):
#   parity   the device-aware parity suites on CUDA in fp32 and bf16 -> $OUT/parity-cuda.json
#   seven    the 7B efficiency table (the parts named in SEVEN_PARTS, gpu_bench.py's: e.g.
#            compiled-int8 and compiled-packed, int8 weights and the packed GQA attention on
#            CUDA) -> $OUT/gpu-7b-*.json
#   train    the 0.5B training throughput (the parts named in TRAIN_PARTS) -> $OUT/gpu-0.5b-*.json
#   profile  where a 0.5B training step's time goes (train_profile.py) -> $OUT/train-profile.*
#   history  the long chat at the 7B shape (results/history/ttft.py --shape), with the tokenizer
#            folder TOKENIZER (the device machine holds no embedded model; made here by
#            KTMModel.load("smollm2-135m-k4-seq").tokenizer.save_pretrained(TOKENIZER), under
#            an ignored folder the run carries), prefix cache on and off, then read ahead
#            -> $OUT/ttft-7b*.json
# Each step has its own time limit (PARITY_S, SEVEN_S, TRAIN_S, PROFILE_S, HISTORY_S seconds),
# so one that runs long leaves the others their turn; each writes its rows as it ends, and its
# log to $OUT/*.log. PARITY_SUITES names test files in place of every device-aware suite.
# Run from the repository root with OUT set; KTM_SOURCE_REVISION names the commit copied.
#   OUT=/tmp/out KTM_SOURCE_REVISION=$(git rev-parse --short HEAD) bash results/device/gpu_run.sh
#   OUT=/tmp/out STEPS="history train" TOKENIZER=.whl/tok bash results/device/gpu_run.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"

parity() {
    timeout "$(( ${PARITY_S:-200} + 20 ))" python3 results/device/parity.py "$OUT/parity-cuda.json" \
        --device cuda --limit "${PARITY_S:-200}" ${PARITY_SUITES:+--suites $PARITY_SUITES} -- -n 6 \
        > "$OUT/parity.log" 2>&1
    tail -12 "$OUT/parity.log"
}

seven() {
    timeout "${SEVEN_S:-330}" python3 results/device/gpu_bench.py "$OUT" \
        --parts ${SEVEN_PARTS:-prefill batch16 compiled} 2>&1 | tee "$OUT/bench.log"
}

train() {
    timeout "${TRAIN_S:-100}" python3 results/device/gpu_bench.py "$OUT" \
        --parts ${TRAIN_PARTS:-train} 2>&1 | tee "$OUT/train.log"
}

profile() {
    timeout "${PROFILE_S:-150}" python3 results/device/train_profile.py "$OUT" \
        > "$OUT/profile.log" 2>&1
    tail -6 "$OUT/profile.log"
}

history() {
    local chat=(python3 results/history/ttft.py --shape qwen2.5-coder-7b --device cuda
                --dtype bfloat16 --tokenizer "${TOKENIZER:?a tokenizer folder}"
                --history-budget 1024)
    timeout "${HISTORY_S:-150}" bash -c "$(printf '%q ' "${chat[@]}") --cache-mb 512 0 \
        --out $OUT/ttft-7b.json && $(printf '%q ' "${chat[@]}") --cache-mb 512 \
        --history-ahead --think-s 2 --out $OUT/ttft-7b-ahead.json" > "$OUT/history.log" 2>&1
    tail -4 "$OUT/history.log"
    # the rows' revision: the commit sent (KTM_SOURCE_REVISION), as gpu_bench.record writes it
    for f in "$OUT"/ttft-7b*.json; do
        [ -f "$f" ] && python3 -c "import json, sys; sys.path.insert(0, 'results/device')
from pathlib import Path; from gpu_bench import record
record(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[1]))" "$f"
    done
}

for step in ${STEPS:-parity seven train}; do
    echo "## step $step ($(date -u +%T))"
    "$step"
done
