"""The cblas_sgemm shim (blas_shim.c): same results as the BLAS on every call shape, really used by
MLX in a fresh process, and a safe fallback when it cannot be built or is switched off.

Agreement: the shim's kernel and cblas_sgemv sum in another order than OpenBLAS's sgemm, so
results agree to float32 rounding: |shim - sgemm| <= RTOL * sum_k |a_mk * b_kn| per element.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_compat.runtime import backend
from mlxcel_compat.runtime.native import blas_shim
from tests.conftest import REPO_ROOT, tiny_model

RTOL = 1e-5

ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112

needs_shim = pytest.mark.skipif(
    backend.matmul_shim() is None,
    reason=f"no shim in this process: {backend.load_optimized_blas().matmul_route}",
)

f32p = ctypes.POINTER(ctypes.c_float)
SGEMM_ARGS = [ctypes.c_int] * 6 + [ctypes.c_float, f32p, ctypes.c_int, f32p, ctypes.c_int, ctypes.c_float, f32p, ctypes.c_int]


def blas_sgemm():
    """OpenBLAS's own cblas_sgemm (what the shim forwards to), looked up in the library itself."""
    fn = ctypes.CDLL(backend.load_optimized_blas().path).cblas_sgemm
    fn.argtypes = SGEMM_ARGS
    return fn


def shim_sgemm():
    fn = backend.matmul_shim().lib.cblas_sgemm
    fn.argtypes = SGEMM_ARGS
    return fn


def ptr(a: np.ndarray):
    return a.ctypes.data_as(f32p)


def operand(rng, rows: int, cols: int, ld: int) -> np.ndarray:
    """A row-major rows x cols matrix stored with leading dimension ld >= cols (padding = NaN,
    which must never be read)."""
    store = np.full((rows, ld), np.nan, dtype=np.float32)
    store[:, :cols] = rng.standard_normal((rows, cols), dtype=np.float32)
    return store


def call(fn, order, ta, tb, M, N, K, alpha, beta, seed=0, pad=0, c_init=None):
    """C = alpha op(A) op(B) + beta C through ``fn``; returns (C, reference error bound)."""
    rng = np.random.default_rng(seed)
    if order == COL_MAJOR:  # a column-major R x C matrix is a row-major C x R one
        a_shape = (M, K) if ta == TRANS else (K, M)
        b_shape = (K, N) if tb == TRANS else (N, K)
        c_shape = (N, M)
    else:
        a_shape = (K, M) if ta == TRANS else (M, K)
        b_shape = (N, K) if tb == TRANS else (K, N)
        c_shape = (M, N)
    A = operand(rng, *a_shape, a_shape[1] + pad)
    B = operand(rng, *b_shape, b_shape[1] + pad)
    C = operand(rng, *c_shape, c_shape[1] + pad) if c_init is None else c_init.copy()
    fn(order, ta, tb, M, N, K, alpha, ptr(A), A.shape[1], ptr(B), B.shape[1], beta, ptr(C), C.shape[1])
    return C[:, : c_shape[1]]


SHAPES = [(1, 64, 16), (1, 1000, 17), (1, 33, 1), (2, 40, 768), (3, 257, 64), (4, 300, 100), (5, 8, 33),
          (16, 96, 64), (17, 50, 20), (40, 1, 30), (1, 1, 5), (7, 1, 300)]


@needs_shim
@pytest.mark.parametrize("route", [blas_shim.ROUTE_GEMV, blas_shim.ROUTE_KERNEL])
@pytest.mark.parametrize("order,ta,tb", list(itertools.product([ROW_MAJOR, COL_MAJOR], [NO_TRANS, TRANS], [NO_TRANS, TRANS])))
def test_every_call_shape_agrees_with_the_blas(route, order, ta, tb) -> None:
    shim = backend.matmul_shim()
    ours, theirs = shim_sgemm(), blas_sgemm()
    try:
        shim.configure(route=route)
        for (M, N, K), (alpha, beta), pad in itertools.product(SHAPES, [(1.0, 0.0), (0.5, 1.0), (2.0, -0.25)], [0, 3]):
            args = (order, ta, tb, M, N, K, alpha, beta)
            got, want = call(ours, *args, pad=pad), call(theirs, *args, pad=pad)
            bound = abs(alpha) * K * 4.0 * RTOL + 1e-6  # |a|,|b| ~ N(0,1): sum_k |a b| ~ K
            assert np.isfinite(got).all(), (args, pad)
            assert np.abs(got - want).max() <= bound, (args, pad, np.abs(got - want).max())
    finally:
        shim.configure(route=blas_shim.ROUTE_KERNEL)


@needs_shim
def test_beta_zero_never_reads_the_output() -> None:
    """BLAS semantics: with beta = 0, C is written, not read (MLX hands over uninitialised memory)."""
    for M, N, K in ((1, 100, 64), (3, 100, 64), (40, 1, 64), (1, 1, 64)):
        garbage = np.full((M, N), np.nan, dtype=np.float32)
        got = call(shim_sgemm(), ROW_MAJOR, NO_TRANS, TRANS, M, N, K, 1.0, 0.0, c_init=garbage)
        want = call(blas_sgemm(), ROW_MAJOR, NO_TRANS, TRANS, M, N, K, 1.0, 0.0)
        assert np.isfinite(got).all()
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4)


@needs_shim
def test_mlx_matmuls_agree_with_float64() -> None:
    """Through MLX, as the model calls it: x @ W.T (linear layers) and x @ W, every row count
    around the kernel's limit, against a float64 reference."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 200)).astype(np.float32)
    for M in (1, 2, 3, 4, 5, 8, 15, 16, 17, 33):
        x = rng.standard_normal((M, 200)).astype(np.float32)
        want = x.astype(np.float64) @ w.astype(np.float64).T
        got = np.array(mx.array(x) @ mx.array(w).T)
        assert np.abs(got - want).max() <= 200 * 4 * RTOL, M
        got_nn = np.array(mx.array(x) @ mx.array(w.T.copy()))
        assert np.abs(got_nn - want).max() <= 200 * 4 * RTOL, M


@needs_shim
def test_a_batched_row_is_bit_identical_to_the_row_alone() -> None:
    """The kernel sums each element in the same order whatever the row count: batched decode rows
    (and prefill rows) equal the lone computation bit for bit."""
    rng = np.random.default_rng(2)
    w = mx.array(rng.standard_normal((1000, 768)).astype(np.float32))
    x = mx.array(rng.standard_normal((16, 768)).astype(np.float32))
    for M in (2, 3, 5, 8, 16):
        batched = x[:M] @ w.T
        for i in range(M):
            assert mx.array_equal(batched[i], (x[i : i + 1] @ w.T)[0]), (M, i)
    # Columns too: an output reduced in a block of four equals the same output reduced alone.
    full = x[:3] @ w.T
    for j in (0, 1, 2, 3, 517, 999):
        assert mx.array_equal(full[:, j], (x[:3] @ w[j : j + 1].T)[:, 0]), j
    # And x @ v (v not transposed: attention's probabilities @ values), with a column tail.
    v = mx.array(rng.standard_normal((768, 100)).astype(np.float32))
    for M in (2, 3, 7):
        batched = x[:M] @ v
        for i in range(M):
            assert mx.array_equal(batched[i], (x[i : i + 1] @ v)[0]), (M, i)


@needs_shim
def test_concurrent_callers_get_correct_results() -> None:
    """Two threads in the shim at once: one gets the worker threads, the other computes alone."""
    ours = shim_sgemm()
    results: dict[int, bool] = {}

    def run(seed: int) -> None:
        ok = True
        for _ in range(20):
            got = call(ours, ROW_MAJOR, NO_TRANS, TRANS, 8, 512, 768, 1.0, 0.0, seed=seed)
            rng = np.random.default_rng(seed)
            a = rng.standard_normal((8, 768), dtype=np.float32)
            b = rng.standard_normal((512, 768), dtype=np.float32)
            ok &= bool(np.abs(got - a.astype(np.float64) @ b.astype(np.float64).T).max() <= 768 * 4 * RTOL)
        results[seed] = ok

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (3, 4, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {3: True, 4: True, 5: True}


def _python_progress_during(fn) -> int:
    """How many times another Python thread ran its loop while ``fn`` (one long sgemm through
    the shim) ran on this one. The switch interval is raised so that this thread, once it holds
    the GIL, gives it up only where the call itself does."""
    count, stop, started = [0], threading.Event(), threading.Event()

    def spin() -> None:
        started.set()
        while not stop.is_set():
            count[0] += 1

    a = np.ones((512, 1024), np.float32)
    b = np.ones((1024, 1024), np.float32)
    c = np.empty((512, 1024), np.float32)
    previous = sys.getswitchinterval()
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    started.wait()
    sys.setswitchinterval(0.5)
    try:
        for _ in range(3):
            before = count[0]  # this thread holds the GIL from here to the call
            fn(ROW_MAJOR, NO_TRANS, TRANS, 512, 1024, 1024, 1.0, ptr(a), 1024, ptr(b), 1024, 0.0, ptr(c), 1024)
            progress = count[0] - before
    finally:
        sys.setswitchinterval(previous)
        stop.set()
        thread.join()
    assert c[0, 0] == 1024.0
    return progress


@needs_shim
def test_the_held_view_keeps_the_gil_for_the_call_and_the_plain_one_gives_it_up() -> None:
    """``holding_the_gil``: the same library's functions, called without releasing the GIL (a
    decode step's short calls: no other thread's Python can delay their return). The plain
    view releases it, so the other thread runs during the call."""
    lib = backend.matmul_shim().lib
    held = blas_shim.holding_the_gil(lib)
    assert held._handle == lib._handle
    held_sgemm = held.cblas_sgemm
    held_sgemm.argtypes = SGEMM_ARGS
    assert _python_progress_during(held_sgemm) == 0
    assert _python_progress_during(shim_sgemm()) > 0


CHILD = """
import ctypes, json, os, sys
import numpy as np
from mlxcel_compat.runtime import backend
info = backend.load_optimized_blas()
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlxcel_compat.model.loader import load_model
model = load_model(sys.argv[1], []).model
cache = make_prompt_cache(model)
mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=cache))
logits = model(mx.array([[7]]), cache=cache)
mx.eval(logits)
# The shim's worker threads do not survive a fork: a forked child must compute (with its own).
a, b = np.ones((4, 4096), np.float32), np.ones((512, 4096), np.float32)
pid = os.fork()
if pid == 0:
    c = np.zeros((4, 512), np.float32)
    p = lambda x: x.ctypes.data_as(ctypes.c_void_p)
    sgemm = ctypes.CDLL(None).cblas_sgemm  # the process's cblas_sgemm: the shim's, if loaded
    sgemm(101, 111, 112, 4, 512, 4096, ctypes.c_float(1.0), p(a), 4096, p(b), 4096, ctypes.c_float(0.0), p(c), 512)
    os._exit(0 if (c == 4096).all() else 1)
_, status = os.waitpid(pid, 0)
shim = backend.matmul_shim()
print(json.dumps({"route": info.matmul_route, "calls": shim.calls() if shim else None,
                  "logits": [round(v, 4) for v in logits[0, -1, :8].tolist()], "child_status": status}))
"""


def run_child(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model("llama"))], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_shim
def test_a_fresh_process_runs_its_matmuls_through_the_shim(tmp_path: Path) -> None:
    on = run_child(dict(os.environ))
    assert on["route"].startswith("matmuls with <= 16 rows -> mlxcel kernel"), on["route"]
    assert on["calls"]["kernel"] > 0  # decode: (1, hidden) @ weight
    assert on["child_status"] == 0  # a forked child computes through the shim too
    off = run_child({**os.environ, "MLXCEL_BLAS_SHIM": "0"})
    assert off["route"] == "off (MLXCEL_BLAS_SHIM=0)" and off["calls"] is None
    assert np.allclose(on["logits"], off["logits"], atol=2e-3)


@needs_shim
def test_without_a_compiler_the_blas_is_called_directly(tmp_path: Path) -> None:
    """No compiler and nothing built yet: the reason is reported and MLX uses the BLAS as before."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp"),
           "CC": "no-such-compiler", "PATH": str(Path(sys.executable).parent)}
    (tmp_path / "tmp").mkdir()
    result = run_child(env)
    assert "not built: no C compiler found" in result["route"], result["route"]
    assert result["calls"] is None
    assert result["child_status"] == 0


def test_with_a_compiler_the_library_builds_and_loads() -> None:
    """Where a C compiler exists the shim must build and load: every runtime test skips without it,
    so a source that compiles to a library that does not load (an undefined symbol left by a merge)
    must fail here rather than turn those tests into skips."""
    if blas_shim.find_compiler() is None:
        pytest.skip("no C compiler on this machine (the runtime's tests skip with it)")
    built = blas_shim.build()
    assert built.path is not None, built.reason
    loaded = blas_shim.load(built)
    assert not isinstance(loaded, str), loaded


def test_a_source_that_does_not_compile_is_named_and_nothing_is_installed(tmp_path: Path) -> None:
    """The build compiles each source apart (in parallel) and links them: a failing one is named in
    the reason, no library is installed, and the same directory then builds a good recipe."""
    if blas_shim.find_compiler() is None:
        pytest.skip("no C compiler")
    good, bad = tmp_path / "good.c", tmp_path / "bad.c"
    good.write_text("int probe_good(void) { return 7; }\n")
    bad.write_text("int probe_bad(void) { return undeclared_function(); }\n")
    out = tmp_path / "out"
    failed = blas_shim.build(out, blas_shim.Recipe("probe", (good, bad)))
    assert failed.path is None and "compiling bad.c" in failed.reason, failed.reason
    assert not list(out.iterdir())  # neither a library nor the objects' directory left behind
    built = blas_shim.build(out, blas_shim.Recipe("probe", (good,)))
    assert built.path is not None and built.built_now, built.reason
    assert ctypes.CDLL(str(built.path)).probe_good() == 7


def test_a_second_builder_waits_for_the_first_and_takes_its_library(tmp_path: Path) -> None:
    """While one process builds into a directory (its lock held), another's build of the same
    library waits, then returns the first's library without compiling it again (two servers or
    a test run's two workers starting at once: each compiled the whole shim, twice as slowly)."""
    if blas_shim.find_compiler() is None:
        pytest.skip("no C compiler")
    import fcntl

    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { return 3; }\n")
    recipe = blas_shim.Recipe("probe", (source,))
    out = tmp_path / "out"
    out.mkdir()
    results: list[blas_shim.ShimBuild] = []
    held = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the first builder holds it while it compiles
        waiting = threading.Thread(target=lambda: results.append(blas_shim.build(out, recipe)))
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not results, "the second build did not wait for the first"
        first = out / blas_shim.library_name(recipe)
        first.write_bytes(b"the first builder's library")
    finally:
        os.close(held)
    waiting.join(30)
    assert [(r.path, r.built_now) for r in results] == [(first, False)]
    assert first.read_bytes() == b"the first builder's library"


@pytest.mark.slow  # compiles the library twice (8-23 s); every start exercises the cached path
def test_the_library_is_rebuilt_for_another_source_or_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = blas_shim.find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    first = blas_shim.build(tmp_path)
    assert first.path is not None and first.built_now, first.reason
    again = blas_shim.build(tmp_path)
    assert again.path == first.path and not again.built_now  # cached
    monkeypatch.setattr(blas_shim, "_cpu_signature", lambda: "another CPU")
    other = blas_shim.build(tmp_path)
    assert other.path != first.path and other.built_now


@needs_shim
@pytest.mark.e2e
def test_the_server_logs_which_matmul_path_and_decode_step_are_active(server_factory, server, llama_dir) -> None:
    import httpx

    on = server  # the session's tiny llama, started as any server is: the shim on
    off = server_factory(["-m", str(llama_dir)], env={"MLXCEL_BLAS_SHIM": "0"})
    assert "float32 matmuls: matmuls with <= 16 rows -> mlxcel kernel" in on.log()
    assert "float32 matmuls: off (MLXCEL_BLAS_SHIM=0)" in off.log()
    # The CPU decode runtime runs on the shim's kernels: with them it is active, without them
    # the server says why it keeps MLX's step.
    assert "decode step: CPU decode runtime" in on.log()
    assert "decode step: MLX (CPU decode runtime not used: the BLAS shim's kernels are not loaded)" in off.log()
    body = {"prompt": [5, 17, 300, 41, 9], "n_predict": 4, "temperature": 0, "n_probs": 1}
    replies = [httpx.post(s.base_url + "/completion", json=body, timeout=60).json() for s in (on, off)]
    assert all(r["tokens_predicted"] == 4 for r in replies)
