"""``scripts/cluster.sh`` as a subprocess, for the end-to-end tests and ``scripts/bench_cluster.py``.

The script writes ``cluster.env`` into its log directory (router and replica URLs and PIDs,
``READY=1`` once the router answers); this class waits for it and reads it. It needs a source
checkout (the script lives in ``scripts/``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

CLUSTER_SH = Path(__file__).resolve().parents[2] / "scripts" / "cluster.sh"


def read_env(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of a ``cluster.env`` (empty while it does not exist)."""
    if not path.exists():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


class ClusterProcess:
    """``cluster.sh --replicas N --port P [--policy NAME] --log-dir DIR [server flags]``, started and ready.

    Runs with this interpreter's environment (``MLXCEL_VENV``), and without the caller's
    ``LLAMA_*``/``MLXCEL_*`` settings, so only ``server_args`` configure the replicas.
    """

    def __init__(self, replicas: int, port: int, log_dir: Path, server_args: Sequence[str], policy: str | None = None,
                 timeout: float = 180.0) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "MLXCEL_"))}
        env["MLXCEL_VENV"] = str(Path(sys.executable).parent.parent)
        cmd = [str(CLUSTER_SH), "--replicas", str(replicas), "--port", str(port), "--log-dir", str(log_dir)]
        if policy:
            cmd += ["--policy", policy]
        self.cmd = [*cmd, *server_args]
        self.out_path = log_dir / "cluster.out"
        self.out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self.out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout
        while self.env().get("READY") != "1":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"cluster did not start:\n{self.out_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        env_vars = self.env()
        self.url = env_vars["ROUTER_URL"]
        self.replica_urls = [env_vars[f"REPLICA_{i}_URL"] for i in range(replicas)]
        self.pids = [int(env_vars["ROUTER_PID"]), *(int(env_vars[f"REPLICA_{i}_PID"]) for i in range(replicas))]

    def env(self) -> dict[str, str]:
        return read_env(self.log_dir / "cluster.env")

    def stop(self) -> int | None:
        """SIGTERM the script (it stops what it started) and return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()
        return self.proc.returncode
