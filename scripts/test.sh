#!/usr/bin/env bash
# Run the whole test suite (unit, engine and end-to-end) after installing what is missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
exec "$venv/bin/python" -m pytest "$@"
