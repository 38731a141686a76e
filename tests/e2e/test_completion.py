"""End to end: native ``/completion`` on a real server (tiny llama, 2 slots).

Expected values follow llama-server (docs/llama-server-api.md §3, §4.4, §4.5).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.helpers import DONE, NATIVE_KEYS, PARTIAL_KEYS, TIMINGS_KEYS, ascii_stop_string, post_stream

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "cache_prompt": False}


def complete(http, **body):
    response = http.post("/completion", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def tokenize(http, text: str, add_special: bool = False) -> list[int]:
    return http.post("/tokenize", json={"content": text, "add_special": add_special}).json()["tokens"]


# ---------------------------------------------------------------------- prompt shapes


def test_string_prompt_returns_all_native_keys_in_order(http):
    body = complete(http, prompt="Hello world", n_predict=4, **GREEDY)
    assert list(body)[: len(NATIVE_KEYS)] == NATIVE_KEYS
    assert "completion_probabilities" not in body
    assert body["stop"] is True
    assert body["model"] == "tiny-llama"
    assert body["tokens"] == []  # only filled with return_tokens
    assert body["tokens_evaluated"] == len(tokenize(http, "Hello world", add_special=True))
    assert body["prompt"].startswith("<|begin_of_text|>")  # the BOS is shown, rendered with specials
    assert list(body["timings"]) == TIMINGS_KEYS
    assert body["generation_settings"]["n_predict"] == 4
    assert body["generation_settings"]["temperature"] == 0


def test_token_array_prompt_is_used_as_given(http):
    tokens = tokenize(http, "Hello world", add_special=True)
    from_text = complete(http, prompt="Hello world", n_predict=5, **GREEDY)
    from_tokens = complete(http, prompt=tokens, n_predict=5, **GREEDY)
    assert from_tokens["tokens_evaluated"] == len(tokens)
    assert from_tokens["content"] == from_text["content"]
    # A pure token array gets no BOS added: without it the prompt is one token shorter.
    without_bos = complete(http, prompt=tokens[1:], n_predict=1, **GREEDY)
    assert without_bos["tokens_evaluated"] == len(tokens) - 1


def test_mixed_prompt_concatenates_text_and_tokens(http):
    world = tokenize(http, " world")
    body = complete(http, prompt=["Hello", *world], n_predict=3, **GREEDY)
    assert body["tokens_evaluated"] == len(tokenize(http, "Hello", add_special=True)) + len(world)
    assert body["prompt"].endswith("Hello world")


def test_multiple_prompts_return_an_array_in_order(http):
    results = http.post("/completion", json={"prompt": ["Hello", "Goodbye"], "n_predict": 3, **GREEDY}).json()
    assert isinstance(results, list) and len(results) == 2
    assert [r["index"] for r in results] == [0, 1]
    assert results[0]["content"] == complete(http, prompt="Hello", n_predict=3, **GREEDY)["content"]
    assert results[1]["content"] == complete(http, prompt="Goodbye", n_predict=3, **GREEDY)["content"]
    assert results[1]["prompt"].endswith("Goodbye")


def test_empty_token_array_gives_an_empty_completion(http):
    body = complete(http, prompt=[], n_predict=4)
    assert body["content"] == ""
    assert body["tokens_predicted"] == 0


# ---------------------------------------------------------------------- n_predict, tokens, stop


@pytest.mark.parametrize("n", [1, 5])
def test_n_predict_is_respected(http, n):
    body = complete(http, prompt="Count with me", n_predict=n, ignore_eos=True)
    assert body["tokens_predicted"] == n
    assert body["timings"]["predicted_n"] == n
    assert body["stop_type"] == "limit"


def test_n_predict_zero_still_samples_one_token(http):
    body = complete(http, prompt="Zero", n_predict=0, ignore_eos=True)
    assert body["tokens_predicted"] == 1
    assert body["stop_type"] == "limit"


def test_return_tokens_fills_tokens_matching_content(http):
    body = complete(http, prompt="Hello world", n_predict=4, return_tokens=True, ignore_eos=True, **GREEDY)
    assert len(body["tokens"]) == 4
    detok = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["content"]
    assert detok == body["content"]


def test_stop_string_cuts_the_output(http):
    first = complete(http, prompt="Once upon a time", n_predict=16, ignore_eos=True, **GREEDY)
    stop = ascii_stop_string(first["content"])
    expected = first["content"][: first["content"].index(stop)]
    body = complete(http, prompt="Once upon a time", n_predict=16, ignore_eos=True, stop=[stop], **GREEDY)
    assert body["stop_type"] == "word"
    assert body["stopping_word"] == stop
    assert body["content"] == expected
    assert stop not in body["content"]
    assert body["tokens_predicted"] < 16
    assert body["generation_settings"]["stop"] == [stop]


def test_stop_string_cuts_the_stream(http):
    first = complete(http, prompt="Once upon a time", n_predict=16, ignore_eos=True, **GREEDY)
    stop = ascii_stop_string(first["content"])
    _, events = post_stream(http, "/completion", {"prompt": "Once upon a time", "n_predict": 16, "ignore_eos": True, "stop": [stop], **GREEDY})
    streamed = "".join(e["content"] for e in events)
    assert streamed == first["content"][: first["content"].index(stop)]
    assert all(stop not in e["content"] for e in events)
    assert events[-1]["stop"] is True
    assert events[-1]["stop_type"] == "word"
    assert events[-1]["stopping_word"] == stop


def test_empty_stop_strings_are_dropped(http):
    body = complete(http, prompt="Hello", n_predict=3, stop=["", ""], ignore_eos=True)
    assert body["generation_settings"]["stop"] == []
    assert body["tokens_predicted"] == 3


# ---------------------------------------------------------------------- determinism and seeds


def test_greedy_is_deterministic_and_matches_streaming(http):
    body = {"prompt": "The weather today", "n_predict": 8, "ignore_eos": True, **GREEDY}
    a = complete(http, **body)
    b = complete(http, **body)
    assert a["content"] == b["content"]
    assert a["content"] != ""
    _, events = post_stream(http, "/completion", body)
    assert "".join(e["content"] for e in events) == a["content"]


def test_same_seed_same_text_different_seed_different_text(http):
    body = {"prompt": "Tell me a story", "n_predict": 10, "temperature": 1.0, "ignore_eos": True, "cache_prompt": False}
    a = complete(http, seed=1234, **body)
    b = complete(http, seed=1234, **body)
    c = complete(http, seed=4321, **body)
    assert a["content"] == b["content"]
    assert a["content"] != c["content"]
    assert a["generation_settings"]["seed"] == 1234


# ---------------------------------------------------------------------- streaming format


def test_native_stream_format(http):
    response, events = post_stream(http, "/completion", {"prompt": "Hello world", "n_predict": 4, "ignore_eos": True})
    assert response.headers["x-accel-buffering"] == "no"
    assert DONE not in events
    assert not response.text.rstrip().endswith("[DONE]")
    partials, final = events[:-1], events[-1]
    assert len(partials) == 4
    for i, event in enumerate(partials, start=1):
        assert list(event)[: len(PARTIAL_KEYS)] == PARTIAL_KEYS
        assert event["stop"] is False
        assert len(event["tokens"]) == 1
        assert event["tokens_predicted"] == i
    assert final["stop"] is True
    assert final["content"] == "" and final["tokens"] == []
    assert list(final)[: len(NATIVE_KEYS)] == NATIVE_KEYS
    assert final["timings"]["predicted_n"] == 4
    assert final["tokens_predicted"] == 4
    assert final["generation_settings"]["stream"] is True
    assert "completion_probabilities" not in final


def test_timings_per_token_adds_timings_to_partial_events(http):
    _, events = post_stream(http, "/completion", {"prompt": "Hello world", "n_predict": 3, "ignore_eos": True, "timings_per_token": True})
    partials = events[:-1]
    assert len(partials) == 3
    for event in partials:
        assert list(event["timings"]) == TIMINGS_KEYS
        assert event["timings"]["predicted_n"] == event["tokens_predicted"]
    assert events[-1]["generation_settings"]["timings_per_token"] is True


def test_stream_ends_with_stop_event_for_each_prompt(http):
    _, events = post_stream(http, "/completion", {"prompt": ["Hello", "World"], "n_predict": 2, "ignore_eos": True})
    finals = [e for e in events if e["stop"]]
    assert sorted(e["index"] for e in finals) == [0, 1]
    assert all("timings" in e for e in finals)


# ---------------------------------------------------------------------- probabilities


def test_n_probs_gives_completion_probabilities(http):
    body = complete(http, prompt="Hello world", n_predict=3, n_probs=4, ignore_eos=True, **GREEDY)
    probs = body["completion_probabilities"]
    assert len(probs) == 3
    for entry in probs:
        assert list(entry) == ["id", "token", "bytes", "logprob", "top_logprobs"]
        assert entry["logprob"] <= 0
        if "\ufffd" not in entry["token"]:  # a whole UTF-8 character: bytes are its encoding
            assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert len(entry["top_logprobs"]) == 4
        for top in entry["top_logprobs"]:
            assert list(top) == ["id", "token", "bytes", "logprob"]
        logprobs = [t["logprob"] for t in entry["top_logprobs"]]
        assert logprobs == sorted(logprobs, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry["top_logprobs"][0]["id"] == entry["id"]
    assert "".join(e["token"] for e in probs) == body["content"]


def test_n_probs_streamed_per_token(http):
    _, events = post_stream(http, "/completion", {"prompt": "Hello", "n_predict": 2, "n_probs": 2, "ignore_eos": True})
    partials = events[:-1]
    assert all(len(e["completion_probabilities"]) == 1 for e in partials)
    assert all(e["completion_probabilities"][0]["id"] == e["tokens"][0] for e in partials)
    assert "completion_probabilities" not in events[-1]


def test_post_sampling_probs_are_probabilities(http):
    body = complete(http, prompt="Hello world", n_predict=3, n_probs=5, post_sampling_probs=True, temperature=1.0, seed=7, ignore_eos=True)
    probs = body["completion_probabilities"]
    assert len(probs) == 3
    for entry in probs:
        assert "logprob" not in entry and "top_logprobs" not in entry
        assert 0.0 <= entry["prob"] <= 1.0
        assert 1 <= len(entry["top_probs"]) <= 5
        assert all(0.0 < t["prob"] <= 1.0 for t in entry["top_probs"])
        assert sum(t["prob"] for t in entry["top_probs"]) <= 1.0 + 1e-5
    assert body["generation_settings"]["post_sampling_probs"] is True


# ---------------------------------------------------------------------- other request fields


def test_response_fields_keeps_only_the_listed_paths(http):
    body = complete(http, prompt="Hello", n_predict=2, response_fields=["content", "generation_settings/n_predict", "timings/prompt_n", "nope/x"])
    assert set(body) == {"content", "generation_settings/n_predict", "timings/prompt_n"}
    assert body["generation_settings/n_predict"] == 2


def test_return_progress_events(http):
    prompt = "one two three four five six seven eight nine ten " * 15
    _, events = post_stream(http, "/completion", {"prompt": prompt, "n_predict": 1, "return_progress": True, "cache_prompt": False})
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    n_prompt = events[-1]["tokens_evaluated"]
    assert len(progress) >= 2  # the server runs with -b 64: several prompt chunks
    assert all(p["total"] == n_prompt for p in progress)
    processed = [p["processed"] for p in progress]
    assert processed == sorted(processed) and len(set(processed)) == len(processed)
    first_token = next(i for i, e in enumerate(events) if "prompt_progress" not in e)
    assert all("prompt_progress" in e for e in events[:first_token])
    assert all(e["content"] == "" for e in events[:first_token])


def test_return_progress_reaches_the_prompt_length(http):
    # llama-server reports processed = tokens in the slot after each prompt batch, so the last
    # progress event has processed == total.
    prompt = "one two three four five six seven eight nine ten " * 15
    _, events = post_stream(http, "/completion", {"prompt": prompt, "n_predict": 1, "return_progress": True, "cache_prompt": False})
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress[-1]["processed"] == progress[-1]["total"]


def test_n_cmpl_gives_several_completions(http):
    results = http.post("/completion", json={"prompt": "Hello", "n_cmpl": 2, "n_predict": 3, "temperature": 1.0, "seed": 42, "ignore_eos": True}).json()
    assert isinstance(results, list) and len(results) == 2
    assert [r["index"] for r in results] == [0, 1]
    assert {r["id_slot"] for r in results} == {0, 1}
    assert [r["generation_settings"]["seed"] for r in results] == [42, 43]
    assert all(r["tokens_predicted"] == 3 for r in results)
    # The first child repeats what a single request with the same seed gives.
    single = complete(http, prompt="Hello", n_predict=3, temperature=1.0, seed=42, ignore_eos=True)
    assert results[0]["content"] == single["content"]


def test_n_alias_for_n_cmpl(http):
    results = http.post("/completion", json={"prompt": "Hi", "n": 2, "n_predict": 1}).json()
    assert isinstance(results, list) and len(results) == 2


def test_prompt_n_plus_cache_n_equals_tokens_evaluated(http):
    prompt = "A shared prefix that is long enough to be worth caching in a prompt cache, " * 3
    for _ in range(2):
        body = complete(http, prompt=prompt, n_predict=2)
        timings = body["timings"]
        assert timings["prompt_n"] + timings["cache_n"] == body["tokens_evaluated"]
        assert timings["prompt_n"] >= 1  # at least one prompt token is always evaluated


def test_logit_bias_forces_a_token(http):
    token = tokenize(http, " world")[-1]
    for bias in ([[token, 100]], {str(token): 100}):
        body = complete(http, prompt="Hello", n_predict=4, logit_bias=bias, return_tokens=True, ignore_eos=True)
        assert body["tokens"] == [token] * 4
        assert body["generation_settings"]["logit_bias"][0] == {"bias": 100.0, "token": token}


def test_logit_bias_with_text_key(http):
    pieces = tokenize(http, "Hello")
    body = complete(http, prompt="Hi", n_predict=4, logit_bias=[["Hello", 100]], return_tokens=True, ignore_eos=True)
    assert set(body["tokens"]) <= set(pieces)


def test_logit_bias_false_bans_a_token(http):
    first = complete(http, prompt="Hello world", n_predict=1, return_tokens=True, **GREEDY)
    banned = first["tokens"][0]
    body = complete(http, prompt="Hello world", n_predict=4, return_tokens=True, logit_bias=[[banned, False]], **GREEDY)
    assert banned not in body["tokens"]
    assert {"bias": None, "token": banned} in body["generation_settings"]["logit_bias"]


def test_eos_stops_and_ignore_eos_prevents_it(http):
    props = http.get("/props").json()
    eos = tokenize(http, props["eos_token"])
    assert len(eos) == 1
    stopped = complete(http, prompt="Hello", n_predict=5, logit_bias={str(eos[0]): 100})
    assert stopped["stop_type"] == "eos"
    assert stopped["tokens_predicted"] == 1
    assert stopped["content"] == ""
    ignored = complete(http, prompt="Hello", n_predict=5, logit_bias={str(eos[0]): 100}, ignore_eos=True, return_tokens=True)
    assert ignored["stop_type"] == "limit"
    assert ignored["tokens_predicted"] == 5
    assert eos[0] not in ignored["tokens"]
    settings = ignored["generation_settings"]
    assert settings["ignore_eos"] is True
    assert {"bias": None, "token": eos[0]} in settings["logit_bias"]


@pytest.mark.parametrize("slot", [0, 1])
def test_id_slot_is_honoured_and_reported(http, slot):
    body = complete(http, prompt="Pinned", n_predict=1, id_slot=slot)
    assert body["id_slot"] == slot


def test_id_slot_in_stream_events(http):
    _, events = post_stream(http, "/completion", {"prompt": "Pinned", "n_predict": 2, "id_slot": 1})
    assert {e["id_slot"] for e in events} == {1}


def test_completions_alias_route(http):
    body = http.post("/completions", json={"prompt": "Hello", "n_predict": 2, "ignore_eos": True}).json()
    assert body["tokens_predicted"] == 2
    assert list(body)[: len(NATIVE_KEYS)] == NATIVE_KEYS


def test_concurrent_requests_match_sequential_results(http):
    # Four greedy requests on two slots: two run batched, two wait for a free slot.
    prompts = ["The weather today is", "Once upon a time there", "My favourite food", "In the beginning"]

    def run(prompt: str) -> str:
        return complete(http, prompt=prompt, n_predict=12, ignore_eos=True, **GREEDY)["content"]

    sequential = [run(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(run, prompts))
    assert concurrent == sequential
