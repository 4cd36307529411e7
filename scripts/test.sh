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
# Two processes, a test module each at a time, each running torch on one thread: on the CI
# machine's two cores the suite took 888 s where one process took 1,166 - 1,320. Arguments that
# choose the processes themselves (-n, --numprocesses, --dist, -p no:xdist) win;
# PAGODA_TEST_WORKERS=0 runs one process.
parallel=()
workers="${PAGODA_TEST_WORKERS:-2}"
chosen=0
for arg in "$@"; do
  case "$arg" in -n*|--numprocesses*|--dist*|no:xdist) chosen=1 ;; esac
done
if [ "$workers" != 0 ] && [ "$chosen" = 0 ]; then
  parallel=(-n "$workers" --dist loadfile)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec "${PAGODA_VENV:-.venv}/bin/python" -m pytest -q ${parallel[@]+"${parallel[@]}"} "$@"
