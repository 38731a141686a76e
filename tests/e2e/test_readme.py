"""The README works as written: its shell lines are run (or, where they name files that only a
user has, checked), so a newcomer's first commands cannot rot.

Every ``sh`` block of README.md is classified by its first word; a block of an unknown kind
fails the test, so a new example cannot slip in unchecked:

- ``scripts/serve.sh ...``: started for real (the port and ``~/.cache/mlxcel`` substituted with a
  free port and a temporary directory), and the ``curl`` blocks that follow it run against it:
  each exits 0 and prints JSON that is not an error;
- ``.venv/bin/mlxcel-server ...`` and ``scripts/cluster.sh ...``: their model paths are the
  user's, so the program must exist and every flag on the line must resolve in the settings table;
- ``.venv/bin/python -m mlxcel_compat.testing.models|adapters ...``: run (their ``/tmp/`` paths, here
  and in the serve lines that use what they wrote, become a temporary directory);
- ``scripts/test.sh``: exists and is executable (running it here would recurse).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from mlxcel_compat.settings import resolve_settings
from tests.conftest import REPO_ROOT, free_port, wait_until_healthy

ROOT = REPO_ROOT
README = ROOT / "README.md"


@dataclass
class Block:
    lines: list[str]

    @property
    def kind(self) -> str:
        first = self.lines[0]
        for kind in ("scripts/serve.sh", "curl", ".venv/bin/mlxcel-server", "scripts/cluster.sh",
                     ".venv/bin/python -m mlxcel_compat.testing.", "scripts/test.sh"):
            if first.startswith(kind) and all(line.startswith(kind) for line in self.lines):
                return kind
        return "unknown"


def sh_blocks() -> list[Block]:
    text = README.read_text(encoding="utf-8")
    return [Block([line for line in body.splitlines() if line.strip()])
            for body in re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)]


def words(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def test_every_readme_block_is_of_a_kind_this_test_checks() -> None:
    blocks = sh_blocks()
    assert len(blocks) >= 6
    assert [b.kind for b in blocks if b.kind == "unknown"] == [], [b.lines for b in blocks if b.kind == "unknown"]
    assert {b.kind for b in blocks} >= {"scripts/serve.sh", "curl", "scripts/test.sh"}


def test_the_readme_commands_that_need_a_users_files_are_valid() -> None:
    for block in sh_blocks():
        for line in block.lines:
            argv = words(line)
            if block.kind == ".venv/bin/mlxcel-server":
                assert os.access(Path(sys.executable).parent / "mlxcel-server", os.X_OK)  # the venv's entry point
                resolve_settings(argv[1:], {})  # raises on an unknown flag or a bad value
            elif block.kind == "scripts/cluster.sh":
                assert os.access(ROOT / argv[0], os.X_OK)
                cluster_options = {"--replicas", "--port", "--policy", "--log-dir", "--router-arg", "--startup-timeout"}
                rest = argv[1:]
                while rest and rest[0] in cluster_options:
                    rest = rest[2:]
                resolve_settings(rest, {})
            elif block.kind == "scripts/test.sh":
                assert os.access(ROOT / argv[0], os.X_OK)


class ReadmeServer:
    """``scripts/serve.sh`` as the README starts it, in its own process group."""

    def __init__(self, command: str, port: int, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "MLXCEL_"))}
        command = command.replace("8080", str(port))
        self.log = log
        self.proc = subprocess.Popen(command, shell=True, cwd=ROOT, env=env, stdout=open(log, "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        # serve.sh may reinstall the project first
        wait_until_healthy(self.url, self.proc, lambda: log.read_text(errors="replace"), timeout=600)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture()
def readme_servers(tmp_path: Path) -> Iterator[list[ReadmeServer]]:
    started: list[ReadmeServer] = []
    yield started
    for server in started:
        server.stop()


@pytest.mark.e2e
@pytest.mark.real_model
def test_the_readme_serve_and_curl_lines_work_as_written(readme_servers, smollm2_gguf, tmp_path: Path) -> None:
    """The demo is the real model (its file is in the user cache: ``smollm2_gguf``), so the chat
    example's promised answer is checked too."""
    def local(line: str) -> str:  # the README's scratch paths, in this test's directory
        return line.replace("/tmp/", f"{tmp_path}/").replace("~/.cache/mlxcel", str(tmp_path / "home"))

    server: ReadmeServer | None = None
    ran: list[str] = []
    for i, block in enumerate(sh_blocks()):
        if block.kind == ".venv/bin/python -m mlxcel_compat.testing.":
            for line in block.lines:
                line = local(line).replace(".venv/bin/python", sys.executable)
                done = subprocess.run(line, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, (line, done.stderr)
                assert Path(words(line)[words(line).index("--out") + 1]).exists()
                ran.append(line)
        elif block.kind == "scripts/serve.sh":
            (line,) = block.lines
            if server is not None:
                server.stop()
                readme_servers.remove(server)
            server = ReadmeServer(local(line), free_port(), tmp_path / f"serve-{i}.log")
            readme_servers.append(server)
        elif block.kind == "curl":
            assert server is not None, "a curl block before any serve block"
            for line in block.lines:
                port = server.url.rsplit(":", 1)[1]
                done = subprocess.run(line.replace("8080", port), shell=True, capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, (line, done.stderr)
                reply = json.loads(done.stdout)
                assert not (isinstance(reply, dict) and "error" in reply), (line, reply)
                if "Name the capital of France" in line:  # a question whose answer is no near-tie (README)
                    assert "Paris" in reply["choices"][0]["message"]["content"]
                    assert reply["choices"][0]["finish_reason"] == "stop"
                if "action=save" in line:
                    assert reply["n_saved"] > 0
                if line.endswith("/lora-adapters"):
                    assert [a["id"] for a in reply] == [0]
                ran.append(line)
    assert len(ran) >= 12
    assert (tmp_path / "home" / "slots" / "agent.bin").is_file() and (tmp_path / "home" / "prompts").is_dir()
