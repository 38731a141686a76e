"""Host I/O the built-in agent tools share: child processes, paths, directory listings, globs.

Plain Python on the tool's own thread: subprocesses for the shell, ``uname`` and
``git ls-files``, nothing that touches MLX or the event loop. Paths resolve against
``X-Tool-Cwd`` or the server's working directory (``~`` expands), with ``.``/``..`` folded away,
and are not confined to it, as in llama-server. Behaviour follows llama-server's
``tools/server/server-tools.cpp`` (b11312).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from mlxcel_compat.server.agent_params import Chunk

LIST_ENTRIES_TIMEOUT = 15
GIT_LS_FILES_MAX_OUTPUT = 8 * 1024 * 1024
# Listings report these directories but never walk into them: they can be enormous.
JUNK_DIR_NAMES = frozenset({".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv", "venv", "dist",
                            "build", "target", ".cache", ".idea", ".vscode"})


@dataclass
class ExecResult:
    """What a child process gave: its combined output, its exit code (-1: it never ran) and
    whether the timeout killed it."""

    output: str
    exit_code: int = -1
    timed_out: bool = False


def run_process(args: list[str], max_output: int, timeout: int, cwd: str = "",
                on_chunk: Chunk | None = None) -> ExecResult:
    """Run ``args`` with stdout and stderr combined, keeping at most ``max_output`` bytes.

    As llama-server: the output past the cap is drained (so the child never blocks on a full
    pipe) and marked ``[output truncated]``; a child killed by the timeout or by a signal reports
    exit code 1. Unlike llama-server the whole process group is killed, so a shell's children
    do not keep the pipe open past the timeout.
    """
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=cwd or None, start_new_session=True)
    except OSError:
        return ExecResult("failed to spawn process")
    timed_out = threading.Event()
    done = threading.Event()

    def kill() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def watchdog() -> None:
        if not done.wait(max(0, timeout)):
            timed_out.set()
            kill()

    threading.Thread(target=watchdog, daemon=True).start()
    out = bytearray()
    truncated = False
    assert proc.stdout is not None
    while True:
        data = proc.stdout.read1(4096)
        if not data:
            break
        if truncated:
            continue
        if len(out) + len(data) <= max_output:
            out += data
            if on_chunk is not None and not on_chunk(data.decode("utf-8", "replace")):
                kill()
                break
        else:
            rest = data[: max(0, max_output - len(out))]
            out += rest
            if on_chunk is not None and rest:
                on_chunk(rest.decode("utf-8", "replace"))
            truncated = True
    code = proc.wait()
    done.set()
    proc.stdout.close()
    text = out.decode("utf-8", "replace") + ("\n[output truncated]" if truncated else "")
    return ExecResult(text, code if code >= 0 else 1, timed_out.is_set())


def resolve(path: str, cwd: str = "") -> str:
    """Absolute, ``~`` expanded, ``.``/``..`` folded (llama-server's ``tools_io_basic::resolve``)."""
    if path == "~" or path.startswith(("~/", "~\\")):
        home = os.environ.get("HOME", "")
        if home:
            path = home + path[1:]
    full = path if os.path.isabs(path) else os.path.join(cwd or os.getcwd(), path)
    return os.path.normpath(full)


@dataclass
class Listing:
    """The entries under a directory, or why there are none; ``truncated`` when the time budget
    ran out or a directory could not be read."""

    entries: list[tuple[str, bool]] = field(default_factory=list)  # (relative path, is a directory)
    error: str = ""
    truncated: bool = False


def list_entries(base: str, max_depth: int, kind: str) -> Listing:
    """Entries under ``base``: ``git ls-files`` for files inside a repository (``.gitignore``
    honoured), else a walk that skips links and junk directories, within a time budget."""
    if not os.path.isdir(base):
        return Listing(error="path does not exist or is not a directory")
    deadline = time.monotonic() + LIST_ENTRIES_TIMEOUT
    if kind == "file":
        res = run_process(["git", "-C", base, "ls-files", "--cached", "--others", "--exclude-standard"],
                          GIT_LS_FILES_MAX_OUTPUT, LIST_ENTRIES_TIMEOUT)
        if res.exit_code == 0 and not res.timed_out:
            out = Listing()
            for line in res.output.split("\n"):
                line = line.rstrip("\r").replace("\\", "/")
                if not line or (max_depth > 0 and line.count("/") + 1 > max_depth):
                    continue
                if os.path.isfile(os.path.join(base, line)):
                    out.entries.append((line, False))
            return out
    return _walk(base, max_depth, kind, deadline)


def _walk(base: str, max_depth: int, kind: str, deadline: float) -> Listing:
    out = Listing()
    stack: list[tuple[str, str, int]] = [(base, "", 0)]
    while stack:
        directory, rel_dir, depth = stack.pop()
        try:
            with os.scandir(directory) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError:
            out.truncated = True
            continue
        for entry in children:
            if time.monotonic() >= deadline:
                out.truncated = True
                return out
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                is_dir = entry.is_dir()
                is_file = not is_dir and entry.is_file()
            except OSError:
                continue
            if is_dir:
                if kind in ("dir", "all"):
                    out.entries.append((rel, True))
                if entry.name in JUNK_DIR_NAMES or entry.is_symlink():
                    continue
                if max_depth == 0 or depth + 1 < max_depth:
                    stack.append((entry.path, rel, depth + 1))
            elif is_file and kind in ("file", "all"):
                out.entries.append((rel, False))
    return out


def glob_regex(pattern: str) -> re.Pattern[str]:
    """llama.cpp's glob: ``**`` spans ``/``, ``*`` and ``?`` do not, ``[...]`` / ``[!...]`` classes."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = i + 1
            if end < len(pattern) and pattern[end] == "!":
                end += 1
            if end < len(pattern) and pattern[end] in "]-":
                end += 1
            end = pattern.find("]", end)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                negated = body.startswith("!")
                body = body[1:] if negated else body
                out.append("[" + ("^" if negated else "") + body.replace("\\", "\\\\").replace("^", "\\^") + "]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def path_glob_match(pattern: str, rel: str) -> bool:
    """No ``/`` in the pattern: match the basename; else the whole path, anchored with ``**/``."""
    if "/" not in pattern:
        return glob_regex(pattern).fullmatch(rel.rsplit("/", 1)[-1]) is not None
    if not (pattern == "**" or pattern.startswith(("**/", "/"))):
        pattern = "**/" + pattern
    return glob_regex(pattern).fullmatch(rel) is not None
