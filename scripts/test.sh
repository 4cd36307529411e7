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
# PAGODA_TEST_WORKERS=2 runs the suite in two processes, a test module each at a time, each with
# one torch thread: on two cores it took 775 - 888 s where one process took 1,166 - 1,320, but on
# a 24 GiB machine it once reached Ray's memory limit (95%) and Ray killed a test's workers, so one
# process stays the default. Arguments that choose the processes (-n, --numprocesses, --dist,
# -p no:xdist) win.
parallel=()
workers="${PAGODA_TEST_WORKERS:-0}"
chosen=0
for arg in "$@"; do
  case "$arg" in -n*|--numprocesses*|--dist*|no:xdist) chosen=1 ;; esac
done
if [ "$workers" != 0 ] && [ "$chosen" = 0 ]; then
  parallel=(-n "$workers" --dist loadfile)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec "${PAGODA_VENV:-.venv}/bin/python" -m pytest -q ${parallel[@]+"${parallel[@]}"} "$@"
