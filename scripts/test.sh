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
# One process: with pytest-xdist (`scripts/test.sh -n 2 --dist loadfile`) every worker keeps its
# own copy of the session's servers, which ran a 24 GiB machine out of memory.
MLXCEL_REAL_MODEL_REPORT="$report" "$venv/bin/python" -m pytest "$@" || status=$?
if [ -s "$report" ]; then cat "$report"; fi
exit "$status"
