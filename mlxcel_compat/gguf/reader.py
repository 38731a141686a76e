"""Read a GGUF file (or every part of a split one): its metadata and where each tensor lives.

The header (metadata and tensor table) is parsed here with ``struct``; tensor bytes are then read
one tensor at a time, so loading never holds the whole file: the memory peak is the decoded
weights plus one tensor in flight. Quantized tensors are read with ``os.preadv`` into NumPy
(``read_tensor``) and decoded there; float tensors (F32, F16, BF16) are read straight into MLX
memory (``read_float_tensor``), the one copy a safetensors load makes too. Tensors the CPU
serves from their blocks are not read at all: they are views of the mapped file (``map_file``).

A split model (``name-00001-of-00003.gguf``, written by ``gguf-split`` or the converter) is
opened from its first part; the other parts are found beside it, as llama.cpp does.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import struct
import threading
import weakref
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel_compat.gguf.quants import T, byte_size, type_name

log = logging.getLogger(__name__)

_RELEASE_WAIT_S = 10.0  # how long read_float_tensor waits for MLX to let go of its reader

SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# llama.cpp's llama_model_ftype_name for general.file_type (what llama-server logs as "file type").
FILE_TYPE_NAMES: dict[int, str] = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K - Medium", 11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large",
    14: "Q4_K - Small", 15: "Q4_K - Medium", 16: "Q5_K - Small", 17: "Q5_K - Medium",
    18: "Q6_K", 19: "IQ2_XXS - 2.0625 bpw", 20: "IQ2_XS - 2.3125 bpw", 21: "Q2_K - Small",
    22: "IQ3_XS - 3.3 bpw", 23: "IQ3_XXS - 3.0625 bpw", 24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw", 26: "IQ3_S - 3.4375 bpw", 27: "IQ3_S mix - 3.66 bpw",
    28: "IQ2_S - 2.5 bpw", 29: "IQ2_M - 2.7 bpw", 30: "IQ4_XS - 4.25 bpw", 31: "IQ1_M - 1.75 bpw",
    32: "BF16", 36: "TQ1_0 - 1.69 bpw", 37: "TQ2_0 - 2.06 bpw", 38: "MXFP4 MoE",
}


# Float GGML types MLX holds as they are stored: GGML type -> safetensors dtype name.
FLOAT_TYPES: dict[int, str] = {T.F32: "F32", T.F16: "F16", T.BF16: "BF16"}


class GGUFError(ValueError):
    """The file is not a GGUF model this server can open; the message says why."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its GGUF name, storage type and where its bytes are."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # NumPy order: GGUF's ne[] reversed (rows, cols)
    path: Path
    offset: int  # absolute byte offset in ``path``
    n_bytes: int

    @property
    def n_values(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass
class GGUFModelFile:
    """A GGUF model: metadata of the first part, tensors of all parts (in file order)."""

    path: Path
    parts: list[Path]
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    header_bytes: int = 0  # where the first part's tensor data starts (metadata + tensor table before it)
    overrides_json: str = ""  # --override-kv applied to ``metadata`` (gguf/overrides.py), "" for none

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``{arch}.{key}``, e.g. ``arch_value("attention.head_count")``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def size_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

    @property
    def n_params(self) -> int:
        return sum(t.n_values for t in self.tensors.values())

    def type_counts(self) -> dict[str, int]:
        """How many tensors each GGML type holds, as llama.cpp logs them ("type q8_0: 14 tensors")."""
        counts = Counter(type_name(t.ggml_type).lower() for t in self.tensors.values())
        return dict(sorted(counts.items()))

    @property
    def file_type(self) -> str:
        """llama.cpp's name for ``general.file_type`` ("Q4_K - Medium"), "unknown" if absent."""
        value = self.metadata.get("general.file_type")
        if value is None:
            return "unknown"
        return FILE_TYPE_NAMES.get(int(value), f"type {value}")


def is_gguf_path(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def split_parts(path: Path) -> list[Path]:
    """All parts of a split model named like ``path`` (just ``[path]`` for a single file)."""
    match = SPLIT_NAME.match(path.name)
    if not match:
        return [path]
    count = int(match["count"])
    return [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


# Metadata arrays of at least this many items (a vocabulary's tokens, scores, types, merges) are
# kept packed instead of as Python lists: 262K token strings and scores as Python objects took
# ~35 MiB, and once freed left ~18 MiB of the interpreter's arenas held, pinned by the few
# objects the load made in between (Gemma 3 270M).
PACKED_MIN = 4096


class PackedStrings(Sequence[str]):
    """A GGUF string array as its bytes: a string is decoded when read (``[i]``, iteration).
    Compares equal to any sequence of the same strings."""

    def __init__(self, blob: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        self.blob, self.starts, self.ends = blob, starts, ends

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.blob[self.starts[index]:self.ends[index]].decode("utf-8", "replace")

    def __iter__(self) -> Iterator[str]:
        blob = self.blob
        for start, end in zip(self.starts.tolist(), self.ends.tolist()):
            yield blob[start:end].decode("utf-8", "replace")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"PackedStrings({len(self)} strings)"

    def tolist(self) -> list[str]:
        return list(self)


class PackedNumbers(Sequence[Any]):
    """A GGUF number array as a NumPy array: items read back as Python numbers, as a list's.
    Compares equal to any sequence of the same numbers."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: Any) -> Any:
        return self.values[index].tolist()

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values.tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and self.values.tolist() == list(other)

    def __repr__(self) -> str:
        return f"PackedNumbers({len(self)} {self.values.dtype})"

    def tolist(self) -> list[Any]:
        return self.values.tolist()


def unpacked(value: Any) -> Any:
    """A metadata value with packed arrays as lists (what code outside this server expects)."""
    return value.tolist() if isinstance(value, (PackedStrings, PackedNumbers)) else value


class _Cursor:
    """Sequential little-endian reads over the header bytes of a GGUF file (an ``mmap``: slices are ``bytes``)."""

    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> Any:
        if self.pos + n > len(self.data):
            raise GGUFError(f"'{self.path}' ends inside its header")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def scalar(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("Q")).decode("utf-8", errors="replace")


# GGUF metadata value types -> struct format (8 = string, 9 = array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


_U64 = struct.Struct("<Q").unpack_from


def _strings(cur: _Cursor, count: int) -> list[str] | PackedStrings:
    """A string array (vocabularies, merges): the hot loop of header parsing, kept tight
    (``unpack_from`` and ``bytes`` slices of the map: 2x faster than slicing a memoryview).
    Arrays of ``PACKED_MIN`` strings or more stay packed (:class:`PackedStrings`)."""
    data, pos = cur.data, cur.pos
    u64 = _U64
    if count >= PACKED_MIN:
        first, starts, ends = pos, array("q"), array("q")
        for _ in range(count):
            (n,) = u64(data, pos)
            starts.append(pos + 8 - first)
            pos += 8 + n
            ends.append(pos - first)
        if pos > len(data):
            raise GGUFError(f"'{cur.path}' ends inside its header")
        cur.pos = pos
        return PackedStrings(bytes(data[first:pos]), np.frombuffer(starts, np.int64), np.frombuffer(ends, np.int64))
    out: list[str] = []
    append = out.append
    for _ in range(count):
        (n,) = u64(data, pos)
        pos += 8
        append(data[pos:pos + n].decode("utf-8", "replace"))
        pos += n
    if pos > len(data):
        raise GGUFError(f"'{cur.path}' ends inside its header")
    cur.pos = pos
    return out


def _value(cur: _Cursor, kind: int) -> Any:
    if kind == _STRING:
        return cur.string()
    if kind == _ARRAY:
        item, count = cur.scalar("I"), cur.scalar("Q")
        if item == _STRING:
            return _strings(cur, count)
        if item == _ARRAY:
            return [_value(cur, _ARRAY) for _ in range(count)]
        fmt = np.dtype("<" + _SCALARS[item])
        values = np.frombuffer(cur.take(count * fmt.itemsize), dtype=fmt)
        return PackedNumbers(values) if count >= PACKED_MIN else values.tolist()
    if kind not in _SCALARS:
        raise GGUFError(f"'{cur.path}' has a metadata value of unknown type {kind}")
    return cur.scalar(_SCALARS[kind])


def _read_part(path: Path, metadata_keys: bool) -> tuple[dict[str, Any], list[TensorInfo], int]:
    """Parse one file's header: a plain loop over the bytes (gguf-py's reader builds a NumPy view
    per string, seconds for a 150K-token vocabulary)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse_header(_Cursor(data, path), path, metadata_keys)
    except struct.error as exc:  # a length field pointing past the end of the file
        raise GGUFError(f"'{path}' ends inside its header") from exc
    except (OSError, ValueError) as exc:
        if isinstance(exc, GGUFError):
            raise
        raise GGUFError(f"'{path}' is not a readable GGUF file: {exc}") from exc


def _parse_header(cur: _Cursor, path: Path, metadata_keys: bool) -> tuple[dict[str, Any], list[TensorInfo], int]:
    if bytes(cur.take(4)) != b"GGUF":
        raise GGUFError(f"'{path}' is not a GGUF file (bad magic)")
    version = cur.scalar("I")
    if version not in (2, 3):
        raise GGUFError(f"'{path}' is GGUF version {version}; versions 2 and 3 are supported")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        value = _value(cur, cur.scalar("I"))
        if metadata_keys or key.startswith("split.") or key == "general.alignment":
            metadata[key] = value
    raw = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
        raw.append((name, tuple(int(d) for d in reversed(dims)), cur.scalar("I"), cur.scalar("Q")))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, ggml_type, offset in raw:
        n_values = int(np.prod(shape)) if shape else 1
        try:
            n_bytes = byte_size(ggml_type, n_values)
        except (KeyError, ValueError):
            n_bytes = 0  # an unknown type: refused by name before any data is read
        tensors.append(TensorInfo(name, ggml_type, shape, path, data_start + offset, n_bytes))
    return metadata, tensors, data_start


def open_gguf(path: str | Path) -> GGUFModelFile:
    """Read the header of ``path`` and of every other part of a split model."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"GGUF file '{path}' does not exist")
    metadata, tensors, header_bytes = _read_part(path, metadata_keys=True)
    n_split = int(metadata.get("split.count", 1) or 1)
    parts = [path]
    if n_split > 1:
        if int(metadata.get("split.no", 0)) != 0:
            raise GGUFError(f"'{path}' is part {int(metadata['split.no']) + 1} of a split model; "
                            "pass the first part (…-00001-of-…)")
        parts = split_parts(path)
        if len(parts) != n_split:
            raise GGUFError(f"'{path}' says the model has {n_split} parts, but its name does not follow "
                            "the NAME-00001-of-0000N.gguf pattern")
        for part in parts[1:]:
            if not part.is_file():
                raise GGUFError(f"split part '{part}' is missing (the model has {n_split} parts)")
            _, more, _ = _read_part(part, metadata_keys=False)
            tensors.extend(more)
    file = GGUFModelFile(path=path, parts=parts, metadata=metadata, header_bytes=header_bytes)
    for info in tensors:
        if info.name in file.tensors:
            raise GGUFError(f"tensor '{info.name}' appears twice in '{path}'")
        file.tensors[info.name] = info
    if not file.architecture:
        raise GGUFError(f"'{path}' has no general.architecture: not a GGUF model")
    return file


def read_tensor(info: TensorInfo, scratch: np.ndarray | None = None) -> np.ndarray:
    """The raw bytes of one tensor (uint8), read without mapping the file.

    ``scratch`` (uint8, at least ``n_bytes``) is reused instead of a fresh buffer: its pages are
    already mapped, which saves a page fault per 4 KiB on every tensor. The result is a view of it.
    """
    if scratch is not None:
        buffer = scratch[:info.n_bytes]
    else:
        buffer = np.empty(info.n_bytes, dtype=np.uint8)  # not zero-filled: preadv writes every byte
    view = memoryview(buffer)
    fd = os.open(info.path, os.O_RDONLY)
    try:
        done = 0
        while done < info.n_bytes:
            n = os.preadv(fd, [view[done:]], info.offset + done)
            if n <= 0:
                raise GGUFError(f"'{info.path}' ends inside tensor '{info.name}'")
            done += n
    finally:
        os.close(fd)
    return buffer


def map_file(path: Path, use_mmap: bool = True, mlock: bool = False) -> np.ndarray:
    """The whole of ``path`` as a read-only uint8 array over a shared memory map.

    Tensors served from their blocks are views of it: loading copies nothing, the pages are the
    page cache's (shared with every process that maps the file, kept across restarts), and the
    map is populated up front, as llama.cpp maps its models, so the first request does not
    fault them in one by one.

    llama-server's loading flags act on it as on llama.cpp's mapping: ``use_mmap=False``
    (``--no-mmap``) reads the file into anonymous memory of the process instead (nothing of the
    file stays mapped; its pages are never dropped back to the page cache); ``mlock=True``
    (``--mlock``) locks the bytes in RAM (``mlock(2)``), so the kernel never swaps or drops
    them; where the limit forbids it (``RLIMIT_MEMLOCK``), a warning says so and loading goes on,
    as in llama.cpp.
    """
    if use_mmap:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with open(path, "rb") as f:
            mapped = np.frombuffer(mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ), dtype=np.uint8)
    else:
        mapped = _read_whole(path)
    if mlock:
        lock_memory(mapped, path)
    return mapped


def _read_whole(path: Path) -> np.ndarray:
    """``path`` read into the process's own memory (``--no-mmap``), made read-only like a map."""
    size = os.path.getsize(path)
    buffer = np.empty(size, dtype=np.uint8)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            n = os.preadv(fd, [view[done:]], done)
            if n <= 0:
                raise GGUFError(f"'{path}' changed size while it was read")
            done += n
    finally:
        os.close(fd)
    buffer.flags.writeable = False
    return buffer


def lock_memory(array: np.ndarray, path: Path) -> bool:
    """``mlock(2)`` the bytes of ``array``; False (and a warning) where the system refuses."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mlock.argtypes, libc.mlock.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError) as exc:
        log.warning("--mlock: cannot lock '%s' in memory here (%s)", path, exc)
        return False
    if array.size and libc.mlock(array.ctypes.data, array.nbytes) != 0:
        err = ctypes.get_errno()
        log.warning("--mlock: failed to lock %d bytes of '%s' (%s); try increasing RLIMIT_MEMLOCK ('ulimit -l')",
                    array.nbytes, path, os.strerror(err))
        return False
    return True


def tensor_view(info: TensorInfo, mapped: np.ndarray) -> np.ndarray:
    """The raw bytes of one tensor, a view of its file's map (``map_file``)."""
    if info.offset + info.n_bytes > mapped.size:
        raise GGUFError(f"'{info.path}' ends inside tensor '{info.name}'")
    return mapped[info.offset:info.offset + info.n_bytes]


class SafetensorsView:
    """One GGUF float tensor seen as a one-tensor safetensors file, for ``mx.load``.

    ``mx.load`` on a file object allocates each array and ``readinto``s its bytes straight into
    MLX memory, the single copy a safetensors checkpoint costs. This object answers those reads
    with a synthesised header (name ``tensor``, the dtype and shape from *our* GGUF header) and
    then the tensor's bytes, read with ``os.preadv`` at its offset in the GGUF file. MLX's own
    GGUF reader is not involved (see ``gguf_quants`` for its measured faults).
    """

    KEY = "tensor"

    def __init__(self, fd: int, info: TensorInfo) -> None:
        entry = {"dtype": FLOAT_TYPES[info.ggml_type], "shape": list(info.shape), "data_offsets": [0, info.n_bytes]}
        header = json.dumps({self.KEY: entry}).encode()
        self.prefix = struct.pack("<Q", len(header)) + header
        self.fd, self.info, self.pos, self.closed = fd, info, 0, False

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        end = len(self.prefix) + self.info.n_bytes
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: end}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        if self.pos < len(self.prefix):
            done = min(len(view), len(self.prefix) - self.pos)
            view[:done] = self.prefix[self.pos:self.pos + done]
            self.pos += done
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], self.info.offset + self.pos - len(self.prefix))
            if n <= 0:
                raise GGUFError(f"'{self.info.path}' ends inside tensor '{self.info.name}'")
            done += n
            self.pos += n
        return done


def read_float_tensor(info: TensorInfo) -> Any:
    """An F32, F16 or BF16 tensor as an evaluated MLX array in its stored dtype and shape.

    The bytes go from the file into the array's own memory (no NumPy buffer, no second copy).
    What ``mx.load`` returns is checked against the GGUF header: exactly one tensor, with the
    shape and dtype the header gives, else ``GGUFError``.
    """
    import mlx.core as mx

    if info.ggml_type not in FLOAT_TYPES:
        raise GGUFError(f"tensor '{info.name}' is {type_name(info.ggml_type)}, not a float type")
    expected = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: mx.bfloat16}[info.ggml_type]
    fd = os.open(info.path, os.O_RDONLY)
    try:
        view = SafetensorsView(fd, info)
        released = threading.Event()
        weakref.finalize(view, released.set)
        loaded = mx.load(view, format="safetensors")
        del view
        # MLX reads on its I/O pool, whose worker drops its reference to ``view`` only after the
        # read has been handed back, taking the GIL to do it. Wait for that here (the wait lets
        # the GIL go): left pending, it can land after the interpreter began to exit, where the
        # worker's GIL request ends its thread inside a C++ destructor and the process aborts.
        if not released.wait(_RELEASE_WAIT_S):
            log.warning("MLX kept its reader of tensor '%s' past %.0f s", info.name, _RELEASE_WAIT_S)
    finally:
        os.close(fd)
    array = loaded.get(SafetensorsView.KEY)
    if len(loaded) != 1 or array is None or tuple(array.shape) != info.shape or array.dtype != expected:
        got = {k: (tuple(v.shape), v.dtype) for k, v in loaded.items()}
        raise GGUFError(f"tensor '{info.name}': MLX read {got}, the GGUF header says {info.shape} {expected}")
    return array
