"""End to end: the official ``openai`` Python client against a real server."""

from __future__ import annotations

from typing import Iterator

import openai
import pytest

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Write a haiku about llamas."}]


@pytest.fixture()
def client(server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-no-key-required", max_retries=0, timeout=60) as c:
        yield c


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert models.data[0].owned_by == "llamacpp"


def test_chat_completion(client):
    resp = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    assert resp.model == "tiny-llama"
    assert resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert resp.usage.completion_tokens == 4
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 4
    assert isinstance(resp.usage.prompt_tokens_details.cached_tokens, int)
    assert resp.model_extra["timings"]["predicted_n"] == 4


def test_chat_completion_stream(client):
    kwargs = dict(model="x", messages=MESSAGES, max_tokens=5, temperature=0, extra_body={"ignore_eos": True, "cache_prompt": False})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert all(c.usage is None for c in chunks)


def test_chat_completion_stream_with_usage(client):
    stream = client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=3, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 3
    assert isinstance(last.usage.prompt_tokens_details.cached_tokens, int)
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_max_completion_tokens_and_n(client):
    resp = client.chat.completions.create(model="x", messages=MESSAGES, max_completion_tokens=2, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 4


def test_chat_logprobs(client):
    resp = client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2, temperature=0, extra_body={"ignore_eos": True}
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert isinstance(entry.token, str)
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        # A token ending inside a multi-byte character shows only its complete characters.
        assert bytes(entry.bytes).startswith(entry.token.encode("utf-8")) or "\ufffd" in entry.token


def test_chat_seed_reproducible(client):
    kwargs = dict(model="x", messages=MESSAGES, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True, "cache_prompt": False})
    a = client.chat.completions.create(seed=99, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=99, **kwargs).choices[0].message.content
    c = client.chat.completions.create(seed=100, **kwargs).choices[0].message.content
    assert a == b
    assert a != c


def test_chat_extra_body_native_fields(client):
    # n_predict is not an OpenAI parameter: it reaches the server through extra_body.
    resp = client.chat.completions.create(model="x", messages=MESSAGES, extra_body={"n_predict": 2, "ignore_eos": True})
    assert resp.usage.completion_tokens == 2
    biased = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=3, extra_body={"ignore_eos": True, "n_probs": 1})
    assert len(biased.choices[0].logprobs.content) == 3


def test_chat_stop_sequence(client):
    kwargs = dict(model="x", messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "cache_prompt": False})
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isalpha())
    resp = client.chat.completions.create(stop=[stop], **kwargs)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == text[: text.index(stop)]


def test_chat_bad_request_raises(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="x", messages=MESSAGES, top_logprobs=2)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"


def test_completion(client):
    resp = client.completions.create(model="x", prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True})
    assert resp.object == "text_completion"
    assert resp.model == "tiny-llama"
    assert resp.choices[0].finish_reason == "length"
    assert isinstance(resp.choices[0].text, str) and resp.choices[0].text
    assert resp.usage.completion_tokens == 4
    assert isinstance(resp.usage.prompt_tokens_details.cached_tokens, int)
    assert "timings" in resp.model_extra


def test_completion_stream(client):
    kwargs = dict(model="x", prompt="Once upon a time", max_tokens=4, temperature=0, extra_body={"ignore_eos": True, "cache_prompt": False})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 4


def test_completion_n_and_extra_body(client):
    resp = client.completions.create(model="x", prompt="Hello", max_tokens=2, n=2, extra_body={"ignore_eos": True, "n_probs": 2})
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 4
    for choice in resp.choices:
        content = choice.logprobs.model_extra["content"]
        assert len(content) == 2
        assert all(len(entry["top_logprobs"]) == 2 for entry in content)


def test_completion_token_array_prompt(client, http):
    tokens = http.post("/tokenize", json={"content": "Hello world", "add_special": True}).json()["tokens"]
    resp = client.completions.create(model="x", prompt=tokens, max_tokens=2, extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == len(tokens)
