#!/usr/bin/env bash
# The one-shot GPU check (bench/gpu_check.py says what each section checks): about 4 minutes by estimate on one GPU,
# 8 at the most (each section has its own limit, and they add up to less than this script's), unbuffered output,
# results also in runs/gpu_check.json (--json PATH), a summary written whatever happens.
#   bash bench/gpu_check.sh               # on a GPU
#   bash bench/gpu_check.sh --dry-run     # on a CPU first: every section that can run there, small
set -euo pipefail
cd "$(dirname "$0")/.."
limit=480
if [[ " $* " == *" --dry-run "* ]]; then
    limit=1500  # a 2-core CPU compiles and runs slower; the sections' limits are three times a GPU's there
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec timeout --kill-after=20 "$limit" python -u bench/gpu_check.py "$@"
