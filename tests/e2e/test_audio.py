"""End to end: audio through the official openai client and httpx to a real server on the
factory's tiny Gemma 3n (mlx-vlm's classes: its audio tower, its text model).

- A chat with an ``input_audio`` part is answered; ``/props`` says audio (and not vision).
- The prompt cache: a second turn about the same clip adopts the whole first turn, clip included
  (``cached_tokens``), and answers as a cold run does; the same text with another clip adopts
  exactly the tokens before the clip's first token.
- Native ``/completion`` takes a WAV ``multimodal_data`` item (told from an image by its bytes).
- Bad audio is a 400 with a message that says what is wrong, and the server stays healthy; an
  image on this model keeps llama-server's 500.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mlxcel_compat.testing import vision
from tests.e2e.test_vision import ask as vision_ask
from tests.engine.test_audio import encoded, wav

pytestmark = pytest.mark.e2e

SYSTEM = {"role": "system", "content": "You are a careful assistant who describes sounds in plain words."}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def user(clip: bytes, text: str = "what is this sound?", fmt: str = "wav") -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "input_audio", "input_audio": {"data": b64(clip), "format": fmt}}]}


@pytest.fixture(scope="module")
def audio_dir() -> Path:
    from tests.conftest import MODEL_CACHE

    return vision.ensure_vision_model(MODEL_CACHE, "gemma3n")


@pytest.fixture(scope="module")
def srv(server_factory, audio_dir: Path):
    return server_factory(["-m", str(audio_dir), "-np", "1", "-c", "4096", "-b", "64", "--prompt-cache-min-prefix", "8",
                           "--props", "--alias", "tiny-audio"])


@pytest.fixture()
def oai(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def http(srv) -> httpx.Client:
    with httpx.Client(base_url=srv.base_url, timeout=60) as client:
        yield client


def ask(oai: openai.OpenAI, messages: list[dict[str, Any]], cold: bool = False) -> tuple[str, int, int]:
    return vision_ask(oai, messages, cold, model="tiny-audio")


def test_props_say_audio(http: httpx.Client) -> None:
    assert http.get("/props").json()["modalities"] == {"vision": False, "video": False, "audio": True}
    assert "multimodal" in http.get("/v1/models").json()["models"][0]["capabilities"]


def test_a_chat_with_audio_is_answered_and_the_clip_takes_its_tokens(oai: openai.OpenAI, audio_dir: Path) -> None:
    content, n_prompt, _ = ask(oai, [SYSTEM, user(wav(1))])
    _, n_text, _ = ask(oai, [SYSTEM, {"role": "user", "content": "what is this sound?"}])
    config = json.loads((audio_dir / "config.json").read_text())
    # "\n\n<start_of_audio>" + the clip's tokens + "<end_of_audio>\n\n" in place of the soft token
    assert n_prompt - n_text >= config["audio_soft_tokens_per_image"] + 1
    assert isinstance(content, str)


def test_second_turn_about_the_same_audio_reuses_it(oai: openai.OpenAI) -> None:
    first = [SYSTEM, user(wav(3))]
    answer, n_first, _ = ask(oai, first)
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "and how loud is it?"}]
    warm, _, cached = ask(oai, second)
    assert cached >= n_first - 2  # the whole first turn, clip included (the reply's own tail aside)
    cold, _, _ = ask(oai, second, cold=True)
    assert warm == cold


def test_the_same_text_with_another_clip_reuses_only_the_text_before_it(oai: openai.OpenAI, http: httpx.Client,
                                                                        audio_dir: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    from mlxcel_compat.vision.model import vision_facts

    text = "A long shared instruction that comes before the clip, about listening carefully:"
    ask(oai, [SYSTEM, user(wav(5), text)])
    messages = [SYSTEM, user(wav(6), text)]
    warm, _, cached = ask(oai, messages)
    tokenizer = load_tokenizer(audio_dir)
    facts = vision_facts(audio_dir, json.loads((audio_dir / "config.json").read_text()), tokenizer).audio
    prompt = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    head = prompt[: prompt.index(vision.TEMPLATE_AUDIO["gemma3n"])]
    assert cached == len(tokenizer.encode(head, add_special_tokens=False)) + len(facts.before)
    assert warm == ask(oai, messages, cold=True)[0]


def test_an_mp3_clip_is_answered_and_its_second_turn_reuses_it(oai: openai.OpenAI) -> None:
    first = [SYSTEM, user(encoded(wav(4), "mp3"), fmt="mp3")]
    answer, n_first, _ = ask(oai, first)
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "is it a voice?"}]
    warm, _, cached = ask(oai, second)
    assert cached >= n_first - 2
    assert warm == ask(oai, second, cold=True)[0]


def test_native_completion_takes_a_flac_multimodal_data_item(http: httpx.Client) -> None:
    marker = http.get("/props").json()["media_marker"]
    body = {"prompt": {"prompt_string": f"Sound: {marker} Caption:", "multimodal_data": [b64(encoded(wav(8), "flac"))]},
            "n_predict": 4, "temperature": 0}
    reply = http.post("/completion", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens_evaluated"] > vision.AUDIO_TOKENS_PER_CLIP


def test_native_completion_takes_a_wav_multimodal_data_item(http: httpx.Client) -> None:
    marker = http.get("/props").json()["media_marker"]
    body = {"prompt": {"prompt_string": f"Sound: {marker} Caption:", "multimodal_data": [b64(wav(7))]}, "n_predict": 4,
            "temperature": 0}
    reply = http.post("/completion", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens_evaluated"] > vision.AUDIO_TOKENS_PER_CLIP


BAD = [
    (b"RIFF\x00\x00\x00\x00WAVEjunk", "wav", "failed to load audio"),
    (b"plain text, not audio", "wav", "not a WAV, MP3 or FLAC file"),
    (wav(1, seconds=3.0), "wav", "over the limit of 1.28 s"),
    (wav(1)[:-200], "wav", "truncated"),
    (b"ID3\x03\x00\x00\x00\x00\x00\x00", "mp3", "not a valid MP3 stream"),
    (wav(1), "ogg", "input_audio.format must be either 'wav' or 'mp3'"),
]


@pytest.mark.parametrize("clip, fmt, message", BAD)
def test_bad_audio_is_a_400_and_the_server_stays_healthy(oai: openai.OpenAI, http: httpx.Client, clip: bytes, fmt: str,
                                                         message: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(oai, [user(clip, fmt=fmt)])
    assert info.value.status_code == 400 and message in str(info.value.body)
    assert http.get("/health").status_code == 200
    assert ask(oai, [user(wav(1))])[1] > 0


def test_images_keep_llama_servers_refusal_on_an_audio_model(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        oai.chat.completions.create(model="tiny-audio", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert "image input is not supported" in str(info.value.body)
