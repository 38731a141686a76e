"""The prompt-cache key: buckets, digests, template signatures and session keys.

An entry is identified by a 32-byte BLAKE3 digest over eight dimensions plus the
tokens (see docs "The key"). Requests that differ in any dimension must never share
KV state, so every field is length-prefixed and domain-separated: two different
inputs can never serialise to the same byte string.

The eighth dimension is the tenant namespace (``--prompt-cache-isolation``): a digest of
the API key that authenticated the request and/or of its ``cache_salt``, "" when the
cache is shared. It lives in the :class:`Bucket`, so every lookup path (the radix trie
of a bucket, APC chains, session snapshots, warm-ups) is confined to one namespace.

The byte layout is part of the contract (digests are pinned in tests), so change
``DOMAIN`` whenever the layout changes.

Nothing here imports mlx: the key is pure bookkeeping.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

DOMAIN = b"mlxcel:prompt-cache:v4"
MULTIMODAL_DOMAIN = b"mlxcel:prompt-cache:multimodal:v1"
TEMPLATE_DOMAIN = b"mlxcel:prompt-cache:template:v2"
TOOLS_DOMAIN = b"mlxcel:prompt-cache:tools:v1"
RAW_PROMPT_DOMAIN = b"mlxcel:prompt-cache:raw-prompt:v1"
NAMESPACE_DOMAIN = b"mlxcel:prompt-cache:namespace:v1"

DIGEST_SIZE = 32

# Text-only requests: count 0 and total length 0. A real payload list always has a
# non-zero count, so this constant can never collide with ``multimodal_digest(items)``.
TEXT_ONLY_MM_DIGEST: bytes = blake3(
    MULTIMODAL_DOMAIN + struct.pack("<QQ", 0, 0)
).digest()

# Routes that take a raw prompt (/completion, /v1/completions) render no template.
# Own domain, so no template_signature() output can equal it.
RAW_PROMPT_TEMPLATE_SIG: str = blake3(RAW_PROMPT_DOMAIN).hexdigest()

ANON_SESSION = "__mlxcel_anon__"
# Explicit cache breakpoints are stored under this session: like Anthropic's cache, a pinned
# prefix is addressed by its content, so every session of the bucket finds (and refreshes) it.
PIN_SESSION = "__mlxcel_breakpoint__"

_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class Bucket:
    """Everything of the key except the session and the tokens.

    One radix trie exists per bucket; all sessions of a bucket share it, which is what
    makes the cross-session stage of lookup possible.
    """

    model_id: str  # served display id (last path component or alias)
    lora_id: str  # "" for the base model, else digest of adapters *and* scales
    template_sig: str  # 64 lowercase hex chars (template_signature or sentinel)
    rope_regime: int | None  # LongRoPE short/long tag, None for every other model
    mm_digest: bytes  # 32 bytes, TEXT_ONLY_MM_DIGEST for text-only requests
    namespace: str = ""  # tenant (cache_namespace); "" = the shared cache

    def __post_init__(self) -> None:
        if len(self.mm_digest) != DIGEST_SIZE:
            raise ValueError(f"mm_digest must be {DIGEST_SIZE} bytes, got {len(self.mm_digest)}")
        if self.rope_regime is not None and not 0 <= self.rope_regime <= 255:
            raise ValueError(f"rope_regime must fit one byte, got {self.rope_regime}")

    @property
    def text_only(self) -> bool:
        """True when the request carried no image or audio bytes."""
        return self.mm_digest == TEXT_ONLY_MM_DIGEST


def bucket_record(bucket: Bucket) -> dict[str, Any]:
    """Every field of a bucket as plain JSON values (bytes as hex), for files on disk.

    Written field by field from the dataclass, so a key part added to ``Bucket`` is stored (and
    checked when read back) without touching the disk format.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Bucket):
        value = getattr(bucket, f.name)
        out[f.name] = {"hex": value.hex()} if isinstance(value, bytes) else value
    return out


def bucket_from_record(record: Mapping[str, Any]) -> Bucket:
    """The inverse of ``bucket_record``.

    Raises:
        ValueError: the record does not have exactly the fields of ``Bucket``, or one is malformed
            (a file written for another key layout must not be read as this one).
    """
    names = [f.name for f in dataclasses.fields(Bucket)]
    if sorted(record) != sorted(names):
        raise ValueError(f"bucket fields {sorted(record)} != {sorted(names)}")
    values: dict[str, Any] = {}
    for name in names:
        value = record[name]
        if isinstance(value, Mapping):
            hex_text = value.get("hex")
            if not isinstance(hex_text, str):
                raise ValueError(f"bucket field {name!r} is malformed")
            value = bytes.fromhex(hex_text)
        values[name] = value
    try:
        return Bucket(**values)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Pack token ids as consecutive little-endian i32 values.

    ``array('i')`` does the packing in C (a 100k-token prompt costs well under a
    millisecond); it is only swapped on big-endian hosts so the bytes stay portable.

    Raises:
        OverflowError: a token id does not fit in an i32.
    """
    packed = array("i", tokens)
    assert packed.itemsize == 4, f"{packed.itemsize=}"  # C int is 32 bits on every target
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(raw: bytes) -> tuple[int, ...]:
    """The inverse of ``pack_tokens``: the token ids of a file on disk.

    Raises:
        ValueError: ``raw`` is not a whole number of i32 values.
    """
    if len(raw) % 4:
        raise ValueError("token bytes are not a whole number of i32")
    packed = array("i")
    packed.frombytes(raw)
    if sys.byteorder != "little":
        packed.byteswap()
    return tuple(packed)


def _length_prefixed(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _U64.pack(len(raw)) + raw


def prompt_digest(bucket: Bucket, session_key: str, tokens: Sequence[int]) -> bytes:
    """The 32-byte BLAKE3 digest identifying one cache entry.

    Layout: domain, model_id, lora_id, template_sig, namespace, session_key (each u64
    LE byte length + UTF-8), rope_regime (presence byte + tag byte), mm_digest (raw 32
    bytes), prefix_len (u64 LE), then every token as i32 LE.

    Args:
        bucket: model, adapter, template, RoPE regime and multimodal dimensions.
        session_key: from ``resolve_session_key``.
        tokens: the token prefix; its length is the ``prefix_len`` field.

    Returns:
        32 raw digest bytes.
    """
    h = blake3(DOMAIN)
    h.update(_length_prefixed(bucket.model_id))
    h.update(_length_prefixed(bucket.lora_id))
    h.update(_length_prefixed(bucket.template_sig))
    h.update(_length_prefixed(bucket.namespace))
    h.update(_length_prefixed(session_key))
    if bucket.rope_regime is None:
        h.update(b"\x00\x00")
    else:
        h.update(bytes((1, bucket.rope_regime)))
    h.update(bucket.mm_digest)
    h.update(_U64.pack(len(tokens)))
    h.update(pack_tokens(tokens))
    return h.digest()


def multimodal_digest(items: Sequence[bytes]) -> bytes:
    """Digest of all decoded image/audio payloads in message order.

    Count- and length-prefixed so that splitting or joining payloads, or swapping two
    of them, changes the digest. The digest is over decoded bytes, so the same image
    fetched from two URLs gives the same digest.

    Args:
        items: decoded media payloads, in the order they appear in the messages.

    Returns:
        32 bytes; ``TEXT_ONLY_MM_DIGEST`` when ``items`` is empty.
    """
    if not items:
        return TEXT_ONLY_MM_DIGEST
    h = blake3(MULTIMODAL_DOMAIN)
    h.update(_U64.pack(len(items)))
    for item in items:
        h.update(_U64.pack(len(item)))
        h.update(item)
    return h.digest()


def canonical_json(value: object) -> str:
    """JSON with keys sorted at every depth and no insignificant whitespace.

    Raises:
        TypeError: the value holds something JSON cannot represent.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def tools_digest(tools: Sequence[Mapping[str, object]] | None) -> bytes:
    """Order-preserving digest of the tools a template renders.

    Each tool contributes its type, function name, description and parameters as
    canonical JSON; both the nested (``{"function": {...}}``) and the flat shape are
    read. ``None`` and ``[]`` render identically, so they share a digest.
    """
    tools = tools or ()
    h = blake3(TOOLS_DOMAIN)
    h.update(_U64.pack(len(tools)))
    for tool in tools:
        nested = tool.get("function")
        function = nested if isinstance(nested, Mapping) else tool
        record = [
            tool.get("type", "function"),
            function.get("name"),
            function.get("description"),
            function.get("parameters"),
        ]
        h.update(_length_prefixed(canonical_json(record)))
    return h.digest()


def template_signature(
    template_source: str,
    chat_template_kwargs: Mapping[str, object],
    tools: Sequence[Mapping[str, object]] | None,
) -> str:
    """64-hex BLAKE3 signature of everything that shapes the rendered prompt, and nothing else.

    The template source is hashed verbatim (a whitespace change invalidates); the
    kwargs are hashed as canonical JSON, so key order at any depth does not matter.
    Sampling constraints are left out: ``tool_choice``, a grammar or a response format
    change what is generated, not the prompt (the template renders the same tools
    whatever ``tool_choice`` says), so a request that forces a call and the next one
    that does not share their prompt's KV.

    Args:
        template_source: the Jinja chat template as loaded.
        chat_template_kwargs: server defaults already overlaid by the request's kwargs.
        tools: the tools the template renders (``None`` when none).

    Returns:
        64 lowercase hex characters.
    """
    h = blake3(TEMPLATE_DOMAIN)
    h.update(_length_prefixed(template_source))
    h.update(_length_prefixed(canonical_json(dict(chat_template_kwargs))))
    h.update(tools_digest(tools))
    return h.hexdigest()


def _first_string(body: Mapping[str, object], field: str) -> str | None:
    """First non-empty string for ``field`` at the top level, then inside ``extra_body``.

    The OpenAI SDK flattens ``extra_body`` into the request, so the top level covers
    the flattened form; some clients send it nested, hence the second look.
    """
    value = body.get(field)
    if isinstance(value, str) and value:
        return value
    extra = body.get("extra_body")
    if isinstance(extra, Mapping):
        nested = extra.get(field)
        if isinstance(nested, str) and nested:
            return nested
    return None


def resolve_session_key(body: Mapping[str, object], header: str | None = None) -> str:
    """The session dimension of the key for one request body.

    Order: ``prompt_cache_key`` (top level / flattened ``extra_body``, then nested
    ``extra_body``), then ``header`` (a router's session header such as ``X-Session-ID``),
    then ``user`` (same two places as the key), then ``ANON_SESSION``.
    Non-string and empty values are ignored.
    """
    key = _first_string(body, "prompt_cache_key")
    if key is not None:
        return key
    if header:
        return header
    return _first_string(body, "user") or ANON_SESSION


def cache_namespace(isolation: str, api_key_id: str | None, cache_salt: str | None) -> str:
    """The tenant namespace of a request under ``--prompt-cache-isolation``.

    ``none``: "" (one shared cache). ``salt``: the request's ``cache_salt`` (vLLM's field)
    partitions the cache. ``api-key``: the API key that authenticated the request (as
    ``api_key_id``, already a digest: the key itself never reaches the cache), and within
    a key the ``cache_salt``. Requests with nothing to partition on share "".

    The result is a digest (64 hex chars) so that neither a key nor a salt is kept in
    the store, its stats or a disk copy.
    """
    parts: list[tuple[str, str]] = []
    if isolation == "api-key" and api_key_id:
        parts.append(("key", api_key_id))
    if isolation in ("api-key", "salt") and cache_salt:
        parts.append(("salt", cache_salt))
    if not parts:
        return ""
    h = blake3(NAMESPACE_DOMAIN)
    for name, value in parts:
        h.update(_length_prefixed(name))
        h.update(_length_prefixed(value))
    return h.hexdigest()


def api_key_id(key: str) -> str:
    """A stable digest of an API key, the only form of it the prompt cache sees."""
    return blake3(NAMESPACE_DOMAIN + b":api-key:" + key.encode("utf-8")).hexdigest()
