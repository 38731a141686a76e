"""The disk tier's directory: file names, the directory lock, stale temporaries and the byte budget.

**Directory layout**: ``DIR/<model key>/<kind>-<digest hex>.safetensors``, where the model key
is derived from the model fingerprint and the runtime. Servers of different models (or of an
incompatible mlx version) sharing a directory keep out of each other's way; a file found in a
model directory that does not belong there is rejected as ``foreign_model`` or
``incompatible_version`` and removed.

**Several processes on one directory**: readers never lock (files appear whole through rename;
the content a reader loads is checked against its checksums). The directory lock (``.lock``,
``flock``) serialises what changes many files at once: committing a write, enforcing the byte
budget (oldest modification time first, over every model directory) and clearing a tier. What
the other processes wrote or deleted, each one's index picks up (``cache/disk_index.py``).

``enforce_budget`` touches only files, so any thread may run it. Pure Python (no MLX).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mlxcel_compat.cache.disk_format import TIER_KINDS

SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"


def entry_name(kind: str, digest: bytes) -> str:
    """The file name of an entry: ``<kind>-<digest hex>.safetensors``."""
    return f"{kind}-{digest.hex()}{SUFFIX}"


def is_entry_name(name: str) -> bool:
    """Whether ``name`` is a disk-tier entry file's (``<kv|snapshot>-<digest hex>.safetensors``):
    temporaries, the lock and slot files are not."""
    kind, _, rest = name.partition("-")
    return kind in TIER_KINDS and rest.endswith(SUFFIX) and len(rest) == 64 + len(SUFFIX)


@contextlib.contextmanager
def directory_lock(root: Path) -> Iterator[None]:
    """The cache directory's exclusive lock (between processes and between threads)."""
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_stale_temps(directory: Path) -> int:
    """Remove temporary files whose writer is gone (their lock can be taken); return how many."""
    removed = 0
    for entry in directory_entries(directory):
        if not entry.name.startswith(TEMP_PREFIX):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live writer holds it
        try:
            os.unlink(entry.path)
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


@dataclass(frozen=True)
class DiskFile:
    path: Path
    size: int
    mtime: float


def list_entry_files(root: Path) -> list[DiskFile]:
    """Every entry file of every model directory under ``root``, oldest modification first."""
    files = []
    for sub in directory_entries(root):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for entry in directory_entries(Path(sub.path)):
            if not is_entry_name(entry.name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            files.append(DiskFile(Path(entry.path), st.st_size, st.st_mtime))
    files.sort(key=lambda f: (f.mtime, f.path.name))
    return files


def enforce_budget(root: Path, capacity_bytes: int) -> list[Path]:
    """Delete the oldest entry files (by modification time) until the directory fits the budget.

    Runs under the directory lock, over every model directory, so several processes sharing the
    directory keep one budget. Returns the deleted paths.
    """
    files = list_entry_files(root)
    total = sum(f.size for f in files)
    removed: list[Path] = []
    for f in files:
        if total <= capacity_bytes:
            break
        try:
            os.unlink(f.path)
        except FileNotFoundError:
            pass  # another process was faster
        except OSError:
            continue
        total -= f.size
        removed.append(f.path)
    return removed


def touch(path: Path) -> None:
    """Mark a file as recently used (the budget evicts the oldest modification time first)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def directory_entries(directory: Path) -> list[os.DirEntry]:
    """The entries of ``directory``; none when it is gone or not a directory (another process
    may have removed it)."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise
        return []
