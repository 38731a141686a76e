#!/usr/bin/env bash
# Install what mlxcel_compat needs, idempotently: an optimized BLAS (Debian's
# libopenblas0-pthread, when we may install system packages), headless Chromium for the chat
# page's browser tests (Debian's chromium + chromium-driver, likewise), a virtualenv in .venv
# with the project and its test extras, and the matrix-vector shim compiled for this
# CPU (mlxcel_compat/blas_shim.c, when a C compiler is present). Sourced by serve.sh and test.sh.
#
# Quiet by design: one line per step that does something (nothing when all is up to date). What
# apt and pip print goes to $venv/setup.log, which the message of a failed step names.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MLXCEL_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
mkdir -p "$venv"
setup_log="$venv/setup.log"

# setup_step "what it does" command...: one line, the command's output into the log.
setup_step() {
  local what="$1"; shift
  echo "setup: $what" >&2
  echo "=== $(date -u '+%F %T') $what: $*" >>"$setup_log"
  if ! "$@" >>"$setup_log" 2>&1; then
    echo "setup: FAILED: $what (full log: $setup_log)" >&2
    tail -n 15 "$setup_log" | sed 's/^/  | /' >&2
    exit 1
  fi
}

if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 && [ "${MLXCEL_NO_APT:-0}" != "1" ]; then
    setup_step "installing libopenblas0-pthread (optimized BLAS for MLX on CPU)" \
      env DEBIAN_FRONTEND=noninteractive sh -c 'apt-get update -qq && apt-get install -y -qq libopenblas0-pthread'
  else
    echo "setup: WARNING: no optimized BLAS found and cannot install one; MLX will use the slow reference BLAS" >&2
  fi
fi

# Headless Chromium and its WebDriver for the chat page's browser tests (tests/test_e2e_webui.py,
# which skip with the reason when they are missing). Installed the same way as OpenBLAS.
if [ "$(uname -s)" = "Linux" ] && ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 && [ "${MLXCEL_NO_APT:-0}" != "1" ]; then
    setup_step "installing chromium and chromium-driver (browser tests of the chat page)" \
      env DEBIAN_FRONTEND=noninteractive sh -c 'apt-get update -qq && apt-get install -y -qq chromium chromium-driver'
  else
    echo "setup: note: no chromium/chromedriver and cannot install them; the chat page's browser tests will skip" >&2
  fi
fi

stamp="$venv/.mlxcel-installed"
if [ ! -x "$venv/bin/python" ]; then
  setup_step "creating the virtualenv $venv" "$python" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$root/setup.cfg" -nt "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  # pip's warnings (index locations of this machine's pip config, setuptools' deprecation blocks)
  # stay in the log; PIP_DISABLE_PIP_VERSION_CHECK keeps the upgrade nag out of it too.
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  setup_step "upgrading pip" "$venv/bin/python" -m pip install -q --upgrade pip
  setup_step "installing mlxcel_compat and its test dependencies into $venv (a few minutes the first time)" \
    "$venv/bin/python" -m pip install -q -e "$root[test]"
  # Vision-language models (model/vision.py) run on mlx-vlm's model classes. Its own metadata
  # pulls opencv, datasets, mlx-audio, fastapi and more that the classes used here never import,
  # so it goes in without them (setup.cfg's `vision` extra is the same pin with them).
  setup_step "installing mlx-vlm 0.7.10 (vision models; without its optional heavy dependencies)" \
    "$venv/bin/python" -m pip install -q --no-deps "mlx-vlm==0.7.10"
  touch "$stamp"
fi
# ggml's CPU kernels (quantized GGUF weights, model/ggml_cpu.py) built for this CPU: the PyPI
# wheel is compiled for AVX2 (and its libggml-base for plain x86-64); built from the same
# version's sdist with GGML_NATIVE it uses AVX-512/VNNI where the CPU has them, and its repacked
# int8 GEMM (model/ggml_repack.py). scripts/bench_ggml_build.py measures both builds on the same
# tensors. About a minute; redone when the CPU's flags or the pin change.
# MLXCEL_GGML_NATIVE=0 keeps the prebuilt wheel; without a C++ compiler it is kept too.
ggml_pin="$(grep -o 'libggml-python==[^;[:space:]]*' "$root/setup.cfg" | head -n 1)"
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && [ -n "$ggml_pin" ] && [ "${MLXCEL_GGML_NATIVE:-1}" != "0" ]; then
  if command -v c++ >/dev/null 2>&1; then
    want="$ggml_pin $(grep -m 1 '^flags' /proc/cpuinfo | md5sum | cut -c1-16)"
    native_stamp="$venv/.ggml-native"
    if [ ! -f "$native_stamp" ] || [ "$(cat "$native_stamp")" != "$want" ] || [ "$stamp" -nt "$native_stamp" ]; then
      setup_step "building ggml's CPU kernels for this CPU ($ggml_pin from its sdist, GGML_NATIVE; about a minute)" \
        "$venv/bin/python" -m pip install -q --no-deps --force-reinstall --no-cache-dir \
        --no-binary libggml-python -C cmake.define.GGML_NATIVE=ON "$ggml_pin"
      echo "$want" >"$native_stamp"
    fi
  else
    echo "setup: note: no C++ compiler; ggml's kernels stay the prebuilt AVX2 wheel's" >&2
  fi
fi
# Compiled into the user cache, keyed by the source and the CPU: a no-op when up to date. Without
# a C compiler it says so and the server calls the BLAS directly (slower decode; results equal
# to float32 rounding).
"$venv/bin/python" -m mlxcel_compat.blas_shim --quiet || true
