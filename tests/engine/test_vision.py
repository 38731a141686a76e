"""The factory's tiny vision-language models (Qwen2.5-VL, Qwen2-VL, Gemma 3, LLaVA, SmolVLM) on the engine: images
through the vision tower, logits equal to mlx-vlm's own forward pass, and the prompt cache's
whole-image rule in RAM, on disk and in a slot's kept state.

Every adoption here is checked twice: its length is never strictly inside an image's tokens, and
the tokens generated after it are exactly a cold run's."""

from __future__ import annotations

import io
import json
import queue
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG
from mlxcel_compat.cache.media import first_media_token, split_ok
from mlxcel_compat.engine.core import Engine, EngineConfig
from mlxcel_compat.engine.request import CacheContext, GenerationRequest
from mlxcel_compat.engine.sampling.params import SamplingParams
from mlxcel_compat.server.media import ImageInput, MediaLimits
from mlxcel_compat.testing import vision
from tests.engine.harness import EngineHarness, Run, collect, disk_tier_harness


# SmolVLM's, Qwen3-VL's, InternVL's and Mistral 3's engine rows run with --slow (the suite's budget);
# tests/testing/test_vision_factory.py checks SmolVLM's logits against mlx-vlm's by default,
# tests/vision/test_qwen3vl.py, test_internvl.py and test_pixtral.py the others', and their GGUF pairs.
SLOW_ENGINE_ROWS = ("smolvlm", "qwen3_vl", "internvl_chat", "mistral3")


@pytest.fixture(scope="module", params=[pytest.param(f, marks=[pytest.mark.slow] if f in SLOW_ENGINE_ROWS else [])
                                        for f in vision.FAMILIES])
def vlm_dir(request: pytest.FixtureRequest) -> Path:
    from tests.conftest import MODEL_CACHE

    return vision.ensure_vision_model(MODEL_CACHE, request.param)


@pytest.fixture(scope="module")
def images(vlm_dir: Path) -> ImageInput:
    from mlxcel_compat.vision.model import vision_facts

    return ImageInput(vision_facts(vlm_dir, json.loads((vlm_dir / "config.json").read_text())), MediaLimits())


def png(seed: int, size: tuple[int, int] = (56, 40)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def raw_base64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


class Prompts:
    """Prompts built as the chat route builds them: text, an image marker, text; images prepared."""

    def __init__(self, harness_tokenizer: Any, images: ImageInput) -> None:
        self.tok = harness_tokenizer
        self.images = images

    def request(self, before: str, seeds: list[int], after: str, n_predict: int = 6, cache: bool = True) -> GenerationRequest:
        marker = list(self.images.facts.marker)  # what the family's chat template writes for an image
        tokens = list(self.tok.encode(before, add_special_tokens=False))
        for seed in seeds:
            tokens += marker + list(self.tok.encode(f" picture {seed}", add_special_tokens=False))
        tokens += list(self.tok.encode(after, add_special_tokens=False))
        tokens, media, digest = self.images.prepare([raw_base64(png(s)) for s in seeds], tokens)
        return GenerationRequest(
            prompt_tokens=tokens, sampling=SamplingParams(temperature=0.0, seed=7), n_predict=n_predict, media=media,
            cache=CacheContext(enabled=cache, session_key="s", template_sig=RAW_PROMPT_TEMPLATE_SIG, mm_digest=digest),
        )


def run(engine: Engine, request: GenerationRequest) -> Run:
    events: queue.Queue = queue.Queue()
    engine.submit(request, events.put)
    return collect(events)


def cold_tokens(engine: Engine, request: GenerationRequest) -> list[int]:
    cold = GenerationRequest(prompt_tokens=request.prompt_tokens, sampling=request.sampling, n_predict=request.n_predict,
                             media=request.media, cache=CacheContext(enabled=False, mm_digest=request.cache.mm_digest))
    return run(engine, cold).tokens


def assert_whole_images(request: GenerationRequest, cached: int) -> None:
    assert request.media is not None and split_ok(cached, request.media.spans), (cached, request.media.spans)


@pytest.fixture(scope="module")
def harness(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    h = disk_tier_harness(vlm_dir, tmp_path_factory.mktemp("vision-disk"))
    yield h
    h.close()


@pytest.fixture()
def prompts(harness: EngineHarness, images: ImageInput) -> Prompts:
    return Prompts(harness.tokenizer, images)


def test_chunked_prefill_with_images_gives_mlx_vlms_own_logits(vlm_dir: Path, images: ImageInput) -> None:
    """The engine's view of the model, fed 5-token chunks, against mlx-vlm's own path (its
    ``get_input_embeddings`` over the whole prompt, then its language model) on the same prompt."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.vision.model import load_vision_directory

    model, tokenizer, _, _ = load_vision_directory(vlm_dir)
    prompts = Prompts(tokenizer, images)
    request = prompts.request("Two pictures:", [1, 2], " Which is which?")
    tokens = request.prompt_tokens
    bound, cache = model.bind(request.media, tokens), make_prompt_cache(model)
    ours = mx.concatenate([bound(mx.array(tokens[i : i + 5])[None], cache=cache) for i in range(0, len(tokens), 5)], axis=1)
    # mlx-vlm's own model, as its loader builds it (Idefics3's text model is swapped for mlx-lm's Llama here)
    from mlx_vlm.utils import load_model

    vlm, ids = load_model(vlm_dir), mx.array(tokens)[None]
    pixels = mx.array(np.concatenate([img.pixel_values for img in request.media.images]))
    extra: dict[str, Any] = {}
    if model.family.mrope:
        extra["image_grid_thw"] = mx.array([list(img.grid_thw) for img in request.media.images])
    if model.facts.row_break >= 0:  # Mistral 3: each image's size in pixels beside them
        patch = model.facts.patch_size
        extra["image_sizes"] = [(img.grid_thw[1] * patch, img.grid_thw[2] * patch) for img in request.media.images]
    features = vlm.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape), **extra)
    # Qwen3-VL's deepstack rows, added to the image tokens' hidden states after the first layers
    deepstack = {k: getattr(features, k) for k in ("visual_pos_masks", "deepstack_visual_embeds")
                 if getattr(features, k, None) is not None}
    language = vlm.language_model
    own_cache = language.make_cache() if hasattr(language, "make_cache") else make_prompt_cache(language)
    theirs = language(ids, inputs_embeds=features.inputs_embeds, cache=own_cache, **extra, **deepstack).logits
    assert float(mx.abs(ours - theirs).max()) < 1e-4
    language = model.vlm.language_model
    text = list(tokenizer.encode("Only words, no picture.", add_special_tokens=False))
    plain = model(mx.array(text)[None], cache=make_prompt_cache(model))
    language_alone = language.model(mx.array(text)[None], cache=make_prompt_cache(model), **(
        {"position_ids": model.family.text_positions(0, len(text))} if model.family.mrope else {}))
    head = getattr(language, "lm_head", None)
    expected = head(language_alone) if head is not None else language.model.embed_tokens.as_linear(language_alone)
    assert float(mx.abs(plain - expected).max()) < 1e-4


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_later_turn_about_the_same_images_adopts_them_whole(harness: EngineHarness, prompts: Prompts, tier: str) -> None:
    harness.reset()
    # (each tier's prompts differ: an entry identical to one a reset dropped is another test's matter)
    first = prompts.request(f"Look at these, {tier}:", [1, 2], " What differs?")
    out = run(harness.engine, first)
    history = first.prompt_tokens + out.tokens
    if tier == "disk":
        harness.on_engine(lambda: harness.engine.prefix_cache.disk.wait_written(30))
        harness.on_engine(lambda: harness.engine.prefix_cache.reset("ram"))
    nxt = prompts.request(f"Look at these, {tier}:", [1, 2], " What differs?")
    nxt.prompt_tokens = history + list(harness.tokenizer.encode(" And the colours?", add_special_tokens=False))
    warm = run(harness.engine, nxt)
    assert warm.finish is not None and warm.finish.n_cached >= len(first.prompt_tokens) > nxt.media.spans[-1][1]
    assert_whole_images(nxt, warm.finish.n_cached)
    assert warm.tokens == cold_tokens(harness.engine, nxt)


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_another_image_adopts_only_the_text_before_it(harness: EngineHarness, prompts: Prompts, tier: str) -> None:
    harness.reset()
    text = f"A long shared instruction about the pictures that follow ({tier}):"
    run(harness.engine, prompts.request(text, [3], " Describe it."))
    if tier == "disk":
        harness.on_engine(lambda: harness.engine.prefix_cache.disk.wait_written(30))
        harness.on_engine(lambda: harness.engine.prefix_cache.reset("ram"))
    other = prompts.request(text, [4], " Describe it.")
    warm = run(harness.engine, other)
    assert warm.finish is not None and warm.finish.n_cached == first_media_token(other.media.spans)
    assert warm.tokens == cold_tokens(harness.engine, other)


def test_the_second_of_two_images_differing_stops_before_it(harness: EngineHarness, prompts: Prompts) -> None:
    harness.reset()
    run(harness.engine, prompts.request("Compare:", [5, 6], " Which is brighter?"))
    other = prompts.request("Compare:", [5, 7], " Which is brighter?")
    warm = run(harness.engine, other)
    # Another digest: only the text before the first image is shared (the text-only bucket).
    assert warm.finish is not None and warm.finish.n_cached == first_media_token(other.media.spans)
    assert warm.tokens == cold_tokens(harness.engine, other)


def test_text_only_requests_run_as_on_a_text_model(harness: EngineHarness) -> None:
    harness.reset()
    prompt = list(harness.tokenizer.encode("Plain text with no picture at all, twice over.", add_special_tokens=False))
    first = harness.run(prompt, n_predict=6)
    again = harness.run(prompt + first.tokens + [11, 12, 13], n_predict=6)
    assert again.finish is not None and again.finish.n_cached >= len(prompt)
    assert again.tokens == harness.run(prompt + first.tokens + [11, 12, 13], n_predict=6, cache=False).tokens


def test_a_slots_kept_state_is_reused_only_for_the_same_images(vlm_dir: Path, images: ImageInput) -> None:
    engine = Engine(EngineConfig(model=str(vlm_dir), ctx_size=4096, n_parallel=1, batch_size=16, keep_slot_state=True))
    engine.start()
    try:
        assert engine.wait_ready(180), engine.load_error
        prompts = Prompts(engine.loaded.tokenizer, images)
        first = prompts.request("Slot test:", [8], " Say something.")
        out = run(engine, first)
        same = prompts.request("Slot test:", [8], " Say something.")
        same.prompt_tokens = first.prompt_tokens + out.tokens + [21, 22]
        warm = run(engine, same)
        assert warm.finish is not None and warm.finish.n_cached >= len(first.prompt_tokens)
        assert_whole_images(same, warm.finish.n_cached)
        assert warm.tokens == cold_tokens(engine, same)
        other = prompts.request("Slot test:", [9], " Say something.")
        assert run(engine, other).finish.n_cached == 0  # type: ignore[union-attr]
    finally:
        engine.stop()


def test_two_slots_with_different_images_at_once_answer_as_each_alone(harness: EngineHarness, prompts: Prompts) -> None:
    """Each sequence's positions and features are its own (mlx-vlm keeps them on the shared model
    object, which this server never relies on): interleaved, each answers as it does alone."""
    harness.reset()
    a = prompts.request("Concurrent one:", [12], " Go on.", n_predict=10, cache=False)
    b = prompts.request("Another prompt, longer, with its own picture:", [13, 14], " Go on.", n_predict=10, cache=False)
    alone = [run(harness.engine, a).tokens, run(harness.engine, b).tokens]
    queues: list[queue.Queue] = [queue.Queue(), queue.Queue()]
    for request, events in zip((a, b), queues):
        request.task_id += 1000  # a fresh task for the same request record
        harness.engine.submit(request, events.put)
    together = [collect(events).tokens for events in queues]
    assert together == alone


def test_families_not_served_are_refused_with_the_list(tmp_path: Path, vlm_dir: Path) -> None:
    from mlxcel_compat.vision.model import load_vision_directory
    from mlxcel_compat.vision.served import SUPPORTED_MODEL_TYPES

    assert set(vision.FAMILIES) <= set(SUPPORTED_MODEL_TYPES)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava_next", "vision_config": {}}))
    with pytest.raises(ValueError, match="vision model type 'llava_next' is not served yet; supported: .*gemma3.*llava.*qwen3_vl"):
        load_vision_directory(tmp_path)
    # A family's directory whose image processor is another family's is refused, naming it.
    other = tmp_path / "mixed"
    other.mkdir()
    config = json.loads((vlm_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config))
    processor = "Gemma3ImageProcessor" if config["model_type"] != "gemma3" else "Qwen2VLImageProcessor"
    (other / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": processor}))
    with pytest.raises(ValueError, match=f"image processor '{processor}' .* is not served for"):
        load_vision_directory(other)


def test_a_tower_whose_rows_differ_from_the_image_tokens_is_refused_at_load(tmp_path: Path) -> None:
    """A LLaVA with a SigLIP tower: mlx-vlm's ``default`` strategy drops its first patch (no class
    token there), one row short of the prompt side's one token per patch; the warm-up refuses it."""
    import mlx.core as mx

    from mlxcel_compat.vision.model import load_vision_directory
    from tests.conftest import MODEL_CACHE

    source = vision.ensure_vision_model(MODEL_CACHE, "llava")
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    config = vision.model_config("llava")
    config["vision_config"]["model_type"] = "siglip_vision_model"
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), vision.random_weights(config), metadata={"format": "mlx"})
    model, _, _, _ = load_vision_directory(tmp_path)
    with pytest.raises(ValueError, match="the vision tower gives 15 feature rows for an image of 16 image tokens"):
        model.warm_up()
