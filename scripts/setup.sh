#!/usr/bin/env bash
# Set up (or bring up to date) the project's virtual environment in .venv: torch, the core and
# its test extras, the example plugin, and the default model (downloaded once into the user's
# cache, outside the repository). Safe to run again: it skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PAGODA_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
stamp="$VENV/.pagoda-setup"
plugins=$(ls -d plugins/*/*/ 2>/dev/null | while read -r d; do [ -f "$d/pyproject.toml" ] && echo "$d"; done)
want=$(cat core/pyproject.toml $(ls examples/*/pyproject.toml plugins/*/*/pyproject.toml 2>/dev/null) scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "pagoda setup: installing torch, the Pagoda core and its plugins into $VENV (a few minutes; once, later runs skip it)" >&2
  # torch first: a pinned CPU build where one is at hand, else the registry's build.
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0" || "${pip[@]}" torch
  # (test brings Pillow too: the vision plugin's tests decode images.)
  "${pip[@]}" -e "core[test,vision]"
  # Transformers, pinned for the tests: the transformers plugin's coverage table and tiny configs
  # are generated against one release (plugins/models/transformers/README.md names it), so a new
  # release is taken on purpose, with them regenerated, not by whichever day the setup ran.
  "${pip[@]}" "transformers==5.25.0"
  # Schemathesis, pinned (core[test] names the same pin): the API fuzz over the server's OpenAPI
  # document (tests/server/test_schema_fuzz.py); its pytest plugin is off (pyproject.toml).
  "${pip[@]}" "schemathesis==4.32.5"
  # The plugins of this repository, each its own distribution. Their kernel libraries are
  # GPU stacks; only Triton is installed here, for its interpreter (CPU tests of the kernels).
  "${pip[@]}" triton
  # The structured-output plugin's grammar library (its matchers and CPU kernels run here too).
  "${pip[@]}" xgrammar
  # Ray, which the Ray executor plugin (pagoda-executor-ray) runs on; its tests start a local
  # cluster.
  "${pip[@]}" ray
  for plugin in $plugins; do
    "${pip[@]}" --no-deps -e "$plugin"
  done
  for ex in examples/*/; do
    [ -f "$ex/pyproject.toml" ] && "${pip[@]}" --no-deps -e "$ex"
  done
  echo "$want" > "$stamp"
fi
# The default model (SmolLM2-135M-Instruct, GGUF), fetched and converted once.
"$VENV/bin/python" -c "import logging; logging.basicConfig(level=logging.INFO, format='pagoda setup: %(message)s'); from pagoda.loader import default_model_path, convert_gguf; convert_gguf(default_model_path())"
