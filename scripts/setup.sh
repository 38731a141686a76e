#!/usr/bin/env bash
# Install what mlxcel_compat needs, idempotently: an optimized BLAS (Debian's
# libopenblas0-pthread, when we may install system packages), headless Chromium for the chat
# page's browser tests (Debian's chromium + chromium-driver, likewise), a virtualenv in .venv
# with the project and its test extras, and the matrix-vector shim compiled for this
# CPU (mlxcel_compat/runtime/native/blas_shim.c, when a C compiler is present). Sourced by serve.sh and test.sh.
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

# Headless Chromium and its WebDriver for the chat page's browser tests (tests/e2e/test_webui.py,
# which skip with the reason when they are missing). Installed the same way as OpenBLAS.
if [ "$(uname -s)" = "Linux" ] && ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 && [ "${MLXCEL_NO_APT:-0}" != "1" ]; then
    setup_step "installing chromium and chromium-driver (browser tests of the chat page)" \
      env DEBIAN_FRONTEND=noninteractive sh -c 'apt-get update -qq && apt-get install -y -qq chromium chromium-driver'
  else
    echo "setup: note: no chromium/chromedriver and cannot install them; the chat page's browser tests will skip" >&2
  fi
fi

# The openssl command makes the TLS test's self-signed certificate (tests/e2e/test_deployment_flags.py).
if [ "$(uname -s)" = "Linux" ] && ! command -v openssl >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 && [ "${MLXCEL_NO_APT:-0}" != "1" ]; then
    setup_step "installing openssl (the TLS test's certificate)" \
      env DEBIAN_FRONTEND=noninteractive sh -c 'apt-get update -qq && apt-get install -y -qq openssl'
  else
    echo "setup: WARNING: no openssl command and cannot install it; the TLS test will fail" >&2
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
  # Vision-language models (vision/model.py) run on mlx-vlm's model classes. Its own metadata
  # pulls opencv, datasets, mlx-audio, fastapi and more that the classes used here never import,
  # so it goes in without them (setup.cfg's `vision` extra is the same pin with them).
  setup_step "installing mlx-vlm 0.7.10 (vision models; without its optional heavy dependencies)" \
    "$venv/bin/python" -m pip install -q --no-deps "mlx-vlm==0.7.10"
  touch "$stamp"
fi
# ggml's CPU kernels (quantized GGUF weights, runtime/ggml_cpu.py) built for this CPU into
# $venv/ggml (lib/, include/), which runtime/ggml_cpu.py prefers to the libggml-python wheel's
# (0.20, compiled for AVX2: the fallback without a C++ compiler). The source is the ggml that
# llama.cpp b11312 vendors (0.25), taken from the PyPI sdist llama-cpp-python 0.3.36 (only
# downloaded and unpacked, never installed): its tiled K-quant kernels multiply prompt chunks
# 2-4x faster than 0.20's (runtime/ggml_repack.py: prompt_product). Built as
# ../shared/peers/build-llama-server.sh builds llama-server: this CPU's AVX-512/VNNI flags,
# AMX off (these VMs report AMX, whose instructions fault). About a minute (cmake comes from
# PyPI when the system has none); redone when the CPU's flags or the source change.
# MLXCEL_GGML_BUILD=0 keeps the wheel's.
ggml_source="llama-cpp-python==0.3.36"
# The sdist itself is kept in $venv/sdist: besides ggml's source it holds llama.cpp's 71 real chat
# templates (vendor/llama.cpp/models/templates), which the chat tests extract at test time
# (tests/chat/conftest.py); they are read from it, never committed.
sdist_dir="$venv/sdist"
if ! ls "$sdist_dir"/llama_cpp_python-0.3.36.tar.gz >/dev/null 2>&1; then
  setup_step "downloading the $ggml_source sdist (ggml's source, llama.cpp's chat templates for the tests)" \
    "$venv/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$sdist_dir" "$ggml_source"
fi
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && [ "${MLXCEL_GGML_BUILD:-1}" != "0" ]; then
  if command -v c++ >/dev/null 2>&1 && command -v cc >/dev/null 2>&1; then
    flags="$(grep -m 1 '^flags' /proc/cpuinfo)"
    want="$ggml_source $(echo "$flags" | md5sum | cut -c1-16)"
    ggml_stamp="$venv/ggml/.built"
    if [ ! -f "$ggml_stamp" ] || [ "$(cat "$ggml_stamp")" != "$want" ]; then
      build_ggml() {
        local work cmake=cmake src
        work="$(mktemp -d)" || return 1
        trap "rm -rf '$work'; trap - RETURN" RETURN
        if ! command -v cmake >/dev/null 2>&1; then
          "$venv/bin/python" -m pip install -q cmake || return 1
          cmake="$venv/bin/cmake"
        fi
        tar -xzf "$sdist_dir"/llama_cpp_python-0.3.36.tar.gz -C "$work" || return 1
        src="$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)" || return 1
        has() { case " $flags " in *" $1 "*) echo ON;; *) echo OFF;; esac; }
        "$cmake" -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
          -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
          -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF \
          -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)" \
          -DGGML_BMI2="$(has bmi2)" -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512_vbmi)" \
          -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)" \
          -DGGML_AVX_VNNI="$(has avx_vnni)" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
          -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' || return 1
        "$cmake" --build "$work/build" --target ggml-base ggml-cpu ggml -j"$(nproc)" || return 1
        rm -rf "$venv/ggml" && mkdir -p "$venv/ggml/lib" || return 1
        cp -a "$work"/build/bin/libggml*.so* "$venv/ggml/lib/" || return 1
        cp -r "$src/ggml/include" "$venv/ggml/include" || return 1
        echo "$want" >"$ggml_stamp"
      }
      setup_step "building ggml 0.25's CPU kernels for this CPU (from the $ggml_source sdist; about a minute)" build_ggml
    fi
  else
    echo "setup: note: no C/C++ compiler; ggml's kernels stay the prebuilt libggml-python wheel's" >&2
  fi
fi
# Compiled into the user cache, keyed by the source and the CPU: a no-op when up to date. Without
# a C compiler it says so and the server calls the BLAS directly (slower decode; results equal
# to float32 rounding).
"$venv/bin/python" -m mlxcel_compat.runtime.native.blas_shim --quiet || true
