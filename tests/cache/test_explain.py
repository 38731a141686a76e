"""``cache/explain.py`` on a real store (no MLX): each cause a miss can have, the diverging
position and windows, and that another tenant's entries are never read."""

from __future__ import annotations

import dataclasses

from mlxcel_compat.cache.explain import explain_lookup
from mlxcel_compat.cache.prompt_store import PromptCacheStore
from tests.cache.fakes import FakeClock, make_bucket

PROMPT = tuple(range(100, 160))  # 60 tokens


def store(**kw) -> PromptCacheStore:
    return PromptCacheStore(capacity_bytes=1 << 20, max_entries=kw.pop("max_entries", 16), ttl_seconds=kw.pop("ttl", 3600.0),
                            min_prefix=kw.pop("min_prefix", 8), **kw)


def explain(s: PromptCacheStore, bucket, tokens, session: str = "a", **kw):
    result = s.lookup(bucket, session, tokens, record=False)
    adopted = result.hit.matched_len if result.hit is not None else 0
    return explain_lookup(bucket, session, tokens, result, adopted, s.entries(), s.departed, s.min_prefix, **kw)


def test_each_bucket_field_that_differs_is_named():
    base = make_bucket()
    for field, value, reason in [("model_id", "other", "model_changed"), ("lora_id", "lora:x", "lora_changed"),
                                 ("template_sig", "f" * 64, "template_changed"), ("mm_digest", b"\x01" * 32, "media_changed")]:
        s = store()
        s.insert(base, "a", PROMPT, object(), 10, True)
        out = explain(s, dataclasses.replace(base, **{field: value}), PROMPT)
        assert out["reason"] == reason and out["candidate"]["differs"] == [reason.split("_")[0]], out
        assert out["outcome"] == "miss" and out["tokens_reused"] == 0 and out["first_divergence"] is None


def test_the_first_diverging_position_and_its_windows():
    s = store()
    s.insert(make_bucket(), "a", PROMPT, object(), 10, True)
    request = PROMPT[:5] + (1,) + PROMPT[6:]  # differs at position 5, below the min prefix
    out = explain(s, make_bucket(), request)
    assert out["reason"] == "below_min_prefix" and out["min_prefix"] == 8 and out["first_divergence"] == 5
    assert out["stored_window"] == {"before": list(PROMPT[:5]), "after": list(PROMPT[5:13])}
    assert out["request_window"] == {"before": list(PROMPT[:5]), "after": [1, *PROMPT[6:13]]}
    assert list(out)[:2] == ["outcome", "reason"]


def test_a_hit_a_partial_overlap_without_apc_and_a_state_that_cannot_be_cut():
    s = store()
    s.insert(make_bucket(), "a", PROMPT, object(), 10, True)
    hit = explain(s, make_bucket(), PROMPT + (7, 8))
    assert hit["outcome"] == "hit" and hit["tokens_reused"] == len(PROMPT) and hit["stage"] == "session"
    partly = PROMPT[:40] + (1, 2, 3)
    assert explain(s, make_bucket(), partly)["reason"] == "apc_off"  # no ApcConfig: only whole entries serve
    s = store()
    s.insert(make_bucket(), "a", PROMPT, object(), 10, False)  # recurrent state: never cut
    out = explain(s, make_bucket(), PROMPT)  # an exact repeat would need its last token given back
    assert out["reason"] == "not_trimmable" and not out["candidate"]["trimmable"]


def test_another_session_is_the_cause_only_where_sessions_are_not_shared():
    s = store()
    s.insert(make_bucket(), "a", PROMPT, object(), 10, True)
    partly = PROMPT[:40] + (1, 2, 3)
    assert explain(s, make_bucket(), partly, session="b", sessions_shared=False)["reason"] == "session"
    assert explain(s, make_bucket(), PROMPT + (1,), session="b")["stage"] == "cross_session"


def test_an_expired_or_evicted_entry_says_when_and_why():
    clock = FakeClock()
    s = store(ttl=10.0, clock=clock)
    s.insert(make_bucket(), "a", PROMPT, object(), 10, True)
    clock.advance(11)
    s.lookup(make_bucket(), "a", PROMPT, record=False)  # the sweep runs at a lookup
    out = explain(s, make_bucket(), PROMPT + (1,), now=s.departed[-1].at + 2.5)
    assert out["reason"] == "evicted" and out["evicted"] == {"seconds_ago": 2.5, "why": "ttl", "tokens": 60, "common_prefix": 60,
                                                              "same_session": True}
    s = store(max_entries=1)
    s.insert(make_bucket(), "a", PROMPT, object(), 10, True)
    s.insert(make_bucket(), "a", (1, 2, 3) * 5, object(), 10, True)
    assert explain(s, make_bucket(), PROMPT + (1,))["evicted"]["why"] == "lru"


def test_other_tenants_entries_are_never_read():
    s = store()
    s.insert(make_bucket(namespace="tenant-a"), "a", PROMPT, object(), 10, True)
    out = explain(s, make_bucket(namespace="tenant-b"), PROMPT)
    assert out == {"outcome": "miss", "reason": "namespace", "tokens_reused": 0, "prompt_tokens": 60}
    shared = explain(s, make_bucket(), PROMPT)  # the shared cache knows nothing of tenant a either
    assert shared == {"outcome": "miss", "reason": "first_request", "tokens_reused": 0, "prompt_tokens": 60}
