"""The BLAS set-up that runs before MLX: which library, and which OpenBLAS kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxcel_compat.runtime.backend import OPENBLAS_SPIN_EXPONENT, cpu_flags, load_optimized_blas, openblas_kernels_for_cpu

AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}


def test_kernels_follow_the_cpu_flags() -> None:
    assert openblas_kernels_for_cpu(AVX512 | {"avx2", "fma", "sse3"}) == "SkylakeX"
    assert openblas_kernels_for_cpu({"avx2", "fma", "sse3"}) == "Haswell"
    assert openblas_kernels_for_cpu({"avx512f", "avx2", "fma"}) == "Haswell"  # AVX-512 without BW/DQ/VL
    assert openblas_kernels_for_cpu({"sse3", "avx"}) is None  # leave the choice to OpenBLAS


def in_fresh_process(code: str, env: dict[str, str]) -> dict:
    """The JSON that ``code`` prints, run by a new interpreter with ``env`` (the BLAS is set up
    once a process, before MLX)."""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def blas_in_fresh_process(env: dict[str, str]) -> dict:
    return in_fresh_process(
        "import json, os\n"
        "from mlxcel_compat.runtime.backend import load_optimized_blas\n"
        "info = load_optimized_blas()\n"
        "print(json.dumps({'name': info.name, 'kernels': info.kernels, 'forced': info.kernels_forced,"
        " 'env': os.environ.get('OPENBLAS_CORETYPE')}))\n",
        env,
    )


needs_openblas = pytest.mark.skipif(
    load_optimized_blas().name != "openblas" or openblas_kernels_for_cpu(cpu_flags()) is None,
    reason="needs OpenBLAS (scripts/setup.sh installs it) on an x86-64 CPU with AVX2 or AVX-512",
)


@needs_openblas
def test_openblas_runs_the_kernels_the_cpu_supports() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    info = blas_in_fresh_process(env)
    expected = openblas_kernels_for_cpu(cpu_flags())
    assert info == {"name": "openblas", "kernels": expected, "forced": True, "env": expected}


@needs_openblas
def test_a_kernel_choice_made_by_the_user_is_kept() -> None:
    info = blas_in_fresh_process({**os.environ, "OPENBLAS_CORETYPE": "Haswell"})
    assert info == {"name": "openblas", "kernels": "Haswell", "forced": False, "env": "Haswell"}


def idle_cpu_after_a_gemm(env: dict[str, str]) -> dict:
    """In a fresh process: OPENBLAS_THREAD_TIMEOUT as loaded, and the CPU seconds the process
    spends in the 0.1 s after a threaded GEMM, while its caller sleeps (OpenBLAS's threads
    spinning for the next call)."""
    return in_fresh_process(
        "import json, os, time, numpy as np\n"
        "from mlxcel_compat.runtime import backend\n"
        "backend.load_optimized_blas()\n"
        "sgemm = backend.cblas_sgemm()\n"
        "a = np.ones((512, 512), np.float32); c = np.empty_like(a)\n"
        "for _ in range(3): sgemm(101, 111, 111, 512, 512, 512, 1.0, a.ctypes.data, 512, a.ctypes.data, 512, 0.0, c.ctypes.data, 512)\n"
        "t = os.times(); time.sleep(0.1); u = os.times()\n"
        "print(json.dumps({'env': os.environ.get('OPENBLAS_THREAD_TIMEOUT'), 'cpu': u.user + u.system - t.user - t.system, 'c': float(c[0, 0])}))\n",
        env,
    )


@needs_openblas
def test_openblas_threads_do_not_spin_between_calls() -> None:
    """OpenBLAS's threads wait for the next call spinning for 2 ** OPENBLAS_THREAD_TIMEOUT cycles
    (its default, 28, is ~0.1 s on every core): the set-up cuts that to OPENBLAS_SPIN_EXPONENT
    so the shim's threads get the cores between GEMMs, and keeps a value the user chose."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    ours = idle_cpu_after_a_gemm(env)
    assert ours["env"] == str(OPENBLAS_SPIN_EXPONENT) and ours["c"] == 512.0
    assert ours["cpu"] < 0.03  # the 0.1 s sleep costs (almost) no CPU
    assert idle_cpu_after_a_gemm({**env, "OPENBLAS_THREAD_TIMEOUT": "20"})["env"] == "20"


_FREED_BY_A_THREAD = """
import json, threading
import numpy as np
from mlxcel_compat.runtime import backend
mapped = backend.map_big_allocations() if {fix} else False

def anon():
    return next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('RssAnon')) / 1024

def work():
    big = np.ones(8 << 20, np.uint8)  # mapped, then freed: glibc raises its threshold to 8 MiB
    del big
    blocks = [np.ones(1 << 20, np.uint8) for _ in range(40)]  # 40 MiB of 1 MiB blocks
    del blocks

before = anon()
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(json.dumps({{'mapped': mapped, 'kept': anon() - before}}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_megabyte_blocks_a_thread_frees_leave_the_process() -> None:
    """With ``map_big_allocations`` (the server sets it at start-up) blocks freed by a thread
    leave the process; with glibc's default, its dynamic threshold puts them in the thread's
    arena, which keeps them (the engine thread kept ~30 MiB after loading a small model)."""
    fixed = in_fresh_process(_FREED_BY_A_THREAD.format(fix=True), dict(os.environ))
    default = in_fresh_process(_FREED_BY_A_THREAD.format(fix=False), dict(os.environ))
    assert fixed["mapped"] and fixed["kept"] < 4
    assert default["kept"] > 30  # what the setting is for: without it the 40 MiB stay
