#!/usr/bin/env bash
# Quick start: install what is missing, then serve. With no -m, the generated tiny demo model.
# Any llama-server flag or LLAMA_ARG_* variable works: scripts/serve.sh -m /path/to/model --port 8080
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
exec "$venv/bin/mlxcel-server" "$@"
