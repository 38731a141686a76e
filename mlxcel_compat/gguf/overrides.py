"""``--override-kv KEY=TYPE:VALUE``: llama.cpp's metadata overrides, applied to a GGUF's metadata
before anything reads it (the architecture's config, the tokenizer, the special tokens).

People use it to fix a file: a wrong end-of-generation id
(``tokenizer.ggml.eos_token_id=int:2``), a BOS that should not be added
(``tokenizer.ggml.add_bos_token=bool:false``), a context length or RoPE base. The syntax is
llama.cpp's (``common.cpp: string_parse_kv_override``): the key before the first ``=`` (under 128
bytes), then ``int:``, ``float:``, ``bool:`` (``true`` or ``false`` only) or ``str:`` (at most 127
characters) and the value. Where llama.cpp's ``atol``/``atof`` would read a malformed number as 0,
this parser refuses it with a message naming the item: a silent 0 for an EOS id is a hard bug to find.
An overridden key need not exist in the file (llama.cpp adds it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

KEY_MAX = 127  # llama_model_kv_override.key is char[128]
STR_MAX = 127
TYPES = ("int", "float", "bool", "str")


@dataclass(frozen=True)
class KvOverride:
    """One override: the metadata key, llama.cpp's type name and the typed value."""

    key: str
    type: str
    value: Any

    def spelled(self) -> str:
        value = str(self.value).lower() if self.type == "bool" else self.value
        return f"{self.key}={self.type}:{value}"


def parse_kv_override(text: str) -> KvOverride:
    """One ``KEY=TYPE:VALUE`` item; ``ValueError`` naming what is wrong."""
    key, sep, rest = text.partition("=")
    if not sep or not key or len(key.encode()) > KEY_MAX:
        raise ValueError(f"malformed KV override '{text}' (expected KEY=TYPE:VALUE, KEY under 128 bytes)")
    kind, colon, raw = rest.partition(":")
    if not colon or kind not in TYPES:
        raise ValueError(f"invalid type for KV override '{text}' (types: {', '.join(TYPES)})")
    try:
        if kind == "int":
            value: Any = int(raw.strip(), 10)
        elif kind == "float":
            value = float(raw.strip())
        elif kind == "bool":
            if raw not in ("true", "false"):
                raise ValueError
            value = raw == "true"
        else:
            if len(raw) > STR_MAX:
                raise ValueError
            value = raw
    except ValueError:
        raise ValueError(f"invalid {kind} value for KV override '{text}'") from None
    return KvOverride(key, kind, value)


def parse_kv_overrides(items: Iterable[str]) -> tuple[KvOverride, ...]:
    """Every item of every ``--override-kv`` (each may hold several, comma-separated); a key given
    twice keeps its last value, as llama.cpp's map does."""
    found: dict[str, KvOverride] = {}
    for item in items:
        override = parse_kv_override(item)
        found.pop(override.key, None)
        found[override.key] = override
    return tuple(found.values())


def apply_kv_overrides(metadata: Mapping[str, Any], overrides: Iterable[KvOverride]) -> dict[str, Any]:
    """``metadata`` with the overrides' values in place (a new dict)."""
    out = dict(metadata)
    for override in overrides:
        out[override.key] = override.value
    return out


def overrides_json(overrides: Iterable[KvOverride]) -> str:
    """The overrides as one JSON text: the tokenizer's child process reads it, its cache key hashes it."""
    return json.dumps([[o.key, o.type, o.value] for o in overrides])


def overrides_from_json(text: str) -> tuple[KvOverride, ...]:
    return tuple(KvOverride(str(key), str(kind), value) for key, kind, value in json.loads(text))


__all__ = ["KvOverride", "apply_kv_overrides", "overrides_from_json", "overrides_json", "parse_kv_override",
           "parse_kv_overrides"]
