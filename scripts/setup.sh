#!/usr/bin/env bash
# Install what mlxcel_compat needs, idempotently: an optimized BLAS (Debian's
# libopenblas0-pthread, when we may install system packages), a virtualenv in .venv
# with the project and its test extras, and the matrix-vector shim compiled for this
# CPU (mlxcel_compat/blas_shim.c, when a C compiler is present). Sourced by serve.sh and test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MLXCEL_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 && [ "${MLXCEL_NO_APT:-0}" != "1" ]; then
    echo "setup: installing libopenblas0-pthread (optimized BLAS for MLX on CPU)" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null
  else
    echo "setup: WARNING: no optimized BLAS found and cannot install one; MLX will use the slow reference BLAS" >&2
  fi
fi

stamp="$venv/.mlxcel-installed"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$root/setup.cfg" -nt "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q -e "$root[test]"
  touch "$stamp"
fi
# Compiled into the user cache, keyed by the source and the CPU: a no-op when up to date. Without
# a C compiler it says so and the server calls the BLAS directly (slower decode; results equal
# to float32 rounding).
"$venv/bin/python" -m mlxcel_compat.blas_shim || true
