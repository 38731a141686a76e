"""Shared stand-ins for the cache bookkeeping tests (no MLX)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from blake3 import blake3

from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, Bucket


class FakeClock:
    """An injectable clock that only moves when told to (TTL tests)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_bucket(model_id: str = "tiny", mm_digest: bytes = TEXT_ONLY_MM_DIGEST, namespace: str = "") -> Bucket:
    return Bucket(
        model_id=model_id, lora_id="", template_sig=RAW_PROMPT_TEMPLATE_SIG, rope_regime=None, mm_digest=mm_digest, namespace=namespace
    )


def rewrite_record(path: Path, **changes: object) -> None:
    """Change header fields of a prompt-cache / slot file and re-checksum them: a well-formed file
    that says something else (another model, runtime, template, format version)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    table = json.loads(data[8 : 8 + n])
    record = json.loads(table["__metadata__"]["header"])
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(record.get(key), dict):
            record[key] = {**record[key], **value}
        else:
            record[key] = value
    text = json.dumps(record, separators=(",", ":"))
    table["__metadata__"]["header"] = text
    table["__metadata__"]["header_blake3"] = blake3(text.encode()).hexdigest()
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
