#!/usr/bin/env bash
# Run the whole test suite (unit, engine and end-to-end) after installing what is missing.
# The real-model tests' file (SmolLM2-135M-Instruct, the demo's) is fetched first, once: a warm
# run fetches nothing. The suite's last line says how many real-model tests ran, or why not.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
"$venv/bin/python" -m mlxcel_compat.testing.real_model >/dev/null || echo "setup: the real model is unavailable; its tests will be skipped" >&2
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
status=0
# Both cores (pytest-xdist), one test file per worker at a time, so a module's servers stay in one
# process (and stop with it: tests/conftest.py); `scripts/test.sh -n 0 ...` runs in one process.
MLXCEL_REAL_MODEL_REPORT="$report" "$venv/bin/python" -m pytest -n 2 --dist loadfile "$@" || status=$?
if [ -s "$report" ]; then cat "$report"; fi
exit "$status"
