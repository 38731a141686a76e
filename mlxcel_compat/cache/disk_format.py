"""The disk tier's bookkeeping: file format, directory layout, index, budget and rejections.

Entries that leave RAM are written to a directory and found again by the same key and prefix
rules; slot files (``POST /slots/{id}?action=save``) use the same format. This module is pure
Python (no MLX): payload tensors arrive as buffers prepared by the adapter (``cache/kv_io.py``)
on the engine thread and are only read here, so the writing can happen on another thread.

**One entry, one file**: a standard safetensors file, readable with any safetensors tool::

    u64 LE n | JSON table (n bytes, padded with spaces to a multiple of 8) | tensor bytes
    table = {"__metadata__": {"format": "mlxcel-prompt-cache",
                              "header": <JSON text of the header record>,
                              "header_blake3": <hex BLAKE3 of that text>},
             "t0": {"dtype": "F32", "shape": [...], "data_offsets": [a, b]}, ...}

The header record carries everything needed to index the entry without reading its payload:
format version and key domain, the model fingerprint and runtime (``Compat``), the entry kind,
every key part (the bucket, field by field, and the session), the token ids (base64 of i32 LE),
origin, trimmability, logical bytes, the adapter's layout (cache classes and scalars), the tensor
table again (so a flipped digit in the outer table is caught), and the BLAKE3 of the tensor bytes.

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

**Directory layout**: ``DIR/<model key>/<kind>-<digest hex>.safetensors``, where the model key
is derived from the model fingerprint and the runtime. Servers of different models (or of an
incompatible mlx version) sharing a directory keep out of each other's way; a file found in a
model directory that does not belong there is rejected as ``foreign_model`` or
``incompatible_version`` and removed.

**Several processes on one directory**: readers never lock (files appear whole through rename;
the content a reader loads is checked against its checksums). The directory lock (``.lock``,
``flock``) serialises what changes many files at once: committing a write, enforcing the byte
budget (oldest modification time first, over every model directory) and clearing a tier. A
process indexes the whole directory at start-up and, while running, picks up what the others
wrote or deleted since its last look (``DiskIndex.refresh``, one ``stat`` when nothing changed); a
file another process evicted is a plain miss (``vanished``), never an error.

Nothing here is thread-safe except ``write_temp``/``commit``/``enforce_budget``, which touch only
files: the index belongs to the engine thread.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import mmap
import os
import secrets
import struct
import sys
import threading
import time
from array import array
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from blake3 import blake3

from mlxcel_compat.cache.block_hash import ApcConfig
from mlxcel_compat.cache.key import DOMAIN, Bucket, bucket_from_record, bucket_record, pack_tokens, prompt_digest
from mlxcel_compat.cache.snapshot import SnapshotStore
from mlxcel_compat.cache.store import CacheEntry, EntryStore, PromptCacheStore

FORMAT = "mlxcel-prompt-cache"
FORMAT_VERSION = 1
SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"
KINDS = ("kv", "snapshot", "slot")
TIER_KINDS = ("kv", "snapshot")  # what the disk tier stores; "slot" files live in --slot-save-path

# Why a file was not used, in the order checks run. Counted in stats and Prometheus.
REJECT_REASONS = (
    "not_a_cache_file",  # not our safetensors layout at all (garbage, another tool's file)
    "truncated",  # shorter than its header says (an interrupted copy; writes themselves are atomic)
    "size_mismatch",  # longer than its header says
    "corrupt_header",  # the header's checksum or structure does not hold
    "incompatible_version",  # another format version, key layout or mlx / mlx-lm runtime
    "foreign_model",  # written for another model
    "payload_checksum",  # the tensor bytes do not match their checksum
    "token_mismatch",  # the tokens are not the ones the index or the request expects
    "bad_payload",  # the tensors do not rebuild the cache objects the layout describes
    "unreadable",  # an I/O error other than "gone"
    "stale_temp",  # a temporary file left by a writer that died (kill -9, power loss)
)

_SCAN_THREADS = 8  # header reads in flight at start-up
REFRESH_MAX_FILES = 64  # other processes' new files indexed per refresh (headers read on the engine thread)
RACY_NS = 1_000_000_000  # a directory listed sooner than this after its mtime is listed again
_MAX_TABLE_BYTES = 256 << 20  # a bigger table is not ours (1M tokens take ~5.5 MB of base64)
_CHUNK = 8 << 20  # bytes hashed and written per step (keeps each GIL hold short)
_DIRECT_ALIGN = 4096  # O_DIRECT offsets, lengths and buffers are multiples of this
_staging = threading.local()  # each writer thread's page-aligned O_DIRECT buffer (_CHUNK bytes)
_no_direct_io: set[Path] = set()  # directories whose filesystem refused O_DIRECT: not tried again
_HEX_ZERO = "0" * 64
_DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}


class DiskReject(Exception):
    """A file that must not be used, with its classified reason (one of REJECT_REASONS)."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Compat:
    """What must match before a file's state may be used by this server.

    ``model``: fingerprint of the weights, config and tokenizer (``model/loader.py``).
    ``runtime``: the mlx and mlx-lm versions, device and compute dtype that produced the state;
    another runtime may lay out or compute KV differently, so its files are not adopted.
    """

    model: str
    runtime: str

    @property
    def directory_key(self) -> str:
        """The model directory name inside the cache directory (16 hex chars)."""
        return blake3(f"{self.model}\n{self.runtime}".encode()).hexdigest(length=8)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: safetensors dtype code, shape and byte range in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    def as_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), [self.begin, self.end]]


@dataclass
class Tensor:
    """A tensor to write: ``data`` is a buffer (a numpy array, possibly strided) of ``nbytes``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any
    nbytes: int


@dataclass
class EntryHeader:
    """The header record of one file (everything but the tensor bytes)."""

    kind: str
    compat: Compat
    bucket: Bucket
    session_key: str
    tokens: tuple[int, ...]
    origin: str
    trimmable: bool
    nbytes: int  # logical bytes of the state in RAM
    layout: dict[str, Any]  # the adapter's description of the cache objects (opaque here)
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the chat template digest of a slot file
    tensors: tuple[TensorInfo, ...] = ()  # filled by the writer / reader
    payload_bytes: int = 0
    payload_blake3: str = _HEX_ZERO

    @property
    def digest(self) -> bytes:
        return prompt_digest(self.bucket, self.session_key, self.tokens)

    def record(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "key_domain": DOMAIN.decode(),
            "kind": self.kind,
            "model": self.compat.model,
            "runtime": self.compat.runtime,
            "bucket": bucket_record(self.bucket),
            "session_key": self.session_key,
            "n_tokens": len(self.tokens),
            "tokens": base64.b64encode(pack_tokens(self.tokens)).decode("ascii"),
            "origin": self.origin,
            "trimmable": self.trimmable,
            "nbytes": self.nbytes,
            "layout": self.layout,
            "created": self.created,
            "extra": self.extra,
            "tensors": [t.as_json() for t in self.tensors],
            "payload_bytes": self.payload_bytes,
            "payload_blake3": self.payload_blake3,
        }


@dataclass(frozen=True)
class DiskRef:
    """Where an indexed entry's payload lives (the index's opaque payload)."""

    path: Path
    size: int
    kind: str


# --------------------------------------------------------------------------- file names


def entry_name(kind: str, digest: bytes) -> str:
    return f"{kind}-{digest.hex()}{SUFFIX}"


def _is_entry_name(name: str) -> bool:
    kind, _, rest = name.partition("-")
    return kind in TIER_KINDS and rest.endswith(SUFFIX) and len(rest) == 64 + len(SUFFIX)


# --------------------------------------------------------------------------- writing


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
    header.payload_blake3 = _HEX_ZERO
    table = _table_bytes(header)
    temp = final.parent / f"{TEMP_PREFIX}{final.stem}-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        prologue = struct.pack("<Q", len(table)) + table
        digest = None
        if temp.parent not in _no_direct_io:
            try:
                digest = _write_payload(_DirectFile.open(temp), prologue, tensors, pace)
            except _NoDirectIO:
                _no_direct_io.add(temp.parent)
                os.ftruncate(fd, 0)
        if digest is None:
            digest = _write_payload(_BufferedFile(fd), prologue, tensors, pace)
        header.payload_blake3 = digest
        final_table = _table_bytes(header)
        assert len(final_table) == len(table), "fixed-length header fields changed length"
        os.pwrite(fd, final_table, 8)
        os.fsync(fd)
        return TempFile(temp, fd, 8 + len(table) + pos, header)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _write_payload(out: _DirectFile | _BufferedFile, prologue: bytes, tensors: Sequence[Tensor],
                   pace: Callable[[int], None] | None) -> str:
    """Write the prologue and every tensor's bytes in order through ``out``; return their BLAKE3."""
    hasher = blake3()
    try:
        out.put(prologue)
        for t in tensors:
            if t.nbytes == 0:
                continue
            written = 0
            for block in _byte_blocks(np.asarray(t.data)):
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


class _NoDirectIO(Exception):
    """The filesystem (or platform) refused O_DIRECT: write through the page cache instead."""


class _BufferedFile:
    """Ordinary writes to ``fd`` (closed by the caller)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def put(self, data: Any) -> None:
        _write_all(self.fd, data)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class _DirectFile:
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
    def open(cls, path: Path) -> _DirectFile:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            raise _NoDirectIO
        try:
            return cls(os.open(path, os.O_WRONLY | flag))
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise _NoDirectIO from exc
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
                raise _NoDirectIO from exc
            raise
        if done != n:
            raise OSError(errno.EIO, f"short O_DIRECT write ({done} of {n} bytes)")
        self.offset += n
        self.fill = 0

    def close(self) -> None:
        self.view.release()
        os.close(self.fd)


def _byte_blocks(a: np.ndarray) -> Iterator[memoryview]:
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
            yield from _byte_blocks(sub)


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


def _table_bytes(header: EntryHeader) -> bytes:
    text = json.dumps(header.record(), separators=(",", ":"), ensure_ascii=True)
    table: dict[str, Any] = {
        "__metadata__": {"format": FORMAT, "header": text, "header_blake3": blake3(text.encode()).hexdigest()}
    }
    for t in header.tensors:
        table[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
    raw = json.dumps(table, separators=(",", ":"), ensure_ascii=True).encode()
    return raw + b" " * (-len(raw) % 8)


# --------------------------------------------------------------------------- reading


def read_header(path: Path, expect: Compat | None = None, kinds: Sequence[str] = KINDS) -> tuple[EntryHeader, int]:
    """Read and check a file's header without reading its payload.

    Args:
        path: the file.
        expect: when given, the model and runtime the file must have been written for.
        kinds: the entry kinds accepted.

    Returns:
        The header and the file's inode (to tell later whether the path still names this file).

    Raises:
        DiskReject: the file must not be used (the reason says why).
        FileNotFoundError: the file is gone (another process evicted it: a plain miss).
    """
    try:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) < 8:
                raise DiskReject("not_a_cache_file", f"{stat.st_size} bytes, shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_TABLE_BYTES:
                raise DiskReject("not_a_cache_file", f"table length {n} is implausible")
            raw = f.read(n)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise DiskReject("unreadable", f"{type(exc).__name__}: {exc}") from None
    header = _parse_table(raw, n, path)
    if header.kind not in kinds:
        raise DiskReject("not_a_cache_file", f"holds a {header.kind!r} entry, expected {'/'.join(kinds)}")
    if expect is not None:
        check_compat(header, expect)
    expected_size = 8 + n + header.payload_bytes
    if stat.st_size < expected_size:
        raise DiskReject("truncated", f"{stat.st_size} bytes, header says {expected_size}")
    if stat.st_size > expected_size:
        raise DiskReject("size_mismatch", f"{stat.st_size} bytes, header says {expected_size}")
    return header, stat.st_ino


def check_compat(header: EntryHeader, expect: Compat) -> None:
    """Raise ``DiskReject`` unless the file was written for this model and runtime."""
    if header.compat.model != expect.model:
        raise DiskReject("foreign_model", f"written for model {header.compat.model[:16]}, this server runs {expect.model[:16]}")
    if header.compat.runtime != expect.runtime:
        raise DiskReject("incompatible_version", f"written by {header.compat.runtime!r}, this server is {expect.runtime!r}")


def _parse_table(raw: bytes, n: int, path: Path) -> EntryHeader:
    if len(raw) < n:
        raise DiskReject("truncated", f"the table is cut short ({len(raw)} of {n} bytes)")
    try:
        table = json.loads(raw)
        meta = table["__metadata__"]
        if meta.get("format") != FORMAT:
            raise KeyError("format")
        text = meta["header"]
        check = meta["header_blake3"]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise DiskReject("not_a_cache_file", "not an mlxcel prompt-cache file") from None
    if not isinstance(text, str) or blake3(text.encode()).hexdigest() != check:
        raise DiskReject("corrupt_header", "the header checksum does not match")
    try:
        record = json.loads(text)
        if record["format_version"] != FORMAT_VERSION or record["key_domain"] != DOMAIN.decode():
            raise DiskReject(
                "incompatible_version",
                f"format {record['format_version']} / {record['key_domain']}, this server reads "
                f"{FORMAT_VERSION} / {DOMAIN.decode()}",
            )
        header = _header_from_record(record)
    except DiskReject:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DiskReject("corrupt_header", f"{type(exc).__name__}: {exc}") from None
    outer = {k: v for k, v in table.items() if k != "__metadata__"}
    inner = {t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]} for t in header.tensors}
    if outer != inner:
        raise DiskReject("corrupt_header", "the tensor table differs from the checksummed header")
    return header


def _header_from_record(record: dict[str, Any]) -> EntryHeader:
    tokens = _unpack_tokens(base64.b64decode(record["tokens"], validate=True))
    if len(tokens) != record["n_tokens"]:
        raise ValueError("token count mismatch")
    tensors = []
    pos = 0
    for name, dtype, shape, (begin, end) in record["tensors"]:
        size = _DTYPE_SIZES[dtype]
        count = 1
        for d in shape:
            count *= int(d)
        if begin != pos or end - begin != count * size:
            raise ValueError(f"tensor {name} has a malformed byte range")
        tensors.append(TensorInfo(str(name), str(dtype), tuple(int(d) for d in shape), begin, end))
        pos = end
    if pos != record["payload_bytes"]:
        raise ValueError("tensor ranges do not cover the payload")
    kind = record["kind"]
    if kind not in KINDS or not isinstance(record["session_key"], str) or not isinstance(record["layout"], dict):
        raise ValueError("malformed header fields")
    return EntryHeader(
        kind=kind,
        compat=Compat(model=str(record["model"]), runtime=str(record["runtime"])),
        bucket=bucket_from_record(record["bucket"]),
        session_key=record["session_key"],
        tokens=tokens,
        origin=str(record["origin"]),
        trimmable=bool(record["trimmable"]),
        nbytes=int(record["nbytes"]),
        layout=record["layout"],
        created=float(record["created"]),
        extra=dict(record.get("extra") or {}),
        tensors=tuple(tensors),
        payload_bytes=int(record["payload_bytes"]),
        payload_blake3=str(record["payload_blake3"]),
    )


def _unpack_tokens(raw: bytes) -> tuple[int, ...]:
    if len(raw) % 4:
        raise ValueError("token bytes are not a whole number of i32")
    packed = array("i")
    packed.frombytes(raw)
    if sys.byteorder != "little":
        packed.byteswap()
    return tuple(packed)


def payload_checksum(buffers: Sequence[Any]) -> str:
    """BLAKE3 hex of the tensor bytes in file order (each buffer C-contiguous)."""
    hasher = blake3()
    for buf in buffers:
        hasher.update(memoryview(buf).cast("B"))
    return hasher.hexdigest()


# --------------------------------------------------------------------------- directory


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
    for entry in _scandir(directory):
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
    for sub in _scandir(root):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for entry in _scandir(Path(sub.path)):
            if not _is_entry_name(entry.name):
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


def _scandir(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise
        return []


# --------------------------------------------------------------------------- index


class _FileBacked(EntryStore):
    """Mixin for the index stores: records each entry that leaves, so ``DiskIndex`` can delete its
    file (or keep it, when the entry was only forgotten or rewritten under the same name)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropped: list[DiskRef] = []

    def _on_entry_removed(self, entry: CacheEntry) -> None:
        super()._on_entry_removed(entry)
        self.dropped.append(entry.payload)  # type: ignore[arg-type]


class _KVIndex(_FileBacked, PromptCacheStore):
    pass


class _SnapshotIndex(_FileBacked, SnapshotStore):
    pass


@dataclass
class DiskCounters:
    """Monotonic counters of the index (the engine side adds its load and write counters)."""

    rejections: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    last_reject: dict[str, Any] | None = None
    removed_by_budget: int = 0
    vanished: int = 0  # indexed files another process removed
    picked_up: int = 0  # files another process wrote, indexed while running (``refresh``)
    refreshes: int = 0  # listings of the directory after a change


class DiskIndex:
    """Which entries are on disk, looked up by the same key and prefix rules as in RAM.

    Two index stores mirror the RAM stores (a ``PromptCacheStore`` for KV entries, with the same
    APC settings, and a ``SnapshotStore``); their payloads are ``DiskRef``s. Only the directory's
    byte budget evicts (``enforce_budget``, over all processes); an entry superseded in the index
    (a longer one of the same session and origin arrived) has its file deleted.
    """

    def __init__(self, root: Path, compat: Compat, capacity_bytes: int, min_prefix: int, apc: ApcConfig | None) -> None:
        self.root = root
        self.compat = compat
        self.capacity_bytes = capacity_bytes
        self.directory = root / compat.directory_key
        self.counters = DiskCounters()
        unbounded = dict(capacity_bytes=1 << 62, max_entries=1 << 31, ttl_seconds=0, min_prefix=min_prefix)
        self.stores: dict[str, _FileBacked] = {"kv": _KVIndex(apc=apc, **unbounded), "snapshot": _SnapshotIndex(**unbounded)}
        self._by_path: dict[Path, tuple[str, int]] = {}
        self._listed_mtime_ns: int | None = None  # the directory's mtime when it was last listed
        self._listed_at_ns = 0  # wall-clock time of that listing

    # --- start-up ---

    def open(self) -> dict[str, int]:
        """Create the directories, drop stale temporaries and bad files, index the rest.

        Reads only headers. Returns what was found (``files``, ``indexed``, ``rejected``,
        ``stale_temp``, ``removed_by_budget``).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self._listed_mtime_ns, self._listed_at_ns = os.stat(self.directory).st_mtime_ns, time.time_ns()
        found = dict(files=0, indexed=0, rejected=0, stale_temp=0, removed_by_budget=0)
        with directory_lock(self.root):
            stale = remove_stale_temps(self.directory)
            for _ in range(stale):
                self.reject("stale_temp", None, "a temporary file of a writer that died")
            found["stale_temp"] = stale
            paths = [Path(e.path) for e in _scandir(self.directory) if _is_entry_name(e.name)]
            found["files"] = len(paths)
            good: list[tuple[float, Path, int, EntryHeader]] = []
            # Header reads wait on the disk when the page cache is cold: overlap them.
            with ThreadPoolExecutor(_SCAN_THREADS) as pool:
                for path, outcome in zip(paths, pool.map(self._scan_one, paths)):
                    if isinstance(outcome, DiskReject):
                        self.reject(outcome.reason, path, outcome.detail, remove=True)
                        found["rejected"] += 1
                    elif outcome is not None:
                        good.append(outcome)
            removed = set(enforce_budget(self.root, self.capacity_bytes))
            found["removed_by_budget"] = len(removed)
            self.counters.removed_by_budget += len(removed)
        for _, path, size, header in sorted(good, key=lambda g: (g[0], g[1].name)):
            if path not in removed:
                found["indexed"] += self.add(header, path, size)
        return found

    def refresh(self, skip: Collection[Path] = ()) -> bool:
        """Pick up what other processes sharing the directory changed since the last look.

        Files that appeared are indexed (headers only, at most ``REFRESH_MAX_FILES`` a call, the
        rest at the next one), files that disappeared are forgotten. ``skip``: this process's
        own files still being committed. Creating, renaming and deleting a file change the
        directory's modification time, so when it is unchanged this costs one ``stat``. A change
        made within the timestamp's granularity after a listing may leave it unchanged, so a
        listing made less than ``RACY_NS`` after the time it saw is repeated at the next call
        (git treats its "racily clean" index the same way). Engine thread. Returns whether the
        directory was listed.
        """
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:
            return False
        if mtime == self._listed_mtime_ns and self._listed_at_ns - mtime >= RACY_NS:
            return False
        self._listed_mtime_ns, self._listed_at_ns = mtime, time.time_ns()
        self.counters.refreshes += 1
        # Names, not Paths: building a Path per file costs ~7 us, 14 ms for 2000 files.
        listed = {e.name for e in _scandir(self.directory) if _is_entry_name(e.name)}
        known = {p.name for p in self._by_path} | {p.name for p in skip}
        for path in [p for p in self._by_path if p.name not in listed]:
            self.counters.vanished += self.forget(path)
        new = [self.directory / name for name in sorted(listed - known)]
        if len(new) > REFRESH_MAX_FILES:
            new = new[:REFRESH_MAX_FILES]
            self._listed_mtime_ns = None  # list again at the next call
        good = []
        for path in new:
            outcome = self._scan_one(path)
            if isinstance(outcome, DiskReject):
                self.reject(outcome.reason, path, outcome.detail, remove=True)
            elif outcome is not None:
                good.append(outcome)
        for _, path, size, header in sorted(good, key=lambda g: (g[0], g[1].name)):
            self.counters.picked_up += self.add(header, path, size)
        return True

    def _scan_one(self, path: Path) -> tuple[float, Path, int, EntryHeader] | DiskReject | None:
        """One file's header at start-up: ``(mtime, path, size, header)``, a rejection, or None (gone)."""
        try:
            header, _ = read_header(path, self.compat, TIER_KINDS)
            if entry_name(header.kind, header.digest) != path.name:
                raise DiskReject("corrupt_header", "the file name does not match its key")
            st = path.stat()
        except FileNotFoundError:
            return None
        except DiskReject as exc:
            return exc
        return st.st_mtime, path, st.st_size, header

    # --- entries ---

    def add(self, header: EntryHeader, path: Path, size: int) -> bool:
        """Index a file that is on disk now (written by us, or found at start-up)."""
        store = self.stores[header.kind]
        old = store.find(header.digest)
        if old is not None:  # rewritten in place under the same name: forget, keep the file
            self._forget_entry(header.kind, old.id)
        result = store.insert(header.bucket, header.session_key, header.tokens, DiskRef(path, size, header.kind),
                              size, header.trimmable, header.origin)
        self._delete_dropped(keep=path)
        if not result.inserted:  # below --prompt-cache-min-prefix: it could never be adopted
            with contextlib.suppress(OSError):
                os.unlink(path)
            return False
        assert result.entry_id is not None
        self._by_path[path] = (header.kind, result.entry_id)
        return True

    def has(self, kind: str, bucket: Bucket, session_key: str, tokens: Sequence[int]) -> bool:
        """Whether this exact entry is on disk already (nothing to write when it leaves RAM)."""
        return self.stores[kind].find(prompt_digest(bucket, session_key, tuple(tokens))) is not None

    def forget(self, path: Path) -> bool:
        """The file is gone (evicted by the budget, or by another process): drop its entry."""
        where = self._by_path.get(path)
        if where is None:
            return False
        self._forget_entry(*where)
        return True

    def drop(self, path: Path) -> None:
        """Remove a file that must not be used again, and its entry."""
        self.forget(path)
        with contextlib.suppress(OSError):
            os.unlink(path)

    def clear(self) -> tuple[int, int]:
        """Delete every file of this model directory (``POST /v1/cache/reset``); return (files, bytes)."""
        files = bytes_ = 0
        with directory_lock(self.root):
            for e in _scandir(self.directory):
                if not _is_entry_name(e.name):
                    continue
                try:
                    size = e.stat(follow_symlinks=False).st_size
                    os.unlink(e.path)
                except OSError:
                    continue
                files += 1
                bytes_ += size
        for store in self.stores.values():
            store.reset()
            store.dropped.clear()
        self._by_path.clear()
        return files, bytes_

    def reject(self, reason: str, path: Path | None, detail: str, remove: bool = False) -> None:
        """Count a rejected file (and remove it, so it is not looked at again)."""
        self.counters.rejections[reason] += 1
        self.counters.last_reject = {"reason": reason, "file": path.name if path is not None else None, "detail": detail}
        if remove and path is not None:
            self.drop(path)

    @property
    def entries(self) -> int:
        return sum(len(s) for s in self.stores.values())

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stores.values())

    # --- helpers ---

    def _forget_entry(self, kind: str, entry_id: int) -> None:
        store = self.stores[kind]
        entry = store.get(entry_id)
        if entry is None:
            return
        store.remove(entry_id)
        store.dropped.clear()  # its file is gone, or is the one being kept
        self._by_path.pop(entry.payload.path, None)  # type: ignore[attr-defined]

    def _delete_dropped(self, keep: Path) -> None:
        for store in self.stores.values():
            dropped = store.dropped
            for ref in dropped:
                self._by_path.pop(ref.path, None)
                if ref.path != keep:
                    with contextlib.suppress(OSError):
                        os.unlink(ref.path)
            dropped.clear()
