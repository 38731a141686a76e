"""Pick the compute backend before MLX is imported.

MLX's Linux CPU wheel links the *reference* BLAS, which runs float32 matmul at a few GFLOP/s.
Loading an optimized BLAS (OpenBLAS) with ``RTLD_GLOBAL`` before ``mlx.core`` is first imported
makes MLX resolve its BLAS symbols against it instead: prefill gets ~25x faster. This module must
therefore be imported, and :func:`load_optimized_blas` called, before anything imports MLX.

OpenBLAS then picks its kernels from CPUID, which can go wrong on virtual CPUs; unless the user
chose (``OPENBLAS_CORETYPE``), the kernels are chosen from the CPU flags instead (see
:func:`openblas_kernels_for_cpu`). Its threads wait for the next call by spinning for
``2 ** OPENBLAS_THREAD_TIMEOUT`` cycles (default 28: ~0.1 s), which keeps every core busy after
each GEMM, while the shim's own threads need them (a hit's rest on the CPU decode runtime
alternates the two every millisecond: its attention took 49-56 ms a pass with OpenBLAS spinning
0.1 s, 24-31 without); unless the user chose, the spin is cut to ``OPENBLAS_SPIN_EXPONENT``.

Matmuls with few rows (every decode step) are slow in OpenBLAS's GEMM; ``blas_shim`` interposes
``cblas_sgemm`` for them, so it is loaded globally just before the BLAS (see ``runtime/native/blas_shim.py``).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from mlxcel_compat.runtime.native import blas_shim

log = logging.getLogger(__name__)

# OPENBLAS_THREAD_TIMEOUT unless the user set it: 2 ** 22 cycles (~1.4 ms) of spinning. MLX's
# prefill leaves gaps of that order between its GEMMs: at 16 (~20 us) a cold 1K-token prompt
# took 1.20-1.23x llama-server's time instead of 1.09-1.24x, at 22 1.11-1.12x; a hit's rest on
# the runtime took 0.95-1.00x llama-server's at 16, 0.98x at 22 and 0.89-1.14x at 28
# (scripts/bench_prompt_cache.py, docs/benchmarks/prompt-cache.md).
OPENBLAS_SPIN_EXPONENT = 22

# Most specific first: the pthread build is what Debian's libopenblas0-pthread installs.
_BLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
)


# OpenBLAS kernel sets by the x86-64 CPU flags they need, best first (names as OPENBLAS_CORETYPE
# takes them).
_OPENBLAS_KERNELS = (
    ("SkylakeX", {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}),
    ("Haswell", {"avx2", "fma"}),
)


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX will use on this process."""

    name: str  # "openblas", "blis", "reference", "accelerate" (macOS), "mlx-bundled"
    path: str | None
    optimized: bool
    kernels: str | None = None  # OpenBLAS: the kernel set it runs (openblas_get_corename)
    kernels_forced: bool = False  # we set OPENBLAS_CORETYPE from the CPU flags
    matmul_route: str = "the BLAS's cblas_sgemm"  # which path MLX's float32 matmuls take (blas_shim)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``), or none where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def openblas_kernels_for_cpu(flags: set[str]) -> str | None:
    """The best OpenBLAS kernel set these CPU flags support, or None (let OpenBLAS decide).

    OpenBLAS's DYNAMIC_ARCH builds choose kernels from CPUID at load time, and some virtual CPUs
    defeat that: on a Firecracker VM of a Sapphire Rapids host, Debian's OpenBLAS 0.3.21 chose
    "Prescott" (SSE3) kernels and ran float32 matmul at ~28 GFLOP/s; forcing "SkylakeX" (the
    CPU flags list AVX-512, and Linux only lists what the kernel enabled) gave 110-200 GFLOP/s
    (scripts/bench_cpu_kernels.py), 2-2.5x faster prefill. The flags are the ground truth, so
    they pick the kernels.
    """
    for name, needed in _OPENBLAS_KERNELS:
        if needed <= flags:
            return name
    return None


def openblas_corename(lib: ctypes.CDLL) -> str | None:
    """The name of the kernels OpenBLAS chose (``openblas_get_corename``), or None for another BLAS."""
    try:
        fn = lib.openblas_get_corename
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    value = fn()
    return value.decode() if value else None


_loaded: BlasInfo | None = None
_shim: blas_shim.Shim | None = None
_sgemm: Any = None  # the loaded BLAS's cblas_sgemm for NumPy callers (see :func:`cblas_sgemm`)


def matmul_shim() -> blas_shim.Shim | None:
    """The loaded ``blas_shim`` (after :func:`load_optimized_blas`), or None."""
    return _shim


def cblas_sgemm() -> Any | None:
    """The loaded BLAS's own ``cblas_sgemm`` as a ctypes function (argument types set), or None.

    For code that multiplies NumPy arrays between MLX operations (a prompt chunk's attention,
    ``runtime/attention.py``): the same library, kernels and thread pool as MLX's matmuls. NumPy's
    ``matmul`` would use NumPy's own OpenBLAS, whose threads then spin for the CPU against this
    one's (measured: a 1K prefill 1.7x slower). The shim's interposed symbol is not taken: these
    products have many rows, which it would forward here anyway.
    """
    global _sgemm
    if _sgemm is None and _loaded is not None and _loaded.path is not None:
        try:
            fn = ctypes.CDLL(_loaded.path).cblas_sgemm  # the library's own definition, not the global one
        except (OSError, AttributeError):  # a BLAS without the CBLAS interface: NumPy's matmul then
            return None
        c_int, c_float, ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        fn.restype = None
        fn.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, c_float, ptr, c_int, ptr, c_int, c_float, ptr, c_int]
        _sgemm = fn
    return _sgemm


class _OneThread:
    """``with backend.one_blas_thread():`` the loaded OpenBLAS runs its calls on the calling
    thread alone, then goes back to its thread count (a no-op for another BLAS, or none).

    Why: a prompt chunk's attention over a cached prefix is many small products (one per query
    block and KV head: 192 rows by ~1K keys by 64, then by 65 columns). OpenBLAS splits each one
    over its threads and synchronises them per call, which cost more than the split saved
    (``runtime/attention.py``; docs/benchmarks/prompt-cache.md, issue 29). Nothing else calls the
    BLAS meanwhile: the attention runs on the engine thread with every MLX input evaluated.
    OpenBLAS 0.3.21 (Debian 12) has no per-thread count, so the process-wide one is set and put
    back; a call another thread makes in between only runs single-threaded.
    """

    def __init__(self) -> None:
        self._set: Any = None
        self._get: Any = None
        self._before = 1

    def _bind(self) -> bool:
        if self._set is None:
            if _loaded is None or _loaded.name != "openblas" or _loaded.path is None:
                return False
            lib = ctypes.CDLL(_loaded.path)
            try:
                self._set, self._get = lib.openblas_set_num_threads, lib.openblas_get_num_threads
            except AttributeError:
                return False
            self._set.argtypes, self._set.restype, self._get.restype = [ctypes.c_int], None, ctypes.c_int
        return True

    def __enter__(self) -> None:
        if self._bind():
            self._before = self._get()
            if self._before != 1:
                self._set(1)

    def __exit__(self, *exc: Any) -> None:
        if self._set is not None and self._before != 1:
            self._set(self._before)


_one_thread = _OneThread()


def one_blas_thread() -> _OneThread:
    """A context in which the loaded OpenBLAS computes on the calling thread only (see _OneThread)."""
    return _one_thread


def _blas_threads(lib: ctypes.CDLL) -> int:
    try:
        fn = lib.openblas_get_num_threads
    except AttributeError:
        return len(os.sched_getaffinity(0))
    fn.restype = ctypes.c_int
    return max(1, fn())


@dataclass(frozen=True)
class ThreadCounts:
    """llama-server's ``-t`` and ``-tb`` as the CPU runtime applies them.

    ``decode``: the shim's pool (decode steps' products, the CPU decode runtime's kernels);
    ``batch``: ggml's threadpool for prompt chunks' products and OpenBLAS, which computes the
    float32 products of prefill (decode steps' products go through the shim). ``None``: not set,
    each library keeps its own choice (every CPU the process may use).
    """

    decode: int | None = None
    batch: int | None = None

    @classmethod
    def from_flags(cls, threads: int | None, threads_batch: int | None) -> "ThreadCounts":
        """``-t N`` / ``-tb N`` (N <= 0 or -1: every CPU); ``-tb`` unset follows ``-t``, as in llama.cpp."""
        every = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        decode = None if threads is None else (threads if threads > 0 else every)
        if threads_batch is None:
            batch = decode
        else:
            batch = threads_batch if threads_batch > 0 else every
        if threads is not None and threads <= 0 and threads_batch is None:
            decode = batch = None  # the defaults: nothing to bound
        return cls(decode, batch)


def _load_shim_before(lib: ctypes.CDLL, counts: ThreadCounts) -> tuple[blas_shim.Shim | None, str]:
    """Build/load the shim globally and point it at ``lib`` (loaded locally so far); the shim, or
    None and why."""
    if blas_shim.disabled():
        return None, "off (MLXCEL_BLAS_SHIM=0)"
    built = blas_shim.build()
    if built.path is None:
        return None, f"the BLAS's cblas_sgemm (matrix-vector shim not built: {built.reason})"
    shim = blas_shim.load(built)
    if isinstance(shim, str):
        return None, f"the BLAS's cblas_sgemm (matrix-vector shim not loaded: {shim})"
    problem = blas_shim.attach(shim, lib, counts.decode or _blas_threads(lib))
    if problem is not None:
        shim.configure(blas_shim.ROUTE_SGEMM)  # loaded globally already: make it a pass-through
        return None, f"the BLAS's cblas_sgemm (matrix-vector shim unused: {problem})"
    if counts.batch is not None:
        shim.set_batch_threads(counts.batch)
    return shim, shim.describe() + (" (compiled now)" if built.built_now else "")


def blas_candidates() -> list[str]:
    """The BLAS libraries to try, in order: ``MLXCEL_BLAS_PATH``, the system's, then the environment's OpenBLAS."""
    override = os.environ.get("MLXCEL_BLAS_PATH")
    found = [override] if override else []
    found += [p for p in _BLAS_CANDIDATES if os.path.exists(p)]
    found += sorted(glob.glob(os.path.join(sys.prefix, "lib", "libopenblas*.so*")))
    return found


def load_optimized_blas(threads: int | None = None, threads_batch: int | None = None) -> BlasInfo:
    """Load an optimized BLAS globally, once; return what is active.

    Safe to call many times (the thread counts of the first call count). On macOS MLX uses
    Accelerate/Metal and nothing is needed. ``threads``/``threads_batch``: ``-t``/``-tb``
    (:class:`ThreadCounts`); OpenBLAS reads its count when it loads, so it is set in its
    variables first (NumPy's bundled OpenBLAS, loaded later, reads the same ones).
    """
    global _loaded, _shim
    if _loaded is not None:
        return _loaded
    counts = ThreadCounts.from_flags(threads, threads_batch)
    if counts.batch is not None:
        os.environ["OPENBLAS_NUM_THREADS"] = str(counts.batch)
    if platform.system() != "Linux":
        _loaded = BlasInfo("accelerate", None, True)
        return _loaded
    if "mlx.core" in sys.modules:
        log.warning("mlx.core was imported before the BLAS was chosen; it may use the reference BLAS")
    for path in blas_candidates():
        name = "blis" if "blis" in path else "openblas"
        forced = False
        if name == "openblas":  # read by OpenBLAS when it loads, as the core type below
            os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(OPENBLAS_SPIN_EXPONENT))
        if name == "openblas" and "OPENBLAS_CORETYPE" not in os.environ and platform.machine() in ("x86_64", "AMD64"):
            kernels = openblas_kernels_for_cpu(cpu_flags())
            if kernels is not None:  # read by OpenBLAS when it loads, so set it first
                os.environ["OPENBLAS_CORETYPE"] = kernels
                forced = True
        try:
            # Locally first: the shim must enter the global symbol scope before the BLAS does.
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError:
            if forced:
                del os.environ["OPENBLAS_CORETYPE"]
            continue
        _shim, route = _load_shim_before(lib, counts)
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # now global, after the shim
        corename = openblas_corename(lib) if name == "openblas" else None
        _loaded = BlasInfo(name, path, True, corename, forced, route)
        return _loaded
    _loaded = BlasInfo("reference", None, False)
    return _loaded


def log_blas(info: BlasInfo) -> None:
    """Say which BLAS is active; warn loudly when only the reference BLAS is there."""
    if info.optimized:
        kernels = ""
        if info.kernels:
            how = "chosen from the CPU flags" if info.kernels_forced else "chosen by OpenBLAS"
            kernels = f", {info.kernels} kernels ({how})"
        log.info("BLAS: %s (%s)%s", info.name, info.path or "system", kernels)
        if info.name != "accelerate":
            log.info("float32 matmuls: %s", info.matmul_route)
        return
    log.warning(
        "BLAS: only the REFERENCE BLAS is available: prefill will be ~25x slower. "
        "Install an optimized BLAS (Debian: apt-get install libopenblas0-pthread) "
        "or point MLXCEL_BLAS_PATH at one."
    )


# glibc's mallopt parameter (malloc.h) and the size from which blocks are mapped on their own.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 << 10


def map_big_allocations() -> bool:
    """Make glibc's malloc map every block of ``MMAP_THRESHOLD`` bytes or more on its own, and
    unmap it when freed (``mallopt(M_MMAP_THRESHOLD)``; no-op elsewhere). Returns whether it did.

    Why: by default glibc raises that threshold to the size of each mapped block freed (up to
    32 MiB), so after the first few megabyte-sized buffers are freed (the warm-up's KV caches,
    a prompt chunk's activations), later ones are carved out of the allocating thread's arena,
    and a thread's arena keeps what it freed: ``malloc_trim`` does not give it back. The engine
    thread's arena held ~30 MiB that way after loading a small model (RSS after load 1.34x
    llama-server's on an 88M-parameter Q8_0 file; 48 MiB of anonymous memory instead of 78 with
    the fixed threshold). MLX and the decode runtime keep their own buffers between steps, so
    mapping big blocks afresh costs nothing per token.
    """
    if platform.system() != "Linux":
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``; no-op elsewhere).

    After the prompt cache is reset, the memory its entries and their Python bookkeeping used is
    free but stays in the process's heap arenas; trimming makes RSS show what is really in use.
    """
    if platform.system() != "Linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def exit_now(code: int) -> NoReturn:
    """Leave the process without the interpreter's teardown, after flushing logs and streams.

    MLX 0.32 aborts at exit ("terminate called without an active exception", status 134) in
    about half the runs once a compiled function (``mx.compile``, runtime/cpu_fusion.py) has run on
    a thread other than the main one, which the engine thread always is (ml-explore/mlx#3126),
    and likewise while that thread is still inside MLX. Callers make sure everything that must
    outlive the process is written first (the server: engine stopped, disk tier flushed).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
