"""Build and load ``blas_shim.c``: MLX's float32 matmuls with few rows at memory-streaming speed.

MLX's CPU backend computes every float32 matmul with one ``cblas_sgemm`` call, and OpenBLAS
(Debian's 0.3.21) runs the products of a decode step, (1 .. a few rows) @ (a weight), through its
full GEMM path, which first copies the whole weight: about a third of the speed at which a
matrix-vector kernel streams the same weight. ``blas_shim.c`` defines ``cblas_sgemm``; loaded with
``RTLD_GLOBAL`` before the BLAS it comes first in the process's symbol lookup, so MLX's calls go
through it, and it sends products with up to ``SMALL_M_MAX`` rows to its own kernel (every weight
row read once for all rows), other one-row or one-column products to ``cblas_sgemv``, the rest to
the BLAS's ``cblas_sgemm``. ``scripts/bench_cpu_kernels.py`` measures each route.

The library is compiled on the machine that runs it (``-march=native``), by the system C compiler,
into the user cache directory, keyed by the source and the CPU: ``scripts/setup.sh``
builds it at install time, and a server that finds none (or a stale one) builds it at start-up.
Without a compiler or without an optimized BLAS nothing is loaded and MLX calls the BLAS directly;
the start-up log says which path is active and why. ``MLXCEL_BLAS_SHIM=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("blas_shim.c")
# Every file the library is built from: the shim (the interposed ``cblas_sgemm``, its thread pool in
# ``thread_pool.c``), the decode runtime's kernels (``elementwise.c``, ``attention.c`` for decode steps,
# ``chunk_attention.c`` for prompt chunks), the
# block-format products (``block_matmul.c``, ggml's kernels called from the shim's threads, and this
# project's own: ``quant_rows.c`` for Q8_0 decode rows and the look-ups, ``k_quant_rows.c`` for the
# K-quants' decode rows and their Q8_K activations, ``split_rows.c`` for the split
# Q4_1/Q5_x rows, ``mxfp4_rows.c`` for the split MXFP4 rows, ``dequantize.c``), the decode runtime's
# layer loop (``decode_pass.c``), its mixture-of-experts layers (``moe_layer.c``) and the hybrids'
# delta-net layers (``delta_net.c``), the Mamba-2 layers (``mamba2.c``), LFM2's short convolutions
# (``short_conv.c``), Gemma 4's pass (``gemma4_pass.c``), DeepSeek's latent attention
# (``mla_attention.c``), float32 expert stacks' grouped product (``expert_f32.c``), the loader's
# split and grouped layouts of rows (``row_layouts.c``), and the headers they share. The slowest to compile come first: the build
# starts them first (``split_rows.c`` ~16 s, ``k_quant_rows.c`` ~10 s, ``attention.c`` ~7 s; the rest
# ~1 s each).
SOURCES = tuple(SOURCE.with_name(name) for name in (
    "split_rows.c", "k_quant_rows.c", "attention.c", "chunk_attention.c", "blas_shim.c", "thread_pool.c", "elementwise.c", "block_matmul.c",
    "quant_rows.c", "mxfp4_rows.c", "dequantize.c", "decode_pass.c", "moe_layer.c",
    "delta_net.c", "mamba2.c", "short_conv.c", "gemma4_pass.c", "mla_attention.c", "expert_f32.c", "row_layouts.c"))
HEADERS = tuple(SOURCE.with_name(name) for name in (
    "blas_shim.h", "thread_pool.h", "vector_math.h", "small_m_kernel.h", "decode_kernels.h", "quant_blocks.h",
    "delta_net.h", "kv_rows.h", "softmax_rows.h", "decode_pass.h", "mamba2.h", "short_conv.h", "mla_attention.h"))
# Compiling every source takes ~40 s on an idle core (~20 s on two, in parallel); on a loaded machine (tests starting servers
# with fresh caches beside each other) it took over the two minutes once allowed, and a build
# that times out leaves the runtime off.
BUILD_TIMEOUT_S = 600
# Undefined references fail the link (a library that does not load would turn the runtime off).
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-Werror=implicit-function-declaration")
LIBS = ("-ldl",)

# Routes, as mlxcel_shim_configure takes them.
ROUTE_SGEMM = 0  # everything to the BLAS's cblas_sgemm: as if the shim were not there
ROUTE_GEMV = 1  # one-row / one-column products to cblas_sgemv, the rest to cblas_sgemm
ROUTE_KERNEL = 2  # products with up to small_m_max rows to the shim's kernel; other M/N == 1 to sgemv
ROUTE_NAMES = {ROUTE_SGEMM: "sgemm", ROUTE_GEMV: "gemv", ROUTE_KERNEL: "kernel"}

# Up to this many rows the kernel beats OpenBLAS's sgemm on the small llama's weights
# (scripts/bench_cpu_kernels.py, docs/benchmarks/cpu.md).
SMALL_M_MAX = 16

# Calls over up to this many rows (a decode step's products, norms and attention) are made
# holding the GIL (:func:`holding_the_gil`); longer ones (prompt chunks) release it.
GIL_HELD_ROWS_MAX = 16


class StreamedConsumers:
    """How many consumers read the engine's events as they come (streamed responses: the
    event loop must run between tokens). While there is one, decode passes release the GIL
    (``decode_pass.NativeModel.run``): a small model's step holding it for its 2-3 ms left the
    event loop waiting a switch interval for each of its own GIL round trips, and streamed
    tokens came in bursts 25-60 ms apart (small Q4_K_M, greedy). Counted on the event loop,
    read on the engine thread; a plain int under the GIL."""

    count = 0

    @classmethod
    def started(cls) -> None:
        cls.count += 1

    @classmethod
    def ended(cls) -> None:
        cls.count -= 1


@dataclass(frozen=True)
class ShimBuild:
    """The compiled library, or why there is none."""

    path: Path | None
    reason: str = ""  # why path is None
    built_now: bool = False


@dataclass
class Shim:
    """The loaded library and how it routes."""

    lib: ctypes.CDLL
    path: Path
    threads: int
    vector_width: int = 0  # floats per vector the kernel was compiled for
    route: int = ROUTE_KERNEL
    small_m_max: int = SMALL_M_MAX

    def configure(self, route: int | None = None, small_m_max: int | None = None, threads: int | None = None) -> None:
        """Change the routing at run time (benchmarks measure each route in one process)."""
        if route is not None:
            self.route = route
        if small_m_max is not None:
            self.small_m_max = small_m_max
        if threads is not None:
            self.threads = threads
        self.vector_width = self.lib.mlxcel_shim_configure(self.route, self.small_m_max, self.threads)

    def set_batch_threads(self, threads: int) -> None:
        """ggml's thread count for prompt chunks' products (``--threads-batch``; <= 0: the pool's)."""
        self.lib.mlxcel_set_batch_threads(threads)

    def calls(self) -> dict[str, int]:
        """How many cblas_sgemm calls each route took so far in this process."""
        out = (ctypes.c_long * 3)()
        self.lib.mlxcel_shim_calls(out)
        return {"sgemm": out[0], "sgemv": out[1], "kernel": out[2]}

    def describe(self) -> str:
        if self.route == ROUTE_SGEMM:
            return "off (every matmul to cblas_sgemm)"
        if self.route == ROUTE_GEMV:
            return "one-row/one-column matmuls -> cblas_sgemv"
        return (
            f"matmuls with <= {self.small_m_max} rows -> mlxcel kernel ({self.vector_width}-float vectors, "
            f"{self.threads} threads), other one-row/one-column -> cblas_sgemv"
        )


def disabled() -> bool:
    return os.environ.get("MLXCEL_BLAS_SHIM", "1").strip().lower() in ("0", "off", "false", "no")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlxcel_compat" / "native"


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line.strip() for line in f if line.startswith(wanted)]
    except OSError:
        lines = []
    return "\n".join(sorted(set(lines))) + platform.machine()


@dataclass(frozen=True)
class Recipe:
    """How one of the package's C libraries is compiled: the shim, or another library built the
    same way on the machine that runs it (``runtime/ggml_repack.py``'s, linked to ggml)."""

    stem: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()
    flags: tuple[str, ...] = CFLAGS
    libs: tuple[str, ...] = LIBS
    keyed_by: tuple[Path, ...] = ()  # other files whose change means a rebuild (libraries linked to)


SHIM = Recipe("blas_shim", SOURCES, HEADERS)


def repack_recipe(ggml_lib: Path) -> Recipe:
    """How ``ggml_repack.c`` is compiled: against the headers and libraries of the ggml in use,
    ``ggml_lib`` being its library directory (``runtime/ggml_cpu.py``). The shim's thread pool is
    found at load time: the shim is loaded globally first."""
    include = ggml_lib.parent / "include"
    return Recipe(
        "ggml_repack", (SOURCE.with_name("ggml_repack.c"),), HEADERS,
        flags=(*CFLAGS, f"-I{include}", f"-I{SOURCE.parent}"),
        libs=(f"-L{ggml_lib}", "-lggml-base", "-lggml-cpu", "-lggml", f"-Wl,-rpath,{ggml_lib}"),
        keyed_by=(ggml_lib / "libggml-cpu.so", include / "ggml.h"))


def library_name(recipe: Recipe = SHIM) -> str:
    """The file name of the build of this source for this CPU (a compiler upgrade keeps it)."""
    key = hashlib.sha256()
    parts = [path.read_bytes() for path in recipe.sources + recipe.headers + recipe.keyed_by]
    for part in (*parts, " ".join(recipe.flags + recipe.libs).encode(), _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    return f"{recipe.stem}-{key.hexdigest()[:16]}.so"


def build(directory: Path | None = None, recipe: Recipe = SHIM) -> ShimBuild:
    """The compiled library for this source, compiler and CPU, compiling it if needed."""
    if platform.system() != "Linux":
        return ShimBuild(None, f"not needed on {platform.system()}")
    name = library_name(recipe)
    candidates = [directory] if directory is not None else [cache_dir(), Path(tempfile.gettempdir()) / "mlxcel_compat-native"]
    for where in candidates:
        if (where / name).exists():
            return ShimBuild(where / name)
    cc = find_compiler()
    if cc is None:
        return ShimBuild(None, "no C compiler found (install gcc, or set CC, and restart)")
    errors = []
    for where in candidates:
        target = where / name
        try:
            where.mkdir(parents=True, exist_ok=True)
            lock = os.open(where, os.O_RDONLY)
        except OSError as exc:
            errors.append(f"{where}: {exc.strerror or exc}")
            continue
        try:
            # One builder at a time in a directory: a process starting meanwhile (a second server,
            # a test run's other worker) waits, then takes the library just built. Compiling the
            # same library at once, two builders shared the cores: ~60 s each on 2 cores, not ~25.
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:  # a file system without locks (some network ones): build unlocked, as before
                pass
            if target.exists():
                return ShimBuild(target)
            try:
                fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=where)
                os.close(fd)
            except OSError as exc:
                errors.append(f"{where}: {exc.strerror or exc}")
                continue
            try:
                failed = _compile_and_link(cc, recipe, tmp)
                if failed is not None:
                    return ShimBuild(None, failed)
                os.replace(tmp, target)  # atomic: a process loading it never sees half a file
                return ShimBuild(target, built_now=True)
            except (OSError, subprocess.SubprocessError) as exc:
                return ShimBuild(None, f"compiling {recipe.sources[0].name} with {cc} failed: {exc}")
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        finally:
            os.close(lock)  # and with it the lock
    return ShimBuild(None, "no writable directory for the compiled library: " + "; ".join(errors))


def _compile_and_link(cc: str, recipe: Recipe, output: str) -> str | None:
    """Compile ``recipe``'s sources into the library ``output``; None, or why it failed.

    Why one compiler process a source, as many at once as the machine has cores: the shim has
    about twenty sources, and one ``cc`` over all of them used one core for ~40 s at a first start
    (every server of a test run, and every user's first start, waits for it)."""
    compile_flags = tuple(f for f in recipe.flags if f != "-shared")
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix=".objects-", dir=os.path.dirname(output)) as objects:
        jobs: list[tuple[Path, str, subprocess.Popen]] = []
        pending = list(recipe.sources)
        failure = None
        while (pending or jobs) and failure is None:
            while pending and len(jobs) < (os.cpu_count() or 1):
                source = pending.pop(0)
                obj = os.path.join(objects, source.stem + ".o")
                jobs.append((source, obj, subprocess.Popen([cc, *compile_flags, "-c", "-o", obj, str(source)],
                                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
            source, obj, proc = jobs.pop(0)
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                failure = f"compiling {source.name} with {cc} failed: {(err.strip().splitlines() or ['?'])[-1]}"
        for _, _, proc in jobs:  # after a failure: the others are not waited for
            proc.kill()
            proc.wait()
        if failure is not None:
            return failure
        objs = [os.path.join(objects, source.stem + ".o") for source in recipe.sources]
        out = subprocess.run([cc, *recipe.flags, "-o", output, *objs, *recipe.libs], capture_output=True, text=True,
                             timeout=max(1.0, deadline - time.monotonic()))
        if out.returncode != 0:
            return f"linking {recipe.stem} with {cc} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def holding_the_gil(lib: ctypes.CDLL) -> ctypes.PyDLL:
    """The same loaded library, its functions called without releasing the GIL.

    A decode step is ~250 calls of a few to a few hundred microseconds. ctypes releases the GIL
    around each and must take it back after: with any other Python thread runnable (the HTTP
    event loop streaming the previous token, a client thread) each return waits for that thread
    to give the GIL up, up to the switch interval (a convoy: measured in-process on the small
    Q4_K_M file, a thread that merely wakes every 0.5 ms made a step 30 % slower, a busy thread
    150x slower). Kept for the call, the GIL passes to other threads between calls, at the
    interpreter's usual switch points, so they still run within a few milliseconds. Only
    short calls may use this view (``GIL_HELD_ROWS_MAX``): a long one would stall the others.
    """
    return ctypes.PyDLL(lib._name, handle=lib._handle)


def load(build_result: ShimBuild) -> Shim | str:
    """Load the compiled library globally (before the BLAS!); the Shim, or why it failed."""
    assert build_result.path is not None
    try:
        lib = ctypes.CDLL(str(build_result.path), mode=ctypes.RTLD_GLOBAL)
        lib.mlxcel_shim_init.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.mlxcel_shim_configure.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.mlxcel_shim_configure.restype = ctypes.c_int
        lib.mlxcel_shim_calls.argtypes = [ctypes.POINTER(ctypes.c_long)]
        lib.mlxcel_set_batch_threads.argtypes = [ctypes.c_int]
    except (OSError, AttributeError) as exc:
        return f"loading {build_result.path} failed: {exc}"
    return Shim(lib, build_result.path, threads=1)


def attach(shim: Shim, blas: ctypes.CDLL, threads: int) -> str | None:
    """Point the shim at the BLAS's sgemm/sgemv and switch it on; None, or why it cannot be."""
    try:
        sgemm, sgemv = blas.cblas_sgemm, blas.cblas_sgemv
    except AttributeError:
        return "the BLAS has no cblas_sgemm/cblas_sgemv"
    shim.lib.mlxcel_shim_init(ctypes.cast(sgemm, ctypes.c_void_p), ctypes.cast(sgemv, ctypes.c_void_p))
    shim.configure(ROUTE_KERNEL, SMALL_M_MAX, max(1, threads))
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m mlxcel_compat.runtime.native.blas_shim [--quiet]``: build the library now (scripts/setup.sh runs
    this); ``--quiet`` says nothing when it was already up to date."""
    args = sys.argv[1:] if argv is None else argv
    result = build()
    if result.path is None:
        print(f"blas shim: not built: {result.reason}", file=sys.stderr)
        return 0  # optional: the server runs without it (and says so at start-up)
    if result.built_now or "--quiet" not in args:
        print(f"blas shim: {'built' if result.built_now else 'up to date'}: {result.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
