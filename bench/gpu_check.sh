#!/usr/bin/env bash
# The GPU check (issue: under 5 minutes on one GPU): bf16 parity with transformers, train tokens/s and peak memory
# against the original-style step, embed sentences/s against sentence-transformers.
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout 290 python bench/gpu_check.py
