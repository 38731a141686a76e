"""The factory's tiny Gemma 3n on the engine: audio clips through the audio tower, logits equal to
mlx-vlm's own forward pass (its text embeddings scaled as Hugging Face's Gemma3nModel does), and
the prompt cache's whole-media rule for audio; the media side's decoding and limits."""

from __future__ import annotations

import base64
import io
import json
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG
from mlxcel_compat.cache.media import first_media_token, split_ok
from mlxcel_compat.chat.request import AudioSource
from mlxcel_compat.engine.request import CacheContext, GenerationRequest
from mlxcel_compat.engine.sampling.params import SamplingParams
from mlxcel_compat.server.errors import InvalidRequest
from mlxcel_compat.server.media import ImageInput, MediaLimits, is_audio
from mlxcel_compat.testing import vision
from tests.engine.harness import EngineHarness, disk_tier_harness
from tests.engine.test_vision import cold_tokens, run  # the same helpers as for images


def wav(seed: int, seconds: float = 1.0, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    """A seeded tone plus noise as PCM WAV."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    signal = 0.4 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    pcm = (np.clip(signal, -1, 1) * (2 ** (8 * width - 1) - 1)).astype({2: "<i2", 4: "<i4"}[width])
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(np.repeat(pcm[:, None], channels, axis=1).tobytes())
    return out.getvalue()


def encoded(clip: bytes, fmt: str) -> bytes:
    """The same recording as MP3 or FLAC, written by libsndfile (the ``soundfile`` test
    dependency): no encoder is part of the server, which only decodes."""
    import soundfile

    with wave.open(io.BytesIO(clip)) as w:
        rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, w.getnchannels())
    out = io.BytesIO()
    soundfile.write(out, pcm, rate, format=fmt.upper())
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def audio_dir() -> Path:
    from tests.conftest import MODEL_CACHE

    return vision.ensure_vision_model(MODEL_CACHE, "gemma3n")


@pytest.fixture(scope="module")
def media(audio_dir: Path) -> ImageInput:
    from mlxcel_compat.vision.model import vision_facts

    return ImageInput(vision_facts(audio_dir, json.loads((audio_dir / "config.json").read_text())), MediaLimits())


class Prompts:
    """Prompts built as the chat route builds them: text, an audio marker per clip, text."""

    def __init__(self, tokenizer: Any, media: ImageInput) -> None:
        self.tok = tokenizer
        self.media = media

    def request(self, before: str, seeds: list[int], after: str, n_predict: int = 6, cache: bool = True) -> GenerationRequest:
        marker = list(self.media.facts.audio.marker)
        tokens = list(self.tok.encode(before, add_special_tokens=False))
        for seed in seeds:
            tokens += marker + list(self.tok.encode(f" clip {seed}", add_special_tokens=False))
        tokens += list(self.tok.encode(after, add_special_tokens=False))
        tokens, media, digest = self.media.prepare([AudioSource(b64(wav(s)), "wav") for s in seeds], tokens)
        return GenerationRequest(
            prompt_tokens=tokens, sampling=SamplingParams(temperature=0.0, seed=7), n_predict=n_predict, media=media,
            cache=CacheContext(enabled=cache, session_key="s", template_sig=RAW_PROMPT_TEMPLATE_SIG, mm_digest=digest),
        )


@pytest.fixture(scope="module")
def harness(audio_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    h = disk_tier_harness(audio_dir, tmp_path_factory.mktemp("audio-disk"))
    yield h
    h.close()


@pytest.fixture()
def prompts(harness: EngineHarness, media: ImageInput) -> Prompts:
    return Prompts(harness.tokenizer, media)


def test_the_prompt_holds_each_clip_as_gemma3n_processor_writes_it(media: ImageInput, audio_dir: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    facts = media.facts.audio
    request = Prompts(load_tokenizer(audio_dir), media).request("Listen:", [1, 2], " What is it?")
    config = json.loads((audio_dir / "config.json").read_text())
    tokens, spans = request.prompt_tokens, request.media.spans
    assert len(spans) == 2 and all(end - start == config["audio_soft_tokens_per_image"] for start, end in spans)
    start, end = spans[0]
    assert tokens[start - 1] == config["boa_token_id"] and tokens[end] == config["eoa_token_id"]
    assert set(tokens[start:end]) == {facts.audio_token_id}
    assert not media.facts.images


def _logits(model: Any, request: GenerationRequest, step: int) -> Any:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tokens = request.prompt_tokens
    bound, cache = model.bind(request.media, tokens), make_prompt_cache(model)
    return mx.concatenate([bound(mx.array(tokens[i : i + step])[None], cache=cache) for i in range(0, len(tokens), step)], axis=1)


def _without_kv_sharing(audio_dir: Path, root: Path) -> Path:
    """The factory's Gemma 3n with every layer keeping its own KV (``num_kv_shared_layers`` 0)."""
    import mlx.core as mx

    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (root / name).write_bytes((audio_dir / name).read_bytes())
    config = vision.model_config("gemma3n")
    config["text_config"]["num_kv_shared_layers"] = 0
    (root / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(root / "model.safetensors"), vision.random_weights(config), metadata={"format": "mlx"})
    return root


def test_chunked_prefill_with_audio_gives_mlx_vlms_own_logits(audio_dir: Path, media: ImageInput, tmp_path: Path) -> None:
    """5-token chunks against mlx-vlm's own path over the whole prompt (its ``get_input_embeddings``
    with the clips' features, then its language model and its own caches: a rotating window on the
    sliding layers, the tiny window of 24 shorter than the prompt), with the text rows scaled by
    ``sqrt(hidden_size)`` as Hugging Face's Gemma3nModel embeds them (mlx-vlm 0.7.10 leaves them
    unscaled when a prompt has media; its text-only path scales them).

    mlx-vlm's KV-sharing layers rotate their queries at positions ahead by the chunk's length (its
    logits depend on the chunking), so the comparison is on the factory model without KV sharing;
    with it, the logits are the same for every chunking, as Hugging Face's model's are."""
    import mlx.core as mx

    from mlxcel_compat.vision.model import load_vision_directory

    model, tokenizer, _, _ = load_vision_directory(_without_kv_sharing(audio_dir, tmp_path))
    request = Prompts(tokenizer, media).request("Two clips to compare:", [1, 2], " Which is higher?")
    tokens = request.prompt_tokens
    assert len(tokens) > 2 * vision.SLIDING_WINDOW
    ours = _logits(model, request, 5)
    vlm, ids = model.vlm, mx.array(tokens)[None]
    features = mx.array(np.concatenate([c.features for c in request.media.audio]))
    masks = mx.array(np.concatenate([c.mask for c in request.media.audio]))
    out = vlm.get_input_embeddings(ids, None, input_features=features, input_features_mask=masks)
    text = (ids < vlm.language_model.model.vocab_size_per_layer_input)[..., None]
    embeds = mx.where(text, out.inputs_embeds * (vlm.language_model.model.hidden_size ** 0.5), out.inputs_embeds)
    theirs = vlm.language_model(None, inputs_embeds=embeds, per_layer_inputs=out.per_layer_inputs,
                                cache=vlm.language_model.make_cache()).logits
    assert float(mx.abs(ours - theirs).max()) < 1e-4
    # Text alone runs as mlx-vlm's language model runs it.
    words = mx.array(list(tokenizer.encode("Only words, no sound, long enough to pass the window.", add_special_tokens=False)))[None]
    plain = model(words, cache=model.make_cache())
    assert float(mx.abs(plain - vlm.language_model(words, cache=vlm.language_model.make_cache()).logits).max()) < 1e-4


def test_with_kv_sharing_the_logits_do_not_depend_on_the_chunking(audio_dir: Path, media: ImageInput) -> None:
    import mlx.core as mx

    from mlxcel_compat.vision.model import load_vision_directory

    model, tokenizer, _, _ = load_vision_directory(audio_dir)
    assert model.vlm.language_model.model.first_kv_shared_layer_idx < len(model.layers)  # the factory shares KV
    request = Prompts(tokenizer, media).request("One clip:", [3], " What is it?")
    whole = _logits(model, request, len(request.prompt_tokens))
    for step in (1, 5, 24):
        assert float(mx.abs(_logits(model, request, step) - whole).max()) < 1e-4


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_later_turn_about_the_same_audio_adopts_it_whole(harness: EngineHarness, prompts: Prompts, tier: str) -> None:
    harness.reset()
    first = prompts.request(f"Hear this ({tier}):", [1], " What sound is it?")
    out = run(harness.engine, first)
    if tier == "disk":
        harness.on_engine(lambda: harness.engine.prefix_cache.disk.wait_written(30))
        harness.on_engine(lambda: harness.engine.prefix_cache.reset("ram"))
    nxt = prompts.request(f"Hear this ({tier}):", [1], " What sound is it?")
    nxt.prompt_tokens = first.prompt_tokens + out.tokens + list(harness.tokenizer.encode(" Again?", add_special_tokens=False))
    warm = run(harness.engine, nxt)
    assert warm.finish is not None and warm.finish.n_cached >= len(first.prompt_tokens) > nxt.media.spans[-1][1]
    assert split_ok(warm.finish.n_cached, nxt.media.spans)
    assert warm.tokens == cold_tokens(harness.engine, nxt)


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_another_clip_adopts_only_the_text_before_it(harness: EngineHarness, prompts: Prompts, tier: str) -> None:
    harness.reset()
    text = f"A long shared instruction about the sound that follows ({tier}):"
    run(harness.engine, prompts.request(text, [3], " Describe it."))
    if tier == "disk":
        harness.on_engine(lambda: harness.engine.prefix_cache.disk.wait_written(30))
        harness.on_engine(lambda: harness.engine.prefix_cache.reset("ram"))
    other = prompts.request(text, [4], " Describe it.")
    warm = run(harness.engine, other)
    assert warm.finish is not None and warm.finish.n_cached == first_media_token(other.media.spans)
    assert warm.tokens == cold_tokens(harness.engine, other)


def test_text_only_requests_reuse_the_cache(harness: EngineHarness) -> None:
    harness.reset()
    prompt = list(harness.tokenizer.encode("Plain text with no sound at all, twice over.", add_special_tokens=False))
    first = harness.run(prompt, n_predict=6)
    again = harness.run(prompt + first.tokens + [11, 12, 13], n_predict=6)
    assert again.finish is not None and again.finish.n_cached >= len(prompt)
    assert again.tokens == harness.run(prompt + first.tokens + [11, 12, 13], n_predict=6, cache=False).tokens


def test_the_digest_covers_the_decoded_samples(media: ImageInput) -> None:
    marker = list(media.facts.audio.marker)

    def digest(*clips: bytes) -> bytes:
        return media.prepare([AudioSource(b64(c), "wav") for c in clips], marker * len(clips))[2]

    # The digest is over the decoded float samples: stereo with equal channels and its mono, or a
    # 16-bit recording widened to 24 bits, decode to the same samples and give one digest.
    assert digest(wav(1)) == digest(wav(1))
    assert digest(wav(1), wav(2)) != digest(wav(2), wav(1))
    assert digest(wav(1)) != digest(wav(2))
    assert digest(wav(1)) == digest(wav(1, channels=2))
    assert digest(wav(1)) == digest(as_24_bit(wav(1)))
    # FLAC is lossless: the same 16-bit recording decodes to the same samples as its WAV.
    assert digest(wav(1)) == digest(encoded(wav(1), "flac"))
    # MP3 is lossy: other samples, another digest; the same MP3 bytes, the same one.
    assert digest(encoded(wav(1), "mp3")) == digest(encoded(wav(1), "mp3")) != digest(wav(1))


def test_mp3_and_flac_decode_to_the_recording(media: ImageInput) -> None:
    """miniaudio (llama-server's decoder) gives the clip at the extractor's rate: FLAC exactly the
    WAV's samples, MP3 the same tone (its spectrum peaks at the tone's frequency), both about
    the recording's length (an MP3 encoder pads by a few frames)."""
    from mlxcel_compat.server.media import decode_audio

    clip = wav(2, seconds=1.0, rate=22050, channels=2)  # a 300 Hz tone, resampled to 16 kHz on decoding
    decode = lambda data: decode_audio(data, None, MediaLimits(), 16000, 480000).samples  # noqa: E731
    reference = decode(clip)
    assert reference.size == 16000
    np.testing.assert_array_equal(decode(encoded(clip, "flac")), reference)
    lossy = decode(encoded(clip, "mp3"))
    assert 16000 <= lossy.size <= 16000 + 2 * 1152
    spectrum = np.abs(np.fft.rfft(lossy[:16000]))
    assert abs(int(np.argmax(spectrum)) - 300) <= 2  # 1 Hz a bin over one second


def as_24_bit(clip: bytes) -> bytes:
    """The same 16-bit recording written as 24-bit PCM (a zero low byte under each sample)."""
    with wave.open(io.BytesIO(clip)) as w:
        rate, frames = w.getframerate(), w.readframes(w.getnframes())
    pairs = np.frombuffer(frames, np.uint8).reshape(-1, 2)
    wide = np.concatenate([np.zeros((pairs.shape[0], 1), np.uint8), pairs], axis=1)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(3)
        w.setframerate(rate)
        w.writeframes(wide.tobytes())
    return out.getvalue()


@pytest.mark.parametrize(("clip", "fmt", "message"), [
    (b"RIFF\x00\x00\x00\x00WAVEjunk", "wav", "failed to load audio"),
    (b"not audio at all", "wav", "not a WAV, MP3 or FLAC file"),
    (b"ID3\x03\x00\x00\x00\x00\x00\x00", "mp3", "not a valid MP3 stream"),
    (b"fLaC\x00\x00\x00\x22" + bytes(40), "wav", "not a valid FLAC stream"),
    (None, "flac", "must be 'wav' or 'mp3'"),
])
def test_bad_audio_is_a_400_that_says_why(media: ImageInput, clip: bytes | None, fmt: str, message: str) -> None:
    data = wav(1) if clip is None else clip
    with pytest.raises(InvalidRequest, match=message):
        media.prepare([AudioSource(b64(data), fmt)], list(media.facts.audio.marker))


def test_audio_limits(media: ImageInput) -> None:
    marker = list(media.facts.audio.marker)
    with pytest.raises(InvalidRequest, match=r"audio is 2\.00 s long, over the limit of 1\.28 s"):
        media.prepare([AudioSource(b64(wav(1, seconds=2.0)), "wav")], marker)
    truncated = wav(1)[:-100]
    with pytest.raises(InvalidRequest, match="truncated"):
        media.prepare([AudioSource(b64(truncated), "wav")], marker)
    small = ImageInput(media.facts, MediaLimits(max_bytes=1000, max_audio=1, max_audio_seconds=0.5))
    with pytest.raises(InvalidRequest, match="--media-max-bytes"):
        small.prepare([AudioSource(b64(wav(1)), "wav")], marker)
    with pytest.raises(InvalidRequest, match="2 audio clips in one request, over the limit of 1"):
        small.prepare([AudioSource(b64(wav(1)), "wav")] * 2, marker * 2)
    with pytest.raises(InvalidRequest, match="over the limit of 0.50 s"):
        ImageInput(media.facts, MediaLimits(max_audio_seconds=0.5)).prepare([AudioSource(b64(wav(1)), "wav")], marker)
    # An MP3's length is counted from its frames before any is decoded.
    with pytest.raises(InvalidRequest, match=r"audio is 2\.\d\d s long, over the limit of 1\.28 s"):
        media.prepare([AudioSource(b64(encoded(wav(1, seconds=2.0), "mp3")), "mp3")], marker)
    # The bytes say what a clip is, as in llama-server: WAV data labelled mp3 is decoded as WAV.
    assert media.prepare([AudioSource(b64(wav(1)), "mp3")], marker)[2] == media.prepare([AudioSource(b64(wav(1)), "wav")], marker)[2]
    # Another rate is resampled to the extractor's (16 kHz): 0.5 s at 8 kHz is 8000 samples.
    _, out, _ = media.prepare([AudioSource(b64(wav(1, seconds=0.5, rate=8000)), "wav")], marker)
    assert out.audio[0].mask.sum() > 0
    assert is_audio(wav(1)) and is_audio(b"ID3\x03rest") and not is_audio(b"\x89PNG\r\n\x1a\n")
