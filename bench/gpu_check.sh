#!/usr/bin/env bash
# The one-shot GPU check (bench/gpu_check.py says what each section checks): under 10 minutes on one GPU, each
# section with its own time limit, unbuffered output, results also in runs/gpu_check.json (--json PATH).
#   bash bench/gpu_check.sh               # on a GPU
#   bash bench/gpu_check.sh --dry-run     # on a CPU first: every section that can run there, under 3 minutes
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " != *" --dry-run "* ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec timeout 590 python -u bench/gpu_check.py "$@"
