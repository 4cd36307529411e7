#!/usr/bin/env bash
# Set up everything on a fresh machine, then run the CPU test suite (GPU tests skip without CUDA).
# Extra arguments go to pytest. Exits non-zero when any test fails or none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PAGODA_VENV:-.venv}/bin/python" -m pytest -q "$@"
