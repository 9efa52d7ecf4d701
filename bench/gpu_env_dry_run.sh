#!/usr/bin/env bash
# The GPU check's dry run under the lent GPU machine's own Python and packages, on a CPU: Python 3.12, torch 2.11.0
# (its CUDA wheel, which runs on a CPU), triton 3.6.0, tokenizers 0.23.2, safetensors 0.8.0, huggingface_hub 1.33.0,
# numpy 2.5.2, sentence-transformers 6.0.1 and transformers 5.17.0 (the device tool's KINDS.md). As there, ../shared
# is not seen unless DECLUTR_SHARED names bench/gpu_assets.py's folder (else the documents are Python's docstrings,
# and g and j use a random model) and the results go under $OUT. Not run by CI: the venv is about 5 GB.
#   bash bench/gpu_env_dry_run.sh                  # venv in ~/.cache/declutr/venv-gpu-machine, made once
#   VENV=/tmp/v bash bench/gpu_env_dry_run.sh --sections ad
set -euo pipefail
if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then  # before any venv is made
    echo "usage: [VENV=DIR] [OUT=DIR] bash bench/gpu_env_dry_run.sh [gpu_check.py's flags: --sections LETTERS ...]"
    sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
venv=${VENV:-$HOME/.cache/declutr/venv-gpu-machine}
if [[ ! -x "$venv/bin/python3" ]]; then
    py312=""  # the first that runs: pyenv's shim for python3.12 exists even where no 3.12 is selected
    for candidate in python3.12 "$HOME"/.pyenv/versions/3.12.*/bin/python3; do
        if "$candidate" -c "" 2>/dev/null; then py312=$candidate; break; fi
    done
    [[ -n "$py312" ]] || { echo "no Python 3.12 here (pyenv install 3.12, or put python3.12 on PATH)" >&2; exit 1; }
    "$py312" -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.11.0 triton==3.6.0 tokenizers==0.23.2 safetensors==0.8.0 \
        huggingface_hub==1.33.0 numpy==2.5.2
fi
if ! "$venv/bin/python3" -c "import sentence_transformers" 2>/dev/null; then  # section j's other side
    "$venv/bin/pip" install -q sentence-transformers==6.0.1 transformers==5.17.0 torch==2.11.0 numpy==2.5.2
fi
"$venv/bin/python3" -c "import torch, sys; print(f'python {sys.version.split()[0]}, torch {torch.__version__}')"
out=${OUT:-$(mktemp -d)}
cache=$(mktemp -d)  # compile caches start empty, as on a freshly lent machine
trap 'rm -rf "$cache"' EXIT
echo "results and log in $out"
PATH="$venv/bin:$PATH" OUT="$out" DECLUTR_SHARED="${DECLUTR_SHARED:-$out/no-shared-assets}" TORCHINDUCTOR_CACHE_DIR="$cache" \
    TRITON_CACHE_DIR="$cache" bash bench/gpu_check.sh --dry-run "$@"
