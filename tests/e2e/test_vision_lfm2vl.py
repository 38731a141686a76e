"""End to end: LFM2-VL through the openai SDK on a real server (``slow``: the default suite checks the
same rules in-process, ``tests/vision/test_lfm2vl.py``), the factory's tiny directory and its GGUF
pair (``-m text.gguf --mmproj mmproj-*.gguf``).

- ``/props`` says vision; a chat with a tiled image part is answered, the image taking its tokens;
- the hybrid's prompt cache (session snapshots): a chat's second turn about the same image restores
  the first turn's prompt, image included, and answers as a cold run; another image with the same
  text restores nothing (its digest differs) and answers as a cold run;
- a broken image is a 400 and the server stays healthy.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from mlxcel_compat.testing import vision
from tests.e2e.test_vision import SYSTEM, data_uri, png, user

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module", params=["directory", "gguf"])
def served(request: pytest.FixtureRequest, server_factory):
    from tests.conftest import MODEL_CACHE

    if request.param == "directory":
        model = ["-m", str(vision.ensure_vision_model(MODEL_CACHE, "lfm2_vl"))]
    else:
        text, mmproj = vision.ensure_vision_gguf(MODEL_CACHE, "lfm2_vl", gguf_type="q8_0")
        model = ["-m", str(text), "--mmproj", str(mmproj)]
    return server_factory([*model, "-np", "1", "-c", "4096", "-b", "64", "--props", "--alias", "tiny-lfm2-vl"])


@pytest.fixture()
def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)


def ask(oai: openai.OpenAI, messages: list[dict[str, Any]], cold: bool = False) -> tuple[str, int, int]:
    reply = oai.chat.completions.create(model="tiny-lfm2-vl", messages=messages, max_tokens=6, temperature=0,
                                        extra_body={"cache_prompt": False} if cold else None)
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_props_say_vision_and_a_tiled_image_is_answered(served, oai: openai.OpenAI) -> None:
    assert httpx.get(served.base_url + "/props").json()["modalities"]["vision"] is True
    content, n_prompt, _ = ask(oai, [SYSTEM, user(data_uri(png(1, (1100, 500))))])
    assert content
    _, n_text, _ = ask(oai, [SYSTEM, {"role": "user", "content": "what is in this picture?"}])
    assert n_prompt - n_text >= 2 * 4 + 2  # two tiles of at least 4 tokens, their markers


def test_a_chats_second_turn_about_the_same_image_restores_the_first(oai: openai.OpenAI) -> None:
    first = [SYSTEM, user(data_uri(png(3, (300, 180))))]
    reply, n_first, _ = ask(oai, first)
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and what colours?"}]
    warm, _, cached = ask(oai, second)
    assert cached >= n_first - 1  # the first prompt's snapshot (all but its last token), the image in it
    cold, _, cold_cached = ask(oai, second, cold=True)
    assert cold_cached == 0 and warm == cold


def test_another_image_restores_nothing_and_answers_as_a_cold_run(oai: openai.OpenAI) -> None:
    ask(oai, [SYSTEM, user(data_uri(png(4, (300, 180))))])
    other = [SYSTEM, user(data_uri(png(5, (300, 180))))]
    warm, _, cached = ask(oai, other)
    assert cached == 0
    assert warm == ask(oai, other, cold=True)[0]


def test_a_broken_image_is_a_400_and_the_server_stays_healthy(served) -> None:
    body = {"messages": [user("data:image/png;base64,AAAA")], "max_tokens": 4}
    reply = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "failed to load image" in reply.json()["error"]["message"]
    assert httpx.get(served.base_url + "/health").status_code == 200
