"""Helpers shared by the benchmark scripts: server subprocesses, free ports, statistics, models.

Scripts run as ``python scripts/bench_x.py``, so ``scripts/`` is on ``sys.path`` and a plain
``import benchlib`` works. This module never imports ``mlx`` (bench_throughput.py must load its
BLAS first).
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NoReturn

import httpx

ROOT = Path(__file__).resolve().parents[1]


def run(main: Callable[[], int | None]) -> NoReturn:
    """Run a benchmark's ``main`` and leave without the interpreter's teardown.

    In-process benchmarks run MLX (and ``mx.compile``) on engine threads, after which MLX 0.32
    may abort at exit with status 134 (``mlxcel_compat.runtime.backend.exit_now`` says why); the results
    are printed by then, but the abort message and the status would read as a failure.
    """
    try:
        code = main()
    except SystemExit as exc:  # argparse's --help and usage errors, SystemExit("message")
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr, flush=True)  # what the interpreter would have printed
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from mlxcel_compat.runtime.backend import exit_now

    exit_now(code or 0)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- timing

clock = time.perf_counter  # what in-process measurements read; see single_thread_cpu_time()


def single_thread_cpu_time() -> None:
    """Measure work instead of wall time (a shared machine's noise hits wall time hardest): one
    BLAS and shim thread, and the process's CPU time as the clock. Call before the BLAS loads."""
    global clock
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    clock = time.process_time


# --------------------------------------------------------------------------- statistics


def pct(values: Iterable[float | None], p: float) -> float | None:
    """Percentile ``p`` (0..100) with linear interpolation; ``None`` values are skipped."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing or ``b`` is 0."""
    return None if a is None or b is None or b == 0 else a / b


def best_ms(fn: Callable[[], object], reps: int) -> float:
    """The best of ``reps`` calls of ``fn`` after one warm-up call, in wall-clock milliseconds."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def interleaved(fns: Mapping[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """Each measurement once per repetition, the order rotating so that a noisy machine hits them
    alike; one warm-up round is run first and discarded. Returns the values by name."""
    names = list(fns)
    out: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps + 1):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            value = fns[name]()
            if rep:
                out[name].append(value)
    return out


def mean(values: Iterable[float | None]) -> float | None:
    """Arithmetic mean of the non-``None`` values, or ``None``."""
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


# --------------------------------------------------------------------------- models


def ensure_model(family: str, size: str, cache_dir: str | Path | None = None) -> Path:
    """The generated model directory of ``family``/``size`` (built on first use)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from mlxcel_compat.testing.model_directory import ensure_model as _ensure

    return _ensure(family, size, cache_dir=cache_dir)


def resolve_model(spec: str, default_size: str) -> str:
    """A model directory or GGUF file as given, or ``family[:size]`` built by mlxcel_compat.testing.models."""
    if os.path.isdir(spec) or (spec.endswith(".gguf") and os.path.isfile(spec)):
        return spec
    family, _, size = spec.partition(":")
    return str(ensure_model(family, size or default_size))


# --------------------------------------------------------------------------- servers


def mlxcel_cmd(model_dir: str | Path, port: int, extra: Iterable[str] = (), python: str = sys.executable) -> list[str]:
    """The command line of ``python -m mlxcel_compat`` serving ``model_dir`` on loopback ``port``."""
    return [python, "-m", "mlxcel_compat", "-m", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *extra]


class ServerProcess:
    """An HTTP server subprocess on loopback, its output in a log file.

    ``env`` holds overrides of this process's environment (``None`` removes a variable). Without
    ``log_path`` the log is a temporary file, deleted by ``stop()`` unless ``keep_log`` is set or
    the server ``failed``.
    """

    def __init__(self, cmd: list[str], port: int, *, name: str = "server",
                 env: Mapping[str, str | None] | None = None, cwd: str | Path | None = None,
                 log_path: str | Path | None = None, keep_log: bool = False) -> None:
        self.name = name
        self.cmd = cmd
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.env_add = dict(env or {})
        self.cwd = cwd
        if log_path is None:
            fd, tmp = tempfile.mkstemp(prefix=f"bench_{name}_".replace("/", "_"), suffix=".log")
            os.close(fd)
            self.log_path = Path(tmp)
        else:
            self.log_path = Path(log_path)
        self.keep_log = keep_log
        self.failed = False
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def mlxcel(cls, model_dir: str | Path, extra: Iterable[str] = (), *, python: str = sys.executable,
               **kw) -> ServerProcess:
        """Our server (``python -m mlxcel_compat``) on a free port."""
        port = free_port()
        return cls(mlxcel_cmd(model_dir, port, extra, python), port, **kw)

    def environ(self) -> dict[str, str] | None:
        """The child's environment (``None``: inherit unchanged)."""
        if not self.env_add:
            return None
        env = dict(os.environ)
        for k, v in self.env_add.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def start(self) -> None:
        """Launch the process (does not wait for it)."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.environ(), cwd=self.cwd)

    def wait_healthy(self, timeout: float) -> None:
        """Poll ``GET /health`` until 200; raise RuntimeError (with the log tail) on exit or timeout."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as c:
            while True:
                if self.proc.poll() is not None:
                    self.failed = True
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} during start-up; "
                                       f"log: {self.log_path}\n{self.tail()}")
                try:
                    if c.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.failed = True
                    raise RuntimeError(f"{self.name} not healthy after {timeout:.0f}s; log: {self.log_path}\n"
                                       f"{self.tail()}")
                time.sleep(0.25)

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 20.0, interrupt_first: bool = False) -> Path | None:
        """Stop the process (SIGINT first if asked, then terminate, then kill).

        Returns the log path when the log is kept, ``None`` when it was deleted.
        """
        proc = self.proc
        if proc is not None and proc.poll() is None:
            signals = ([signal.SIGINT] if interrupt_first else []) + [signal.SIGTERM]
            for sig in signals:
                proc.send_signal(sig)
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            else:
                proc.kill()
                proc.wait(timeout=10)
        if self.failed or self.keep_log:
            return self.log_path
        try:
            self.log_path.unlink()
        except OSError:
            pass
        return None
