"""The file format of disk-tier entries and slot files: header record, tensor table, reading.

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

Why a file is not used is one of ``REJECT_REASONS`` (raised as ``DiskReject``): the checks made
here (layout, sizes, checksums, model and runtime), and those made where a file is used (its
tokens, the rebuild of its payload) or cleaned up (stale temporaries).

How a file is written (atomically, with ``O_DIRECT``) is in ``cache/disk_write.py``, where it
lives in ``cache/disk_directory.py``, and how a process indexes the files in
``cache/disk_index.py``.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from mlxcel_compat.cache.key import (
    DOMAIN,
    Bucket,
    bucket_from_record,
    bucket_record,
    pack_tokens,
    prompt_digest,
    unpack_tokens,
)

FORMAT = "mlxcel-prompt-cache"
FORMAT_VERSION = 1
KINDS = ("kv", "snapshot", "slot")
KV_TAG = "; kv "  # the runtime tag's last part: the KV storage types, "f16/f16" (kv_io.runtime_tag)
TIER_KINDS = ("kv", "snapshot")  # what the disk tier stores; "slot" files live in --slot-save-path

# Why a file was not used, in the order checks run. Counted in stats and Prometheus.
REJECT_REASONS = (
    "not_a_cache_file",  # not our safetensors layout at all (garbage, another tool's file)
    "truncated",  # shorter than its header says (an interrupted copy; writes themselves are atomic)
    "size_mismatch",  # longer than its header says
    "corrupt_header",  # the header's checksum or structure does not hold
    "incompatible_version",  # another format version, key layout or mlx / mlx-lm runtime
    "kv_precision",  # the KV was stored in another type (-ctk/-ctv)
    "foreign_model",  # written for another model
    "payload_checksum",  # the tensor bytes do not match their checksum
    "token_mismatch",  # the tokens are not the ones the index or the request expects
    "bad_payload",  # the tensors do not rebuild the cache objects the layout describes
    "unreadable",  # an I/O error other than "gone"
    "stale_temp",  # a temporary file left by a writer that died (kill -9, power loss)
)

_MAX_TABLE_BYTES = 256 << 20  # a bigger table is not ours (1M tokens take ~5.5 MB of base64)
# The checksum field's placeholder until the payload is hashed: as long as a digest, so the
# header can be patched in place once the payload is written.
ZERO_BLAKE3 = "0" * 64
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
    payload_blake3: str = ZERO_BLAKE3

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


def table_bytes(header: EntryHeader) -> bytes:
    """The safetensors table of a file: its checksummed header record and the tensor entries,
    padded with spaces to a multiple of 8 bytes."""
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
        theirs, _, their_kv = header.compat.runtime.partition(KV_TAG)
        ours, _, our_kv = expect.runtime.partition(KV_TAG)
        if theirs == ours and their_kv != our_kv:
            raise DiskReject("kv_precision", f"the KV was stored as {their_kv or '?'} (K/V), this server stores "
                                             f"{our_kv or '?'} (-ctk/-ctv)")
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
    tokens = unpack_tokens(base64.b64decode(record["tokens"], validate=True))
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


def payload_checksum(buffers: Sequence[Any]) -> str:
    """BLAKE3 hex of the tensor bytes in file order (each buffer C-contiguous)."""
    hasher = blake3()
    for buf in buffers:
        hasher.update(memoryview(buf).cast("B"))
    return hasher.hexdigest()

