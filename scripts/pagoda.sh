#!/usr/bin/env bash
# Set up everything on a fresh machine, then run the `pagoda` command with the given arguments.
# Example: scripts/pagoda.sh generate "What is the capital of France?"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
exec "${PAGODA_VENV:-.venv}/bin/pagoda" "$@"
