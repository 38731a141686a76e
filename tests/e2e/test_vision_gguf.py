"""End to end: a GGUF pair (``-m text.gguf --mmproj mmproj-*.gguf``, as llama-server serves images)
through the openai SDK, on the factory's tiny Qwen2.5-VL (by default), Gemma 3, SmolVLM, Qwen3-VL, InternVL, LLaVA and Mistral 3 (``slow``),
written as llama.cpp's converter writes them (``python -m mlxcel_compat.testing.vision --format gguf``).

- ``/props`` says vision; a chat with an image part is answered, the image taking its tokens.
- The prompt cache's rules hold as for a directory: ``mm_digest`` is in the key (the same text
  with another image adopts exactly the tokens before the first image token), and a second turn
  about the same image adopts the whole first turn, image included, and answers as a cold run does.
- Embeddings (``--embeddings --pooling last``) of a prompt with an image, as llama-server embeds
  it: the vector is the completion path's last hidden state for the same prompt (its logits
  through the GGUF's own head match ``/completion``'s ``n_probs`` log-probabilities), the same
  request gives the same vector (the second one's image comes from the prepared-image memo),
  another image another vector, an OpenAI content array the native ``multimodal_data`` vector;
  bad images are 400s and the server stays healthy.
Refusals (a directory with ``--mmproj``, unknown projector types) are tested in-process:
``tests/vision/test_gguf_projector.py``.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from mlxcel_compat.testing import vision
from tests.e2e.test_vision import SYSTEM, data_uri, png, user

pytestmark = pytest.mark.e2e

FAMILIES = [pytest.param("qwen2_5_vl"), pytest.param("gemma3", marks=pytest.mark.slow),
            pytest.param("smolvlm", marks=pytest.mark.slow), pytest.param("qwen3_vl", marks=pytest.mark.slow),
            pytest.param("internvl_chat", marks=pytest.mark.slow), pytest.param("llava", marks=pytest.mark.slow),
            pytest.param("mistral3", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest) -> tuple[str, Path, Path]:
    from tests.conftest import MODEL_CACHE

    text, mmproj = vision.ensure_vision_gguf(MODEL_CACHE, request.param, gguf_type="q8_0")
    return request.param, text, mmproj


@pytest.fixture(scope="module")
def served(server_factory, pair):
    _, text, mmproj = pair
    return server_factory(["-m", str(text), "--mmproj", str(mmproj), "-np", "1", "-c", "4096", "-b", "64",
                           "--prompt-cache-min-prefix", "8", "--props", "--alias", "tiny-vl-gguf",
                           "--embeddings", "--pooling", "last"])


@pytest.fixture()
def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)


def ask(oai: openai.OpenAI, messages: list[dict[str, Any]], cold: bool = False) -> tuple[str, int, int]:
    reply = oai.chat.completions.create(model="tiny-vl-gguf", messages=messages, max_tokens=6, temperature=0,
                                        extra_body={"cache_prompt": False} if cold else None)
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def first_image_token(served, pair, messages: list[dict[str, Any]]) -> int:
    """The text before the image marker, tokenized by the server, plus the marker's tokens before
    the one the server expands (Qwen: ``<|vision_start|>``; Gemma 3: ``\\n\\n<start_of_image>``; SmolVLM: none)."""
    family = pair[0]
    prompt = httpx.post(served.base_url + "/apply-template", json={"messages": messages}).json()["prompt"]
    head = prompt[: prompt.index(vision.TEMPLATE_IMAGE[family])]
    tokens = httpx.post(served.base_url + "/tokenize", json={"content": head}).json()["tokens"]
    return len(tokens) + {"qwen2_5_vl": 1, "qwen3_vl": 1, "internvl_chat": 1, "gemma3": 3, "smolvlm": 0,
                          "llava": 0, "mistral3": 0}[family]  # SmolVLM: <image> is expanded whole; Mistral 3: [IMG]


def test_props_say_vision_and_an_image_is_answered(served, oai: openai.OpenAI) -> None:
    assert httpx.get(served.base_url + "/props").json()["modalities"]["vision"] is True
    content, n_prompt, _ = ask(oai, [SYSTEM, user(data_uri(png(1)))])
    assert content
    _, n_text, _ = ask(oai, [SYSTEM, {"role": "user", "content": "what is in this picture?"}])
    assert n_prompt - n_text >= 2 + 4  # the markers and at least 4 image tokens


def test_second_turn_about_the_same_image_is_a_hit_that_answers_as_a_cold_run(oai: openai.OpenAI) -> None:
    first = [SYSTEM, user(data_uri(png(3)))]
    reply, n_first, _ = ask(oai, first)
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and what colours?"}]
    warm, _, cached = ask(oai, second)
    assert cached >= n_first  # the whole first turn, its image included
    cold, _, cold_cached = ask(oai, second, cold=True)
    assert cold_cached == 0 and warm == cold


def test_another_image_with_the_same_text_adopts_only_the_text_before_it(served, pair, oai: openai.OpenAI) -> None:
    ask(oai, [SYSTEM, user(data_uri(png(4)))])
    other = [SYSTEM, user(data_uri(png(5)))]
    warm, _, cached = ask(oai, other)
    assert cached == first_image_token(served, pair, other)  # mm_digest differs: the image is not adopted
    cold, _, _ = ask(oai, other, cold=True)
    assert warm == cold


# ---------------------------------------------------------------- embeddings of prompts with images


def raw_prompt(seed: int, text: str = "Picture: <__media__> Caption:") -> dict[str, Any]:
    return {"prompt_string": text, "multimodal_data": [base64.b64encode(png(seed)).decode()]}


def head_of(text_gguf: Path) -> np.ndarray:
    """The text GGUF's output head (tied: the token embeddings), dequantized by gguf-py: (vocab, n_embd)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(text_gguf)).tensors}
    t = tensors.get("output.weight", tensors["token_embd.weight"])
    return dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0])).astype(np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max()
    return logits - top - np.log(np.exp(logits - top).sum())


def test_an_image_embedding_is_the_completions_last_hidden_state(served, pair) -> None:
    """Pooling ``last`` unnormalised is the prompt's last hidden state, which ``/completion``'s
    prefill turns into its first token's logits: through the GGUF's head, the embedding gives the
    log-probabilities ``n_probs`` reports (to the Q8_0 head's rounding), and another image's
    embedding does not."""
    head = head_of(pair[1])
    with httpx.Client(base_url=served.base_url, timeout=120) as c:
        vectors = [c.post("/embeddings", json={"content": raw_prompt(seed), "embd_normalize": -1}).json()[0]["embedding"]
                   for seed in (10, 11)]
        done = c.post("/completion", json={"prompt": raw_prompt(10), "n_predict": 1, "n_probs": 10, "temperature": 0,
                                           "cache_prompt": False}).json()
    top = done["completion_probabilities"][0]["top_logprobs"]
    ids, served_logprobs = [t["id"] for t in top], np.array([t["logprob"] for t in top])
    same, other = (log_softmax(head @ np.asarray(v[0], dtype=np.float64))[ids] for v in vectors)
    assert np.abs(same - served_logprobs).max() < 0.05
    assert np.abs(other - served_logprobs).max() > 0.1


def test_image_embeddings_are_stable_differ_by_image_and_reuse_the_prepared_image(served, oai: openai.OpenAI) -> None:
    with httpx.Client(base_url=served.base_url, timeout=120) as c:
        first = c.post("/embeddings", json={"content": [raw_prompt(20), raw_prompt(21)]}).json()
        before = c.get("/v1/cache/stats").json()["prepared_images"]
        again = c.post("/embeddings", json={"content": [raw_prompt(20), {"prompt_string": "Picture: Caption:"}]}).json()
        after = c.get("/v1/cache/stats").json()["prepared_images"]
    assert again[0]["embedding"] == first[0]["embedding"]  # deterministic
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"]  # no second decode
    a, b, text = (np.asarray(e["embedding"][0]) for e in (first[0], first[1], again[1]))
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-5)  # pooled rows are normalised (embd_normalize 2)
    assert float(a @ b) < 0.9999 and float(a @ text) < 0.9999  # another image, or none, gives another vector
    # The official client: an OpenAI content array embeds as the native prompt with the same image.
    parts = {"content": [{"type": "text", "text": "Picture: "}, {"type": "image_url", "image_url": {"url": data_uri(png(20))}},
                         {"type": "text", "text": " Caption:"}]}
    reply = oai.embeddings.create(model="tiny-vl-gguf", input=[parts, raw_prompt(21)])  # type: ignore[list-item]
    assert [d.index for d in reply.data] == [0, 1]
    np.testing.assert_allclose(reply.data[0].embedding, a, atol=1e-6)
    np.testing.assert_allclose(reply.data[1].embedding, b, atol=1e-6)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 2 * 8  # the images' tokens count


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_string": "Picture: <__media__>", "multimodal_data": ["malformed"]}, "image data is not valid base64"),
    ({"prompt_string": "Picture:", "multimodal_data": ["base64"]}, "0 media markers"),
    ({"content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}, "--media-fetch"),
    ({"content": [{"type": "image_url", "image_url": {"url": "data:text/html;base64,aGVsbG8="}}]}, "unsupported media type"),
    ({"content": [{"type": "input_video", "input_video": {"url": "x"}}]}, "video input is not supported"),
])
def test_bad_media_in_embeddings_is_a_400_and_the_server_stays_healthy(served, prompt, message) -> None:
    with httpx.Client(base_url=served.base_url, timeout=120) as c:
        r = c.post("/v1/embeddings", json={"input": ["fine", prompt]})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert c.get("/health").status_code == 200
        assert c.post("/v1/embeddings", json={"input": [raw_prompt(1)]}).status_code == 200
