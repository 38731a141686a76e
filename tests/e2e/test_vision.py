"""End to end: images through the official openai and anthropic clients to a real server on each
of the factory's tiny Qwen2.5-VL, Gemma 3 and LLaVA (mlx-vlm's classes: vision tower, merged
embeddings, multimodal RoPE for Qwen, plain positions for the other two).

- A chat with an image is answered, on every chat-like API (OpenAI chat, Anthropic Messages,
  OpenAI Responses).
- The prompt cache: a second turn about the same image adopts the whole first turn, image
  included (``cached_tokens``), and answers as a cold run does; the same text with another image
  adopts exactly the tokens before the first image token, and answers as a cold run does.
- Bad media is a 400 with a message that says what is wrong, and the server stays healthy.
- A slot holding image tokens cannot be saved (llama-server's 501). GGUF pairs (``--mmproj``):
  ``test_vision_gguf.py``.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from mlxcel_compat.testing import vision

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are a careful assistant who describes pictures in plain words."}


def png(seed: int, size: tuple[int, int] = (56, 40)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user(image: str, text: str = "what is in this picture?") -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": image}}]}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "gemma3", "llava"])
def vlm_dir(request: pytest.FixtureRequest) -> Path:
    from tests.conftest import MODEL_CACHE

    return vision.ensure_vision_model(MODEL_CACHE, request.param)


@pytest.fixture(scope="module")
def vlm(server_factory, vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    slots = tmp_path_factory.mktemp("vision-slots")
    return server_factory(["-m", str(vlm_dir), "-np", "1", "-c", "4096", "-b", "64", "--prompt-cache-min-prefix", "8",
                           "--slot-save-path", str(slots), "--props", "--alias", "tiny-vl", "--no-mmproj"])  # accepted: nothing to turn off


@pytest.fixture()
def oai(vlm) -> openai.OpenAI:
    return openai.OpenAI(base_url=vlm.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def http(vlm) -> httpx.Client:
    with httpx.Client(base_url=vlm.base_url, timeout=60) as client:
        yield client


def ask(oai: openai.OpenAI, messages: list[dict[str, Any]], cold: bool = False, model: str = "tiny-vl") -> tuple[str, int, int]:
    """(content, prompt tokens, cached tokens) of a greedy 6-token reply; ``cold``: no cache."""
    reply = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                        extra_body={"cache_prompt": False} if cold else None)
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def first_image_token(http: httpx.Client, vlm_dir: Path, messages: list[dict[str, Any]]) -> int:
    """Where the first image token sits in the prompt: the tokens of the text before the image's
    marker, the marker's tokens before the one expanded, and the family's tokens before the image's
    (Gemma 3: ``\\n\\n<start_of_image>``)."""
    import json

    from mlx_lm.utils import load_tokenizer

    from mlxcel_compat.vision.model import vision_facts

    tokenizer = load_tokenizer(vlm_dir)
    config = json.loads((vlm_dir / "config.json").read_text())
    facts = vision_facts(vlm_dir, config, tokenizer)
    prompt = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    head = prompt[: prompt.index(vision.TEMPLATE_IMAGE[config["model_type"]])]
    return len(tokenizer.encode(head, add_special_tokens=False)) + list(facts.marker).index(facts.expand_token) + len(facts.before)


def test_props_and_models_say_vision(http: httpx.Client) -> None:
    assert http.get("/props").json()["modalities"] == {"vision": True, "video": False, "audio": False}
    assert "multimodal" in http.get("/v1/models").json()["models"][0]["capabilities"]


def test_a_chat_with_an_image_is_answered_and_the_image_takes_its_patch_tokens(oai: openai.OpenAI) -> None:
    content, n_prompt, _ = ask(oai, [SYSTEM, user(data_uri(png(1)))])
    assert content
    text_only, n_text, _ = ask(oai, [SYSTEM, {"role": "user", "content": "what is in this picture?"}])
    # Qwen: 56x40 pixels resized by the processor to its own grid: the image adds <|vision_start|>,
    # its merged patches and <|vision_end|>; Gemma 3 and LLaVA: a fixed 4 or 16 tokens (and markers).
    assert n_prompt - n_text >= 2 + 4


def test_second_turn_about_the_same_image_reuses_the_image(oai: openai.OpenAI) -> None:
    first = [SYSTEM, user(data_uri(png(3)))]
    reply, n_first, _ = ask(oai, first)
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and what colours?"}]
    warm, _, cached = ask(oai, second)
    assert cached >= n_first  # the whole first turn, its image included
    assert httpx.get(str(oai.base_url).replace("/v1/", "/v1/cache/stats")).json()["multimodal_entries"] >= 1
    cold, _, cold_cached = ask(oai, second, cold=True)
    assert cold_cached == 0 and warm == cold


def test_the_same_text_with_another_image_reuses_only_the_text_before_it(oai: openai.OpenAI, http: httpx.Client, vlm_dir: Path) -> None:
    ask(oai, [SYSTEM, user(data_uri(png(4)))])
    other = [SYSTEM, user(data_uri(png(5)))]
    warm, _, cached = ask(oai, other)
    assert cached == first_image_token(http, vlm_dir, other)
    cold, _, _ = ask(oai, other, cold=True)
    assert warm == cold


def test_cache_explain_names_the_changed_image_at_its_first_token(http: httpx.Client, vlm_dir: Path) -> None:
    body = {"max_tokens": 2, "temperature": 0}
    http.post("/v1/chat/completions", json={**body, "messages": [SYSTEM, user(data_uri(png(21)))]}).raise_for_status()
    other = [SYSTEM, user(data_uri(png(22)))]
    reply = http.post("/v1/chat/completions", json={**body, "messages": other, "cache_explain": True}).json()
    explained = reply["cache_explain"]
    assert explained["reason"] == "media_changed" and explained["candidate"]["differs"] == ["media"]
    assert explained["first_divergence"] == first_image_token(http, vlm_dir, other)
    # The text before the image came from the text-only bucket: a partial hit, as the usage says.
    assert explained["tokens_reused"] == reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert explained["outcome"] == "partial_hit"


def test_streaming_and_token_counting_with_an_image(oai: openai.OpenAI, http: httpx.Client) -> None:
    messages = [SYSTEM, user(data_uri(png(12)))]
    chunks = list(oai.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None
    assert streamed == ask(oai, messages, cold=True)[0]
    counted = http.post("/v1/chat/completions/input_tokens", json={"messages": messages}).json()
    assert counted["input_tokens"] == usage.prompt_tokens  # the image's tokens counted as the completion does


def test_the_same_image_as_webp_hits_the_png_entry(oai: openai.OpenAI) -> None:
    pixels = Image.open(io.BytesIO(png(6)))
    webp = io.BytesIO()
    pixels.save(webp, format="WEBP", lossless=True)
    first = [SYSTEM, user(data_uri(png(6)), "describe it")]
    reply, n_first, _ = ask(oai, first)
    again = [SYSTEM, user(data_uri(webp.getvalue(), "image/webp"), "describe it"), {"role": "assistant", "content": reply},
             {"role": "user", "content": "more"}]
    _, _, cached = ask(oai, again)
    assert cached >= n_first


def test_anthropic_client_image_block(vlm) -> None:
    claude = anthropic.Anthropic(base_url=vlm.base_url, api_key="unused", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(7)).decode()}}
    message = claude.messages.create(model="tiny-vl", max_tokens=6,
                                     messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"}, block]}])
    assert message.content and message.content[0].text  # type: ignore[union-attr]
    assert message.usage.input_tokens > 6


def test_responses_input_image(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model="tiny-vl", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                     {"type": "input_image", "image_url": data_uri(png(8)), "detail": "auto"}]}])
    assert response.output_text


def test_native_completion_multimodal_data_at_the_media_marker(http: httpx.Client) -> None:
    marker = http.get("/props").json()["media_marker"]
    item = base64.b64encode(png(10)).decode()
    body = {"prompt": {"prompt_string": f"Picture: {marker} Caption:", "multimodal_data": [item]}, "n_predict": 4,
            "temperature": 0}
    first = http.post("/completion", json=body).json()
    assert first["content"] and first["tokens_evaluated"] > 8
    again = http.post("/completion", json=body).json()
    assert again["content"] == first["content"] and again["tokens_cached"] >= first["tokens_evaluated"] - 1
    wrong = http.post("/completion", json={**body, "prompt": {"prompt_string": "no marker", "multimodal_data": [item]}})
    assert wrong.status_code == 400 and "0 media markers" in wrong.json()["error"]["message"]


def png_header_only(width: int, height: int) -> bytes:
    from tests.server.test_media_input import png_header_only as header

    return header(width, height)


BAD = [
    (data_uri(png(1)[:300]), "failed to load image"),  # truncated PNG
    (data_uri(b"hello", "text/plain"), "unsupported media type 'text/plain'"),
    (data_uri(png_header_only(20000, 20000)), "pixels"),
    (data_uri(png_header_only(5000, 5000)), "--media-max-pixels"),
    ("https://example.com/cat.png", "--media-fetch"),
]


@pytest.mark.parametrize("source, message", BAD)
def test_bad_media_is_a_400_and_the_server_stays_healthy(oai: openai.OpenAI, http: httpx.Client, source: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(oai, [user(source)])
    assert info.value.status_code == 400 and message in str(info.value.body)
    assert http.get("/health").status_code == 200
    assert ask(oai, [user(data_uri(png(1)))])[0]


def test_the_default_body_cap_has_room_for_an_image_at_the_byte_limit(oai: openai.OpenAI) -> None:
    big = png(11, (700, 700))  # random pixels: ~1.5 MB of PNG, ~2 MB of base64, over the text-only 1 MiB cap
    assert len(big) > 1 << 20
    content, _, _ = ask(oai, [user(data_uri(big))])
    assert content


def test_a_thousand_images_is_a_400(http: httpx.Client, oai: openai.OpenAI) -> None:
    tiny = data_uri(png(1, (4, 4)))
    parts = [{"type": "image_url", "image_url": {"url": tiny}}] * 1000
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    assert response.status_code == 400
    assert "1000 images in one request, over the limit of 16 (--media-max-images)" in response.json()["error"]["message"]
    assert ask(oai, [user(tiny)])[0]


def test_anthropic_bad_image_is_a_400(vlm) -> None:
    claude = anthropic.Anthropic(base_url=vlm.base_url, api_key="unused", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(1)[:300]).decode()}}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="tiny-vl", max_tokens=4, messages=[{"role": "user", "content": [block]}])
    assert info.value.status_code == 400 and "failed to load image" in str(info.value.body)


def test_slot_save_of_a_slot_holding_media_is_501(oai: openai.OpenAI, http: httpx.Client) -> None:
    ask(oai, [SYSTEM, user(data_uri(png(9)))])
    slot = http.get("/slots").json()[0]
    assert 4 <= slot["n_media_tokens"] < slot["n_prompt_tokens"]  # the image's tokens, shown beside llama-server's fields
    response = http.post("/slots/0?action=save", json={"filename": "vision.bin"})
    assert response.status_code == 501
    assert response.json()["error"] == {"code": 501, "message": "This feature is not supported by multimodal", "type": "not_supported_error"}
    ask(oai, [SYSTEM, {"role": "user", "content": "just text"}])  # a text slot saves as before
    assert "n_media_tokens" not in http.get("/slots").json()[0]
    assert http.post("/slots/0?action=save", json={"filename": "text.bin"}).status_code == 200


def test_audio_parts_keep_llama_servers_refusal_on_a_vision_model(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        oai.chat.completions.create(model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])
    assert "audio input is not supported" in str(info.value.body)
