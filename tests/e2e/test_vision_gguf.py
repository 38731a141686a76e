"""End to end: a GGUF pair (``-m text.gguf --mmproj mmproj-*.gguf``, as llama-server serves images)
through the openai SDK, on the factory's tiny Qwen2.5-VL (by default), Gemma 3, SmolVLM, Qwen3-VL, InternVL, LLaVA and Mistral 3 (``slow``),
written as llama.cpp's converter writes them (``python -m mlxcel_compat.testing.vision --format gguf``).

- ``/props`` says vision; a chat with an image part is answered, the image taking its tokens.
- The prompt cache's rules hold as for a directory: ``mm_digest`` is in the key (the same text
  with another image adopts exactly the tokens before the first image token), and a second turn
  about the same image adopts the whole first turn, image included, and answers as a cold run does.
Refusals (a directory with ``--mmproj``, unknown projector types) are tested in-process:
``tests/vision/test_gguf_projector.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
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
                           "--prompt-cache-min-prefix", "8", "--props", "--alias", "tiny-vl-gguf"])


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
