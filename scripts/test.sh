#!/usr/bin/env bash
# Set up everything on a fresh machine, check the core's import floors, then run the CPU test
# suite (GPU tests skip without CUDA).
# Extra arguments go to pytest. Exits non-zero when any test fails or none ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The core's floors (.importlinter, docs/architecture.md): a module imports only from its own
# floor and below, the scheduler and the worker not each other, and no package cycle.
"${PAGODA_VENV:-.venv}/bin/lint-imports" --no-cache
exec "${PAGODA_VENV:-.venv}/bin/python" -m pytest -q "$@"
