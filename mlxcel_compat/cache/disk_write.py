"""Writing a disk-tier entry or slot file: atomic, durable, and gentle on a decoding engine.

**Writes are atomic**: a temporary file ``.tmp-<name>-<pid>-<random>`` in the same directory,
held under an exclusive ``flock`` while it is written, hashed while it is written, header patched
in place (fixed-length hex fields), fsync, rename over the final name, fsync of the directory. The
bytes go to the device with ``O_DIRECT`` where the filesystem takes it (through one reused,
page-aligned staging buffer; the tail is padded and the file truncated back): written through
the page cache, a 50 MB entry left 50 MB of dirty pages that the kernel, and then the fsync,
flushed in bursts, which cost a decoding engine on the same cores up to 17 % of its speed
(docs/benchmarks/disk-tier.md). tmpfs and other filesystems that refuse it get ordinary writes.
A crash leaves only a temporary file; at start-up a temporary file whose lock can be taken belongs
to a dead writer and is removed (``stale_temp``).

``write_temp``, ``commit`` and ``discard`` touch only files, so they run on the disk tier's
writer thread. Pure Python (no MLX): the tensors are buffers prepared by the adapter
(``cache/kv_io.py``) and are only read here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

from mlxcel_compat.cache.disk_directory import TEMP_PREFIX
from mlxcel_compat.cache.disk_format import ZERO_BLAKE3, EntryHeader, Tensor, TensorInfo, table_bytes

_CHUNK = 8 << 20  # bytes hashed and written per step (keeps each GIL hold short)
_DIRECT_ALIGN = 4096  # O_DIRECT offsets, lengths and buffers are multiples of this
_staging = threading.local()  # each writer thread's page-aligned O_DIRECT buffer (_CHUNK bytes)
_no_direct_io: set[Path] = set()  # directories whose filesystem refused O_DIRECT: not tried again


@dataclass
class TempFile:
    """A fully written, fsynced temporary file, still locked by its writer until committed."""

    path: Path
    fd: int
    size: int
    header: EntryHeader


def write_temp(final: Path, header: EntryHeader, tensors: Sequence[Tensor],
               pace: Callable[[int], None] | None = None) -> TempFile:
    """Write ``header`` and ``tensors`` to a locked temporary file next to ``final``.

    The payload is hashed while it is written and the header patched afterwards, so the bytes
    are read once. ``pace(n)`` is called after each step of ``n`` payload bytes (the writer
    thread slows itself down there). Any failure removes the temporary file and re-raises.
    """
    offsets: list[TensorInfo] = []
    pos = 0
    for t in tensors:
        offsets.append(TensorInfo(t.name, t.dtype, tuple(int(d) for d in t.shape), pos, pos + t.nbytes))
        pos += t.nbytes
    header.tensors = tuple(offsets)
    header.payload_bytes = pos
    header.payload_blake3 = ZERO_BLAKE3
    table = table_bytes(header)
    temp = final.parent / f"{TEMP_PREFIX}{final.stem}-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        prologue = struct.pack("<Q", len(table)) + table
        digest = None
        if temp.parent not in _no_direct_io:
            try:
                digest = _write_payload(DirectFile.open(temp), prologue, tensors, pace)
            except NoDirectIO:
                _no_direct_io.add(temp.parent)
                os.ftruncate(fd, 0)
        if digest is None:
            digest = _write_payload(BufferedFile(fd), prologue, tensors, pace)
        header.payload_blake3 = digest
        final_table = table_bytes(header)
        assert len(final_table) == len(table), "fixed-length header fields changed length"
        os.pwrite(fd, final_table, 8)
        os.fsync(fd)
        return TempFile(temp, fd, 8 + len(table) + pos, header)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _write_payload(out: DirectFile | BufferedFile, prologue: bytes, tensors: Sequence[Tensor],
                   pace: Callable[[int], None] | None) -> str:
    """Write the prologue and every tensor's bytes in order through ``out``; return their BLAKE3."""
    hasher = blake3()
    try:
        out.put(prologue)
        for t in tensors:
            if t.nbytes == 0:
                continue
            written = 0
            for block in byte_blocks(np.asarray(t.data)):
                for start in range(0, len(block), _CHUNK):
                    chunk = block[start : start + _CHUNK]
                    hasher.update(chunk)
                    out.put(chunk)
                    if pace is not None:
                        pace(len(chunk))
                written += len(block)
            if written != t.nbytes:
                raise ValueError(f"tensor {t.name}: {written} bytes, expected {t.nbytes}")
        out.finish()
    finally:
        out.close()
    return hasher.hexdigest()


class NoDirectIO(Exception):
    """The filesystem (or platform) refused O_DIRECT: write through the page cache instead."""


class BufferedFile:
    """Ordinary writes to ``fd`` (closed by the caller)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def put(self, data: Any) -> None:
        _write_all(self.fd, data)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class DirectFile:
    """O_DIRECT writes to a second descriptor of the temporary file, through the writer thread's
    staging buffer: whole aligned buffers at aligned offsets, the tail padded, then the file
    truncated to its real length."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        if getattr(_staging, "buffer", None) is None:
            _staging.buffer = mmap.mmap(-1, _CHUNK)  # anonymous maps are page-aligned
        self.view = memoryview(_staging.buffer)
        self.fill = 0  # bytes waiting in the staging buffer
        self.offset = 0  # file offset of the staging buffer's first byte

    @classmethod
    def open(cls, path: Path) -> DirectFile:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            raise NoDirectIO
        try:
            return cls(os.open(path, os.O_WRONLY | flag))
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise NoDirectIO from exc
            raise

    def put(self, data: Any) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            n = min(len(data), _CHUNK - self.fill)
            self.view[self.fill : self.fill + n] = data[:n]
            self.fill += n
            data = data[n:]
            if self.fill == _CHUNK:
                self._write(_CHUNK)

    def finish(self) -> None:
        size = self.offset + self.fill
        if self.fill:
            padded = -(-self.fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
            self.view[self.fill : padded] = bytes(padded - self.fill)
            self._write(padded)
        os.ftruncate(self.fd, size)

    def _write(self, n: int) -> None:
        try:
            done = os.pwrite(self.fd, self.view[:n], self.offset)
        except OSError as exc:
            if exc.errno == errno.EINVAL and self.offset == 0:  # alignment the device does not take
                raise NoDirectIO from exc
            raise
        if done != n:
            raise OSError(errno.EIO, f"short O_DIRECT write ({done} of {n} bytes)")
        self.offset += n
        self.fill = 0

    def close(self) -> None:
        self.view.release()
        os.close(self.fd)


def byte_blocks(a: np.ndarray) -> Iterator[memoryview]:
    """The bytes of ``a`` in C order, as views of its C-contiguous pieces.

    A stored KV entry is a slice of a longer buffer (``keys[..., :n, :]``): not contiguous as a
    whole, but each head's rows are. Writing those pieces directly avoids copying every tensor
    once more, which decode would feel (it competes for the same memory bandwidth); only pieces
    smaller than 64 KiB are gathered by a copy.
    """
    if a.flags.c_contiguous:
        yield memoryview(a).cast("B")
    elif a.ndim == 0 or a[0].nbytes < (1 << 16):
        yield memoryview(np.ascontiguousarray(a)).cast("B")
    else:
        for sub in a:
            yield from byte_blocks(sub)


def commit(temp: TempFile, final: Path) -> None:
    """Rename the temporary file over ``final`` (atomic), then make the rename durable."""
    try:
        os.replace(temp.path, final)
    finally:
        os.close(temp.fd)  # releases the flock only now: a cleaner never sees a live temp unlocked
    _fsync_dir(final.parent)


def discard(temp: TempFile) -> None:
    with contextlib.suppress(OSError):
        os.unlink(temp.path)
    os.close(temp.fd)


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data)
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is atomic
    finally:
        os.close(fd)
