"""LFM2-VL (``vision/lfm2vl.py``, ``vision/lfm2vl_images.py``): the factory's tiny directory
(mlx-vlm's ``lfm2_vl``: a SigLIP2 NaFlex tower, pixel unshuffle and projector, an LFM2 text model
of convolution and attention layers).

- images are cut and written as Hugging Face's LFM2-VL processor cuts and writes them (its
  ``Lfm2VlProcessor`` builds the same marker string; its torchvision image processor gives the same
  patches where torchvision is installed);
- the directory served (5-token chunks, a one-view image and a tiled one) gives mlx-vlm's own
  logits on the same pixels, and text alone gives LFM2's;
- the prompt cache keeps the hybrid's whole state (session snapshots): a second turn about the same
  image restores the first turn's state (or its prompt's, when the reply is rendered as other
  tokens), images included, and answers as a cold run; another image restores nothing of it;
- requests without images run on the CPU decode runtime (its text model is mlx-lm's LFM2), with
  images in MLX's pass."""

from __future__ import annotations

import base64
import io
import queue
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlxcel_compat.testing import vision, vision_configs


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def _encoded(seed: int, size: tuple[int, int]) -> str:
    out = io.BytesIO()
    _image(seed, size).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def directory() -> Path:
    from tests.conftest import MODEL_CACHE

    return vision.ensure_vision_model(MODEL_CACHE, "lfm2_vl")


@pytest.fixture(scope="module")
def loaded(directory: Path) -> Any:
    from mlxcel_compat.model.loader import load_model

    return load_model(str(directory), [])


def _prepare(model: Any, tokenizer: Any, images: list[str], texts: tuple[str, ...]) -> tuple[list[int], Any, bytes]:
    """``texts[0] <image> texts[1] <image> ...`` as the chat route builds it, images prepared."""
    from mlxcel_compat.server.media import ImageInput, MediaLimits

    tokens: list[int] = []
    for i, text in enumerate(texts):
        tokens += [*([] if i == 0 else list(model.facts.marker)), *tokenizer.encode(text, add_special_tokens=False)]
    return ImageInput(model.facts, MediaLimits()).prepare(images, tokens)


# 80x60: one 64x64 view (4 tokens); 240x120: over 128x128 pixels, so 1x2 tiles of 64 and a 64x128 thumbnail (8 tokens)
SIZES = [(80, 60), (240, 120)]


def test_images_are_written_as_lfm2vlprocessor_writes_them(loaded: Any) -> None:
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    model, tokenizer = loaded.model, loaded.tokenizer
    tokens, media, _ = _prepare(model, tokenizer, [_encoded(1, s) for s in SIZES], ("Two:", " and", " ok?"))
    assert [img.spatial_shapes for img in media.images] == [((4, 4),), ((4, 4), (4, 4), (4, 8))]
    # Hugging Face's own string for each image (its processor's method, on its token names)
    names = SimpleNamespace(image_start_token="<|image_start|>", image_end_token="<|image_end|>",
                            image_thumbnail_token="<|img_thumbnail|>", image_token="<image>")
    expected = [Lfm2VlProcessor._build_image_tokens(names, 1, 1, 4, 4, True, True),
                Lfm2VlProcessor._build_image_tokens(names, 1, 2, 4, 8, True, True)]
    for image, text in zip(media.images, expected):
        start, end = image.span
        assert tokenizer.decode(tokens[start:end]) == text
    assert tokenizer.decode(tokens) == f"Two:{expected[0]} and{expected[1]} ok?"
    big = model.facts.layout.tokens(model.facts.image_token_id, 4 * 4 + 8, (1, 2, 2))  # 2x2 tiles, an 8-token thumbnail
    assert tokenizer.decode(big) == Lfm2VlProcessor._build_image_tokens(names, 2, 2, 4, 8, True, True)


def test_the_processor_cuts_tiles_as_the_configuration_says() -> None:
    from mlxcel_compat.vision.lfm2vl_images import Lfm2VlImageProcessorPil

    processor = Lfm2VlImageProcessorPil(**vision.preprocessor_config("lfm2_vl"))
    out = processor(images=[_image(3, (600, 180))])  # wide: 3x1 tiles of 64 (the grid nearest 10:3) and a thumbnail
    assert out["image_rows"].tolist() == [1] and out["image_cols"].tolist() == [3]
    assert out["spatial_shapes"].tolist()[:3] == [[4, 4]] * 3
    thumb_h, thumb_w = out["image_sizes"][0]
    assert thumb_h * thumb_w <= vision_configs.LFM2VL_MAX_IMAGE_TOKENS * 32 * 32 and out["spatial_shapes"][3].tolist() == [thumb_h // 16, thumb_w // 16]
    assert out["pixel_values"].shape == (4, vision_configs.LFM2VL_MAX_IMAGE_TOKENS * 4, 16 * 16 * 3)
    assert out["pixel_attention_mask"].sum(axis=1).tolist() == [16, 16, 16, (thumb_h // 16) * (thumb_w // 16)]
    small = processor(images=[_image(4, (9, 7))])  # raised to the minimum of 2 tokens, one view
    assert small["image_rows"].tolist() == [1] and int(small["pixel_attention_mask"].sum()) >= 2 * 4


def test_the_processor_gives_hugging_faces_patches() -> None:
    """Against Hugging Face's own ``Lfm2VlImageProcessor`` (torchvision's resize; Pillow's here)."""
    pytest.importorskip("torchvision", reason="Hugging Face's Lfm2VlImageProcessor needs torchvision")
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    from mlxcel_compat.vision.lfm2vl_images import Lfm2VlImageProcessorPil

    config = {k: v for k, v in vision.preprocessor_config("lfm2_vl").items() if not k.endswith(("_type", "_class"))}
    theirs, ours = Lfm2VlImageProcessor(**config), Lfm2VlImageProcessorPil(**config)
    for size in [(80, 60), (240, 120), (120, 240), (600, 180), (9, 7), (128, 128), (400, 400)]:
        image = _image(sum(size), size)
        hf, own = theirs(images=[image], return_tensors="np", return_row_col_info=True), ours(images=[image])
        for key in ("pixel_attention_mask", "spatial_shapes", "image_rows", "image_cols", "image_sizes"):
            assert np.array_equal(np.asarray(hf[key]).reshape(-1), np.asarray(own[key]).reshape(-1)), (size, key)
        # resampling: Pillow's and torchvision's antialiased filters round apart by a level or two of 255
        assert float(np.abs(np.asarray(hf["pixel_values"]) - own["pixel_values"]).max()) <= 3 / 255 / 0.5, size


def _chunked(model: Any, media: Any, tokens: list[int], step: int = 5) -> mx.array:
    bound, cache = model.bind(media, tokens), model.make_cache()
    return mx.concatenate([bound(mx.array(tokens[i : i + step])[None], cache=cache)
                           for i in range(0, len(tokens), step)], axis=1)


def test_the_directory_gives_mlx_vlms_own_logits(loaded: Any, directory: Path) -> None:
    from mlx_vlm.utils import load_model

    model, tokenizer = loaded.model, loaded.tokenizer
    assert [type(c).__name__ for c in model.make_cache()] == ["ArraysCache", "KVCache"] * 2  # convolution state, KV
    tokens, media, _ = _prepare(model, tokenizer, [_encoded(1, s) for s in SIZES], ("Two:", " and", " ok?"))
    ours = _chunked(model, media, tokens)
    reference, ids = load_model(directory), mx.array(tokens)[None]
    pixels = np.concatenate([img.pixel_values for img in media.images])
    shapes = np.asarray([s for img in media.images for s in img.spatial_shapes])
    mask = (np.arange(pixels.shape[1])[None] < (shapes[:, 0] * shapes[:, 1])[:, None]).astype(np.int32)
    embeds = reference.get_input_embeddings(ids, mx.array(pixels), spatial_shapes=mx.array(shapes),
                                            pixel_attention_mask=mx.array(mask)).inputs_embeds
    language = reference.language_model
    theirs = language(ids, inputs_embeds=embeds, cache=language.make_cache()).logits
    assert float(mx.abs(ours - theirs).max()) < 1e-4
    text = list(tokenizer.encode("Only words, no picture.", add_special_tokens=False))
    alone = language(mx.array(text)[None], cache=language.make_cache()).logits
    assert float(mx.abs(model(mx.array(text)[None], cache=model.make_cache()) - alone).max()) < 1e-4


@pytest.fixture(scope="module")
def harness(directory: Path):
    from tests.engine.harness import EngineHarness

    h = EngineHarness(directory, batch_size=16, n_parallel=1, min_prefix=4)
    yield h
    h.close()


def _request(loaded: Any, tokens: list[int], media: Any, digest: bytes, cache: bool = True) -> Any:
    from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG
    from mlxcel_compat.engine.request import CacheContext, GenerationRequest
    from mlxcel_compat.engine.sampling.params import SamplingParams

    return GenerationRequest(prompt_tokens=tokens, sampling=SamplingParams(temperature=0.0, seed=7), n_predict=6,
                             media=media, cache=CacheContext(enabled=cache, session_key="s",
                                                             template_sig=RAW_PROMPT_TEMPLATE_SIG, mm_digest=digest))


def _run(harness: Any, request: Any) -> Any:
    from tests.engine.harness import collect

    events: queue.Queue = queue.Queue()
    harness.engine.submit(request, events.put)
    return collect(events)


def test_a_second_turn_about_the_same_image_restores_the_first(harness: Any, loaded: Any) -> None:
    harness.reset()
    model, tokenizer = loaded.model, loaded.tokenizer
    assert harness.stats()["snapshot_family"]  # the hybrid's state is kept whole, never cut
    tokens, media, digest = _prepare(model, tokenizer, [_encoded(5, (240, 120))], ("Look:", " what is it?"))
    first = _run(harness, _request(loaded, tokens, media, digest))
    more = tokens + first.tokens + list(tokenizer.encode(" And its colour?", add_special_tokens=False))
    _, media_again, digest_again = _prepare(model, tokenizer, [_encoded(5, (240, 120))], ("Look:", " what is it?"))
    assert digest_again == digest
    warm = _run(harness, _request(loaded, more, media_again, digest))
    assert warm.finish is not None and warm.finish.n_cached >= len(tokens) > media.spans[-1][1]
    cold = _run(harness, _request(loaded, more, media_again, digest, cache=False))
    assert cold.finish.n_cached == 0 and warm.tokens == cold.tokens
    # a chat's next turn renders the reply as text, whose tokens need not be the generated ones: the
    # prompt's own snapshot (all but its last token) is restored then, the image with it
    harness.reset()
    _run(harness, _request(loaded, tokens, media, digest))
    rendered = tokens + list(tokenizer.encode(" a reply, rendered. And its colour?", add_special_tokens=False))
    again = _run(harness, _request(loaded, rendered, media_again, digest))
    assert again.finish is not None and again.finish.n_cached == len(tokens) - 1
    assert again.tokens == _run(harness, _request(loaded, rendered, media_again, digest, cache=False)).tokens
    # another image with the same words: the state holds the other image, so nothing is restored
    _, other, other_digest = _prepare(model, tokenizer, [_encoded(6, (240, 120))], ("Look:", " what is it?"))
    assert other_digest != digest
    miss = _run(harness, _request(loaded, more, other, other_digest))
    assert miss.finish is not None and miss.finish.n_cached == 0
    assert miss.tokens == _run(harness, _request(loaded, more, other, other_digest, cache=False)).tokens


def test_requests_without_images_run_on_the_cpu_decode_runtime(harness: Any, loaded: Any) -> None:
    """The text model is mlx-lm's LFM2 (``VisionFamily.text_model``): a request without images runs
    on the CPU decode runtime (runtime/decode_conv.py), its greedy tokens those of MLX's own text
    model; a request with images stays in MLX's pass (the runtime takes token ids, not features)."""
    harness.reset()
    decoder = harness.engine.loaded.decoder
    assert decoder is not None
    language, tokenizer = harness.engine.loaded.model.vlm.language_model, loaded.tokenizer
    text = list(tokenizer.encode("Only words, no picture.", add_special_tokens=False))
    steps, chunks = decoder.steps, decoder.prefilled
    run = _run(harness, _request(loaded, text, None, b"", cache=False))
    assert decoder.steps > steps and decoder.prefilled > chunks
    cache, expected = language.make_cache(), []
    logits = language(mx.array(text)[None], cache=cache)[0, -1]
    for _ in range(len(run.tokens)):
        expected.append(int(logits.argmax()))
        logits = language(mx.array([[expected[-1]]]), cache=cache)[0, -1]
    assert run.tokens == expected
    tokens, media, digest = _prepare(loaded.model, tokenizer, [_encoded(5, (240, 120))], ("Look:", " what is it?"))
    steps, chunks = decoder.steps, decoder.prefilled
    assert _run(harness, _request(loaded, tokens, media, digest, cache=False)).finish is not None
    assert (decoder.steps, decoder.prefilled) == (steps, chunks)


@pytest.fixture(scope="module")
def pair(directory: Path) -> Any:
    """The factory's GGUF pair (``lfm2`` text, ``lfm2`` projector), loaded as the server loads it."""
    from mlxcel_compat.model.loader import load_model
    from tests.conftest import MODEL_CACHE

    text, mmproj = vision.ensure_vision_gguf(MODEL_CACHE, "lfm2_vl")
    return SimpleNamespace(text=text, mmproj=mmproj, loaded=load_model(str(text), [], mmproj=str(mmproj)))


def test_the_pairs_tower_is_the_directorys_and_gives_its_logits(pair: Any, loaded: Any, directory: Path) -> None:
    from mlx.utils import tree_flatten

    gguf = pair.loaded.model
    ours = {k: v for k, v in tree_flatten(gguf.vlm.parameters()) if not k.startswith("language_model.")}
    theirs = {k: v for k, v in mx.load(str(directory / "model.safetensors")).items() if not k.startswith("language_model.")}
    assert ours.keys() == theirs.keys() and "vision_tower.embeddings.position_embedding.weight" in ours
    for name, value in theirs.items():
        assert bool(mx.array_equal(ours[name], value)), name
    tokens, media, _ = _prepare(loaded.model, loaded.tokenizer, [_encoded(1, s) for s in SIZES], ("Two:", " and", " ok?"))
    assert float(mx.abs(_chunked(gguf, media, tokens, step=7) - _chunked(loaded.model, media, tokens)).max()) < 1e-4


def test_the_pair_prepares_images_as_llama_cpps_mtmd(pair: Any) -> None:
    """mtmd's fixed LFM2 settings, not the directory's: 64 to 256 tokens a view, 512-pixel tiles."""
    model, tokenizer = pair.loaded.model, pair.loaded.tokenizer
    tokens, media, _ = _prepare(model, tokenizer, [_encoded(7, (80, 60)), _encoded(8, (1100, 500))], ("A:", " B:", ""))
    small, tiled = media.images
    assert small.spatial_shapes == ((14, 20),)  # raised to 64 tokens: 224x320 pixels, 7x10 tokens
    assert tiled.spatial_shapes == ((32, 32),) * 2 + ((20, 46),)  # 2x1 tiles of 512 and a 320x736 thumbnail
    assert tokens.count(model.facts.image_token_id) == 70 + 2 * 256 + 230
    assert "<|img_row_1_col_2|><image>" in tokenizer.decode(tokens[tiled.span[0]:tiled.span[1]])


def test_the_text_gguf_alone_serves_text_as_the_pair_does(pair: Any) -> None:
    from mlxcel_compat.gguf.load import load_gguf

    model, _, config, summary = load_gguf(str(pair.text))
    assert summary.architecture == "lfm2"
    prompt = mx.array([[5, 6, 7, 8, 9, 10, 11] * 3])
    paired = pair.loaded.model(prompt, cache=pair.loaded.model.make_cache())
    assert float(mx.abs(model(prompt) - paired).max()) < 1e-4


def test_an_unknown_projector_types_refusal_names_lfm2(pair: Any) -> None:
    from mlxcel_compat.model.mmproj import read_projector
    from mlxcel_compat.vision.served import projector_kind

    projector = read_projector(pair.mmproj)
    assert type(projector_kind(projector)).__name__ == "Lfm2VlProjector"
    other = type(projector)(projector.path, {**projector.metadata, "clip.projector_type": "lfm2a"},
                            projector.names, projector.read)
    with pytest.raises(ValueError, match="projector type 'lfm2a' .* is not served; served: .*lfm2"):
        projector_kind(other)
