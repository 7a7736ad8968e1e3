#!/usr/bin/env bash
# One call on a lent GPU machine (its own torch; ktm installed without dependencies, the pinned
# transformers / peft / tokenizers and the server's packages carried as wheels in .whl/):
#   1. the device-aware parity suites on CUDA in fp32 and bf16 -> $OUT/parity-cuda.json
#   2. the 7B efficiency table (the parts named in SEVEN_PARTS) -> $OUT/gpu-7b-*.json
#   3. the 0.5B training throughput (the parts named in TRAIN_PARTS) -> $OUT/gpu-0.5b-*.json
# Each step has its own time limit (PARITY_S, SEVEN_S, TRAIN_S seconds), so one that runs long
# leaves the others their turn; each writes its rows as it ends, and its log to $OUT/*.log.
# PARITY_SUITES names test files in place of every device-aware suite.
# Run from the repository root with OUT set; KTM_SOURCE_REVISION names the commit copied.
#   OUT=/tmp/out KTM_SOURCE_REVISION=$(git rev-parse --short HEAD) bash results/device/gpu_run.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"
timeout "$(( ${PARITY_S:-200} + 20 ))" python3 results/device/parity.py "$OUT/parity-cuda.json" \
    --device cuda --limit "${PARITY_S:-200}" ${PARITY_SUITES:+--suites $PARITY_SUITES} -- -n 6 \
    > "$OUT/parity.log" 2>&1
tail -12 "$OUT/parity.log"
timeout "${SEVEN_S:-330}" python3 results/device/gpu_bench.py "$OUT" \
    --parts ${SEVEN_PARTS:-prefill batch16 compiled} 2>&1 | tee "$OUT/bench.log"
timeout "${TRAIN_S:-100}" python3 results/device/gpu_bench.py "$OUT" \
    --parts ${TRAIN_PARTS:-train} 2>&1 | tee "$OUT/train.log"
