"""The prompt cache through the real server, the openai client and raw HTTP.

Outputs of cache hits are compared with cold runs (``cache_prompt: false``) of the same request:
with greedy sampling on the tiny models, the first tokens agree (a hit only changes the prefill
split; see test_engine_prefix_cache.py for the exact/tolerance checks on logits).
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServerProcess

SYSTEM = (
    "You are a careful assistant for a small library. You answer questions about opening hours, "
    "membership, the catalogue, inter-library loans and the reading room. Keep answers short, "
    "polite and factual, and say so when you do not know something."
)
QUESTIONS = [
    "When does the library open on Saturday?",
    "How do I renew a book online?",
    "Can I borrow a laptop for the afternoon?",
    "Is the reading room quiet after six?",
    "Do you keep old newspapers on microfilm?",
]


@pytest.fixture(scope="module")
def cache_server(server_factory, qwen3_dir) -> ServerProcess:
    return server_factory(["-m", str(qwen3_dir), "-np", "2", "-c", "4096", "-b", "64", "--metrics", "--prompt-cache-min-prefix", "16"])


@pytest.fixture()
def client(cache_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=cache_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def raw(cache_server: ServerProcess):
    with httpx.Client(base_url=cache_server.base_url, timeout=60) as c:
        c.post("/v1/cache/reset").raise_for_status()
        yield c


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(model="x", messages=messages, max_tokens=6, temperature=0, extra_body=extra or None)


def cached(response: Any) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_five_turn_chat_reuses_a_growing_prefix(client, raw) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    seen = []
    previous_prompt_tokens = 0
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        reply = chat(client, messages, prompt_cache_key="reader-1")
        cold = chat(client, messages, cache_prompt=False)
        assert reply.choices[0].message.content == cold.choices[0].message.content
        assert cached(cold) == 0
        seen.append(cached(reply))
        # The reused prefix covers at least the whole previous prompt.
        assert cached(reply) >= previous_prompt_tokens
        previous_prompt_tokens = reply.usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert seen[0] == 0
    assert all(b > a for a, b in zip(seen, seen[1:])), seen


def test_sessions_share_a_system_prompt_but_prefer_their_own(client, raw) -> None:
    alice = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    bob = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    first = chat(client, alice, prompt_cache_key="alice")
    assert cached(first) == 0
    stats0 = raw.get("/v1/cache/stats").json()
    # Bob has nothing of his own: Alice's entry gives him the shared system prompt.
    b1 = chat(client, bob, prompt_cache_key="bob")
    stats1 = raw.get("/v1/cache/stats").json()
    assert cached(b1) > 20
    assert stats1["hits_by_stage"]["cross_session"] == stats0["hits_by_stage"]["cross_session"] + 1
    # Bob's second turn: his own entry matches longer than Alice's, so stage 1 wins.
    bob2 = bob + [{"role": "assistant", "content": b1.choices[0].message.content}, {"role": "user", "content": QUESTIONS[2]}]
    b2 = chat(client, bob2, prompt_cache_key="bob")
    stats2 = raw.get("/v1/cache/stats").json()
    assert cached(b2) > cached(b1)
    assert stats2["hits_by_stage"]["session"] == stats1["hits_by_stage"]["session"] + 1
    assert stats2["hits_by_stage"]["cross_session"] == stats1["hits_by_stage"]["cross_session"]
    # Carol repeats Alice's prompt: only another session has it, and it is strictly longer than nothing.
    c1 = chat(client, alice, prompt_cache_key="carol")
    assert cached(c1) == first.usage.prompt_tokens - 1


TOOL = {
    "type": "function",
    "function": {
        "name": "get_opening_hours",
        "description": "Opening hours of a branch",
        "parameters": {"type": "object", "properties": {"branch": {"type": "string"}}},
    },
}


def test_tool_schema_change_is_a_miss(client, raw) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    client.chat.completions.create(model="x", messages=messages, tools=[TOOL], max_tokens=4, temperature=0)
    again = client.chat.completions.create(model="x", messages=messages, tools=[TOOL], max_tokens=4, temperature=0)
    assert cached(again) > 0
    changed = {"type": "function", "function": {**TOOL["function"], "description": "Opening hours of a library branch"}}
    other = client.chat.completions.create(model="x", messages=messages, tools=[changed], max_tokens=4, temperature=0)
    assert cached(other) == 0


def test_tool_choice_is_not_part_of_the_key(client, raw) -> None:
    # tool_choice (and the grammar it brings) changes what is generated, not the prompt: the same
    # messages and tools sent with tool_choice "required" and then "auto" (and "none") reuse the
    # prompt. Measured 12-06 before the fix: 0 tokens reused (no_candidate).
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[2]}]
    forced = client.chat.completions.create(model="x", messages=messages, tools=[TOOL], tool_choice="required",
                                            max_tokens=24, temperature=0)
    assert cached(forced) == 0
    for choice in ("auto", "none"):
        again = client.chat.completions.create(model="x", messages=messages, tools=[TOOL], tool_choice=choice,
                                               max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens == forced.usage.prompt_tokens
        assert cached(again) == forced.usage.prompt_tokens - 1, choice


@pytest.mark.parametrize(("name", "reasoning", "slack"), [("Qwen-Qwen3-0.6B", False, 0), ("GLM-4.7-Flash", True, 1)])
def test_agent_turns_with_tool_calls_reuse_the_previous_prompt(server_factory, qwen3_dir, tmp_path, name, reasoning, slack) -> None:
    # An agent's loop under a real template (llama.cpp's, on the factory's qwen3 model): each turn
    # sends the history back with the assistant's tool call and the tool's result, and each turn's
    # prompt is reused whole by the next one: the history renders as it did when it was the
    # prompt. With reasoning sent back, GLM 4.7 keeps it because preserve_reasoning is on (as in
    # llama-server); Qwen3's own template drops a past turn's reasoning whatever it is told, so
    # there the turns carry none. GLM's prompt ends with "<think>", which the factory's vocabulary
    # has no token for: its ">" and the reasoning's first letter become one token in the next
    # prompt, so the reuse may stop one token short of the previous prompt (``slack``).
    from tests.chat.conftest import read_llama_cpp_templates

    template = tmp_path / f"{name}.jinja"
    template.write_text(read_llama_cpp_templates()[name], encoding="utf-8")
    server = server_factory(["-m", str(qwen3_dir), "-np", "1", "-c", "4096", "-b", "64",
                             "--chat-template-file", str(template), "--prompt-cache-min-prefix", "16"])
    agent = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    call = {"id": "call00001", "type": "function",
            "function": {"name": "get_opening_hours", "arguments": '{"branch": "central"}'}}
    calling: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
    answer: dict[str, Any] = {"role": "assistant", "content": "It opens at 09:00 on Saturday."}
    if reasoning:
        calling["reasoning_content"] = "The tool knows the hours."
        answer["reasoning_content"] = "The tool answered."
    turns = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}],
        [calling, {"role": "tool", "tool_call_id": "call00001", "content": '{"saturday": "09:00-13:00"}'}],
        [answer, {"role": "user", "content": QUESTIONS[1]}],
    ]
    messages: list[dict[str, Any]] = []
    previous, previous_text = 0, ""
    for turn in turns:
        messages += turn
        text = httpx.post(server.base_url + "/apply-template", json={"messages": messages, "tools": [TOOL]}, timeout=30).json()["prompt"]
        assert text.startswith(previous_text)
        reply = agent.chat.completions.create(model="x", messages=messages, tools=[TOOL], max_tokens=4, temperature=0,
                                              extra_body={"prompt_cache_key": "agent-1"})
        assert reply.usage.prompt_tokens > previous
        assert cached(reply) >= previous - slack, (cached(reply), previous)
        assert reply.model_extra["timings"]["cache_n"] == cached(reply)
        previous, previous_text = reply.usage.prompt_tokens, text
    if reasoning:
        assert "The tool knows the hours." in previous_text and "The tool answered." in previous_text


def test_template_kwargs_change_is_a_miss(client, raw) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[3]}]
    chat(client, messages, chat_template_kwargs={"enable_thinking": True})
    assert cached(chat(client, messages, chat_template_kwargs={"enable_thinking": True})) > 0
    assert cached(chat(client, messages, chat_template_kwargs={"enable_thinking": False})) == 0


def test_cache_prompt_false_in_every_position(client, raw, cache_server) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[4]}]
    chat(client, messages)
    before = raw.get("/v1/cache/stats").json()
    flattened = chat(client, messages, cache_prompt=False)  # the SDK flattens extra_body
    nested = raw.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, "temperature": 0, "extra_body": {"cache_prompt": False}},
    ).json()
    native = raw.post("/completion", json={"prompt": SYSTEM, "n_predict": 2, "cache_prompt": False}).json()
    after = raw.get("/v1/cache/stats").json()
    assert cached(flattened) == 0
    assert nested["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert native["timings"]["cache_n"] == 0
    for key in ("lookups", "hits", "inserts", "entries"):
        assert after[key] == before[key], key


def test_native_timings_count_only_prefilled_tokens(raw) -> None:
    body = {"prompt": SYSTEM + " " + QUESTIONS[0], "n_predict": 4, "temperature": 0}
    cold = raw.post("/completion", json=body).json()
    warm = raw.post("/completion", json=body).json()
    n_prompt = cold["tokens_evaluated"]
    assert cold["timings"]["cache_n"] == 0 and cold["timings"]["prompt_n"] == n_prompt
    # llama-server: an exact repeat re-evaluates only the last prompt token.
    assert warm["timings"]["cache_n"] == n_prompt - 1
    assert warm["timings"]["prompt_n"] == 1
    t = warm["timings"]
    assert t["prompt_per_second"] == pytest.approx(1000.0 * t["prompt_n"] / t["prompt_ms"])
    assert warm["tokens_cached"] == n_prompt + warm["tokens_predicted"] - 1
    assert warm["content"] == cold["content"]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def test_stats_reset_and_metrics_agree_with_responses(client, raw) -> None:
    metrics0 = raw.get("/metrics").text
    stats0 = raw.get("/v1/cache/stats").json()
    reported = 0
    hits = 0
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for question in QUESTIONS[:3]:
        messages.append({"role": "user", "content": question})
        reply = chat(client, messages, prompt_cache_key="stats")
        reported += cached(reply)
        hits += cached(reply) > 0
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    stats = raw.get("/v1/cache/stats").json()
    metrics = raw.get("/metrics").text
    assert stats["prefix_tokens_reused_total"] - stats0["prefix_tokens_reused_total"] == reported
    assert stats["hits"] - stats0["hits"] == hits
    assert _metric(metrics, "mlxcel_prompt_cache_prefix_tokens_reused_total") - _metric(metrics0, "mlxcel_prompt_cache_prefix_tokens_reused_total") == reported
    assert _metric(metrics, "llamacpp:prompt_tokens_cached_total") - _metric(metrics0, "llamacpp:prompt_tokens_cached_total") == reported
    assert _metric(metrics, "mlxcel_prompt_cache_entries") == stats["entries"] > 0
    assert _metric(metrics, "mlxcel_prompt_cache_bytes") == stats["bytes"] > 0
    cleared = raw.post("/v1/cache/reset").json()
    nothing = {"cleared_entries": 0, "cleared_bytes": 0}
    ram = {"cleared_entries": stats["entries"], "cleared_bytes": stats["bytes"]}
    assert cleared == {"success": True, "tier": "all", **ram, "tiers": {"ram": ram, "disk": nothing}}
    assert raw.post("/v1/cache/reset").json() == {"success": True, "tier": "all", **nothing, "tiers": {"ram": nothing, "disk": nothing}}
    empty = raw.get("/v1/cache/stats").json()
    assert empty["entries"] == 0 and empty["bytes"] == 0
    assert empty["hits"] == stats["hits"]  # counters survive a reset


def test_past_reasoning_stays_in_the_history_as_in_llama_server(raw, server_factory, qwen3_dir) -> None:
    # llama-server renders with preserve_reasoning on (--reasoning-preserve, its default): a past
    # turn's reasoning stays in the history, so the next turn's prompt starts with this one's and
    # the prompt cache keeps hitting. A request or --no-reasoning-preserve turns it off.
    history = [
        {"role": "user", "content": "First question"},
        {"role": "assistant", "content": "First answer", "reasoning_content": "SECRET-REASONING"},
        {"role": "user", "content": "Second question"},
    ]
    rendered = raw.post("/apply-template", json={"messages": history}).json()["prompt"]
    assert "SECRET-REASONING" in rendered
    for kwargs in ({"preserve_reasoning": False}, {"preserve_thinking": False}):
        opted_out = raw.post("/apply-template", json={"messages": history, "chat_template_kwargs": kwargs}).json()["prompt"]
        assert "SECRET-REASONING" not in opted_out
    off = server_factory(["-m", str(qwen3_dir), "--no-reasoning-preserve", "--no-cache-prompt"])
    plain = httpx.post(off.base_url + "/apply-template", json={"messages": history}, timeout=30).json()["prompt"]
    assert "SECRET-REASONING" not in plain
    disabled = httpx.get(off.base_url + "/v1/cache/stats", timeout=30).json()
    assert disabled["enabled"] is False and disabled["entries"] == 0 and "hits" in disabled


def test_eviction_keeps_bytes_within_a_tiny_budget(server_factory, llama_dir) -> None:
    budget = 80_000  # tiny llama: 256 bytes per token at the default f16 KV -> room for about 310 tokens
    server = server_factory(["-m", str(llama_dir), "--prompt-cache-capacity-bytes", str(budget), "--prompt-cache-min-prefix", "8"])
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        for i in range(6):
            prompt = f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(40))
            c.post("/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0}).raise_for_status()
            stats = c.get("/v1/cache/stats").json()
            assert stats["bytes"] <= budget
        assert stats["evictions"]["lru"] > 0
        assert stats["capacity_bytes"] == budget


def test_a_request_sent_again_takes_its_first_token_from_the_cache(client, raw) -> None:
    """A long prompt sent again (a regenerated answer, a retry) adopts all of its tokens: its
    entry keeps the logits the first request computed at the prompt's last position, so no
    forward pass runs before the first token. The answer equals the first one and the cold
    run's; every prompt token counts as cached (``cached_tokens``, ``tokens_cached``,
    ``timings.cache_n``) and none as processed (``timings.prompt_n`` 0)."""
    messages = [{"role": "system", "content": SYSTEM * 20}, {"role": "user", "content": QUESTIONS[2]}]
    first = chat(client, messages)
    again = chat(client, messages)
    assert cached(first) == 0 and cached(again) == again.usage.prompt_tokens > 1000
    cold = chat(client, messages, cache_prompt=False)
    assert again.choices[0].message.content == first.choices[0].message.content == cold.choices[0].message.content
    prompt = SYSTEM * 20
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0}
    one = raw.post("/completion", json=body).json()
    two = raw.post("/completion", json=body).json()
    assert two["content"] == one["content"]
    assert two["timings"]["cache_n"] == two["tokens_evaluated"] and two["timings"]["prompt_n"] == 0
    assert two["tokens_cached"] == two["tokens_evaluated"] + 3  # prompt + the tokens fed back
