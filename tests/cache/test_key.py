"""Cache key: digest layout and stability, template signature, session key."""

from __future__ import annotations

import struct

import pytest
from blake3 import blake3

from mlxcel_compat.cache.key import (
    ANON_SESSION,
    DOMAIN,
    RAW_PROMPT_TEMPLATE_SIG,
    TEXT_ONLY_MM_DIGEST,
    Bucket,
    api_key_id,
    cache_namespace,
    multimodal_digest,
    pack_tokens,
    prompt_digest,
    resolve_session_key,
    template_signature,
)

SIG = "ab" * 32
TOKENS = (1, 2, 3, 128000, 7)


def make_bucket(**overrides: object) -> Bucket:
    fields: dict[str, object] = dict(
        model_id="Llama-3.1-8B", lora_id="", template_sig=SIG, rope_regime=None, mm_digest=TEXT_ONLY_MM_DIGEST
    )
    fields.update(overrides)
    return Bucket(**fields)  # type: ignore[arg-type]


def lp(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


# --- prompt_digest ---


def test_digest_is_pinned() -> None:
    # Computed once from the documented layout; a change here breaks cache compatibility.
    digest = prompt_digest(make_bucket(), "sess-1", TOKENS)
    assert digest.hex() == "17aeebf30d7c028ca7f534a996c80f0b7c9669cd8cbd2e8bf0f5d16e7a5617b5"
    assert len(digest) == 32


def test_digest_matches_documented_layout() -> None:
    bucket = make_bucket(lora_id="lora:x", rope_regime=1, namespace="tenant-a")
    expected = blake3(
        DOMAIN
        + lp("Llama-3.1-8B")
        + lp("lora:x")
        + lp(SIG)
        + lp("tenant-a")
        + lp("sess-1")
        + b"\x01\x01"
        + TEXT_ONLY_MM_DIGEST
        + struct.pack("<Q", len(TOKENS))
        + b"".join(struct.pack("<i", t) for t in TOKENS)
    ).digest()
    assert prompt_digest(bucket, "sess-1", TOKENS) == expected


def test_digest_accepts_any_int_sequence() -> None:
    assert prompt_digest(make_bucket(), "s", list(TOKENS)) == prompt_digest(make_bucket(), "s", TOKENS)


@pytest.mark.parametrize(
    "bucket_changes, session, tokens",
    [
        ({"model_id": "Llama-3.1-8B-Instruct"}, "sess-1", TOKENS),
        ({"lora_id": "adapters@0.5"}, "sess-1", TOKENS),
        ({"template_sig": "cd" * 32}, "sess-1", TOKENS),
        ({}, "sess-2", TOKENS),
        ({"rope_regime": 0}, "sess-1", TOKENS),
        ({"rope_regime": 1}, "sess-1", TOKENS),
        ({"mm_digest": multimodal_digest([b"png"])}, "sess-1", TOKENS),
        ({"namespace": "tenant-b"}, "sess-1", TOKENS),
        ({}, "sess-1", TOKENS[:-1]),  # prefix_len shorter
        ({}, "sess-1", TOKENS + (0,)),  # prefix_len longer
        ({}, "sess-1", (1, 2, 3, 128000, 8)),  # one token value
        ({}, "sess-1", (2, 1, 3, 128000, 7)),  # order
    ],
)
def test_each_dimension_changes_digest(bucket_changes: dict[str, object], session: str, tokens: tuple[int, ...]) -> None:
    base = prompt_digest(make_bucket(), "sess-1", TOKENS)
    assert prompt_digest(make_bucket(**bucket_changes), session, tokens) != base


def test_rope_regime_none_zero_one_are_distinct() -> None:
    digests = {prompt_digest(make_bucket(rope_regime=r), "s", TOKENS) for r in (None, 0, 1)}
    assert len(digests) == 3


def test_length_prefix_prevents_field_shifting() -> None:
    a = prompt_digest(make_bucket(model_id="ab", lora_id=""), "s", TOKENS)
    b = prompt_digest(make_bucket(model_id="a", lora_id="b"), "s", TOKENS)
    assert a != b


def test_bucket_validates_fields() -> None:
    with pytest.raises(ValueError):
        make_bucket(mm_digest=b"short")
    with pytest.raises(ValueError):
        make_bucket(rope_regime=256)
    assert make_bucket().text_only
    assert not make_bucket(mm_digest=multimodal_digest([b"x"])).text_only


def test_pack_tokens_is_i32_little_endian() -> None:
    assert pack_tokens([1, -1, 256]) == b"\x01\x00\x00\x00\xff\xff\xff\xff\x00\x01\x00\x00"
    with pytest.raises(OverflowError):
        pack_tokens([2**31])


# --- multimodal digest ---


def test_text_only_constant() -> None:
    assert TEXT_ONLY_MM_DIGEST == blake3(b"mlxcel:prompt-cache:multimodal:v1" + bytes(16)).digest()
    assert multimodal_digest([]) == TEXT_ONLY_MM_DIGEST


def test_multimodal_digest_order_and_framing() -> None:
    one, two = b"\x89PNG-image-one", b"RIFF-audio-two"
    assert multimodal_digest([one, two]) == multimodal_digest([bytes(one), bytes(two)])  # same bytes, any source
    assert multimodal_digest([one, two]) != multimodal_digest([two, one])
    assert multimodal_digest([b"ab"]) != multimodal_digest([b"a", b"b"])
    assert multimodal_digest([b""]) != TEXT_ONLY_MM_DIGEST
    assert len(multimodal_digest([one])) == 32


# --- template signature ---


TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
TOOL_A = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
PINNED_TOOLS_SIG = "b519802e344f353e292cf8f1dd574e971b3f49a6c4e50c7a340e410c956ce87f"
TOOL_B = {"type": "function", "function": {"name": "search", "description": "Search", "parameters": {"type": "object"}}}


def sig(template: str = TEMPLATE, kwargs: dict[str, object] | None = None, tools: list[dict[str, object]] | None = None) -> str:
    return template_signature(template, kwargs if kwargs is not None else {"enable_thinking": True}, tools)


def test_signature_shape() -> None:
    value = sig()
    assert len(value) == 64 and value == value.lower() and int(value, 16) >= 0
    assert sig() == value


def test_raw_prompt_sentinel_is_fixed() -> None:
    assert RAW_PROMPT_TEMPLATE_SIG == "b663b55f4cd4d4a6e6ce83a9adda6cef4512e10c3d17e0b5501dbf4c2a3e158e"
    assert len(RAW_PROMPT_TEMPLATE_SIG) == 64
    assert RAW_PROMPT_TEMPLATE_SIG != template_signature("", {}, None)


def test_template_whitespace_invalidates() -> None:
    assert sig(template=TEMPLATE + "\n") != sig()
    assert sig(template=TEMPLATE.replace("{{ m", "{{m")) != sig()


def test_kwargs_values_matter_but_key_order_does_not() -> None:
    nested_a = {"a": 1, "opts": {"x": [1, 2], "y": {"p": True, "q": None}}}
    nested_b = {"opts": {"y": {"q": None, "p": True}, "x": [1, 2]}, "a": 1}
    assert sig(kwargs=nested_a) == sig(kwargs=nested_b)
    assert sig(kwargs={"enable_thinking": False}) != sig()
    assert sig(kwargs={**nested_a, "opts": {"x": [2, 1], "y": {}}}) != sig(kwargs=nested_a)


def test_signature_is_pinned() -> None:
    # The layout is part of the contract (entries on disk carry it): a change must bump TEMPLATE_DOMAIN.
    assert sig(tools=[TOOL_A]) == PINNED_TOOLS_SIG


def test_tools_order_and_content_matter() -> None:
    assert sig(tools=[TOOL_A, TOOL_B]) != sig(tools=[TOOL_B, TOOL_A])
    changed = {"type": "function", "function": {**TOOL_A["function"], "description": "Weather now"}}  # type: ignore[dict-item]
    assert sig(tools=[changed]) != sig(tools=[TOOL_A])
    renamed = {"type": "function", "function": {**TOOL_A["function"], "name": "weather"}}  # type: ignore[dict-item]
    assert sig(tools=[renamed]) != sig(tools=[TOOL_A])
    assert sig(tools=[TOOL_A]) != sig(tools=None)
    assert sig(tools=[]) == sig(tools=None)


def test_tool_parameters_key_order_does_not_matter() -> None:
    reordered = {"function": {"parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}, "description": "Weather", "name": "get_weather"}, "type": "function"}
    assert sig(tools=[reordered]) == sig(tools=[TOOL_A])
    flat = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": TOOL_A["function"]["parameters"]}  # type: ignore[index]
    assert sig(tools=[flat]) == sig(tools=[TOOL_A])


# --- session key ---


@pytest.mark.parametrize(
    "body, expected",
    [
        ({}, ANON_SESSION),
        ({"prompt_cache_key": "conv-1"}, "conv-1"),
        ({"extra_body": {"prompt_cache_key": "nested"}}, "nested"),
        ({"prompt_cache_key": "top", "extra_body": {"prompt_cache_key": "nested"}}, "top"),
        ({"prompt_cache_key": "", "extra_body": {"prompt_cache_key": "nested"}}, "nested"),
        ({"prompt_cache_key": 42, "user": "alice"}, "alice"),
        ({"user": "alice", "prompt_cache_key": "conv-1"}, "conv-1"),
        ({"user": "alice", "extra_body": {"prompt_cache_key": "nested"}}, "nested"),
        ({"extra_body": {"user": "bob"}}, "bob"),
        ({"user": "alice", "extra_body": {"user": "bob"}}, "alice"),
        ({"user": "", "extra_body": {"user": ""}}, ANON_SESSION),
        ({"user": None, "prompt_cache_key": ["x"]}, ANON_SESSION),
        ({"extra_body": "not-a-mapping", "user": "carol"}, "carol"),
    ],
)
def test_resolve_session_key(body: dict[str, object], expected: str) -> None:
    assert resolve_session_key(body) == expected


# --- tenant namespaces ---


def test_cache_namespace_by_isolation_mode() -> None:
    key_a, key_b = api_key_id("key-a"), api_key_id("key-b")
    assert key_a != key_b and "key-a" not in key_a
    # none: one shared cache whatever the key or salt
    assert cache_namespace("none", key_a, "s1") == cache_namespace("none", key_b, None) == ""
    # salt: the salt alone partitions
    assert cache_namespace("salt", key_a, None) == ""
    assert cache_namespace("salt", key_a, "s1") == cache_namespace("salt", key_b, "s1") != cache_namespace("salt", key_a, "s2")
    # api-key: the key partitions, and the salt within a key
    spaces = {cache_namespace("api-key", k, s) for k in (key_a, key_b) for s in (None, "s1")}
    assert len(spaces) == 4 and "" not in spaces
    assert cache_namespace("api-key", None, None) == ""  # no keys configured
    assert len(cache_namespace("api-key", key_a, None)) == 64  # a digest: no key or salt is stored
    # a key digest never equals a salt with the same text
    assert cache_namespace("api-key", "x", None) != cache_namespace("api-key", None, "x")


def test_session_header_ranks_between_prompt_cache_key_and_user() -> None:
    assert resolve_session_key({"user": "u", "prompt_cache_key": "k"}, "hdr") == "k"
    assert resolve_session_key({"user": "u"}, "hdr") == "hdr"
    assert resolve_session_key({"user": "u"}, None) == "u"
    assert resolve_session_key({}, "") == ANON_SESSION


def test_bucket_record_round_trips_every_field_as_json() -> None:
    import json

    from mlxcel_compat.cache.key import bucket_from_record, bucket_record

    bucket = make_bucket(rope_regime=1, mm_digest=multimodal_digest([b"img"]), lora_id="lora")
    record = json.loads(json.dumps(bucket_record(bucket)))
    assert set(record) == {"model_id", "lora_id", "template_sig", "rope_regime", "mm_digest", "namespace"}
    assert bucket_from_record(record) == bucket
    for broken in ({**record, "extra": 1}, {k: v for k, v in record.items() if k != "lora_id"}, {**record, "mm_digest": {"hex": "00"}}):
        with pytest.raises(ValueError):
            bucket_from_record(broken)
