#!/usr/bin/env bash
# Run the whole test suite (unit, engine and end-to-end) after installing what is missing.
# The real-model tests' file (SmolLM2-135M-Instruct, the demo's) is fetched first, once: a warm
# run fetches nothing. The suite's last line says how many real-model tests ran, or why not.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
"$venv/bin/python" -m mlxcel_compat.testing.real_model >/dev/null || echo "setup: the real model is unavailable; its tests will be skipped" >&2
# Bytecode: a run starts ~100 server processes, and each would compile the package's ~220 modules
# again where the environment sets PYTHONDONTWRITEBYTECODE (1-2 s a start on this 2-core machine).
# Compiled files go to a cache directory, never into the tree.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxcel-compat/pycache}"
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
status=0
# The default run leaves out the rest of the big test matrices (marked `slow`: every row and column
# of each still runs) and fuzzes 80 examples a route; `scripts/test.sh --slow ...` runs everything,
# 200 examples a route. A `-m` of the caller's own comes later on pytest's line and wins.
select=(-m "not slow")
args=()
for arg in "$@"; do
  if [ "$arg" = "--slow" ]; then
    select=()
    export MLXCEL_SCHEMATHESIS_EXAMPLES="${MLXCEL_SCHEMATHESIS_EXAMPLES:-200}"
  else
    args+=("$arg")
  fi
done
# Both cores (pytest-xdist), one test file per worker at a time, so a module's servers stay in one
# process (and stop with it: tests/conftest.py); `scripts/test.sh -n 0 ...` runs in one process.
MLXCEL_REAL_MODEL_REPORT="$report" "$venv/bin/python" -m pytest -n 2 --dist loadfile "${select[@]}" "${args[@]}" || status=$?
if [ -s "$report" ]; then cat "$report"; fi
exit "$status"
