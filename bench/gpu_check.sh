#!/usr/bin/env bash
# The one-shot GPU check (bench/gpu_check.py says what each section checks): about 5 minutes by estimate on one GPU,
# 8.8 at the most (each section has its own limit, and they add up to less than this script's), unbuffered output,
# a summary written whatever happens, and printed last. Where $OUT is set (the lent GPU machine: only $OUT and the
# output's tail come back), the JSON and the whole log go there: $OUT/gpu_check.json, $OUT/gpu_check.log.
#   bash bench/gpu_check.sh               # on a GPU
#   bash bench/gpu_check.sh --dry-run     # on a CPU first: every section that can run there, small
set -uo pipefail
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then  # before anything runs
    echo "usage: bash bench/gpu_check.sh [--dry-run] [--sections LETTERS] [--json FILE]"
    sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
py=$(command -v python3 || command -v python)  # the GPU machine's image has python3 and no python
limit=530
if [[ " $* " == *" --dry-run "* ]]; then
    limit=1500  # a 2-core CPU compiles and runs slower; the sections' limits are three times a GPU's there
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
if [[ -n "${OUT:-}" ]]; then
    if ! mkdir -p "$OUT" 2>/dev/null || [[ ! -w "$OUT" ]]; then
        echo "error: OUT=$OUT: cannot make or write that folder" >&2
        exit 1
    fi
    # appended: a rerun of some sections (--sections) keeps the earlier run's log, as the JSON keeps its results
    timeout --kill-after=20 "$limit" "$py" -u bench/gpu_check.py "$@" 2>&1 | tee -a "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
exec timeout --kill-after=20 "$limit" "$py" -u bench/gpu_check.py "$@"
