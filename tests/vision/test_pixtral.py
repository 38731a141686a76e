"""Mistral 3 (``vision/pixtral.py``): the factory's tiny directory (mlx-vlm's ``mistral3``: Pixtral's
tower with 2-D RoPE, the 2x2 patch merger, a GELU projector, a Mistral text model; images resized
by PixtralImageProcessor to whole 28-pixel merged patches within a 112-pixel longest edge).

- the prompt side writes an image as PixtralProcessor does (``[IMG]`` per merged patch, a row's
  ``[IMG_BREAK]``, the last one ``[IMG_END]``), for images of several shapes;
- the directory served (5-token chunks, two images of different shapes) gives mlx-vlm's own
  logits on the same pixels (mlx-vlm's batched tower, block-diagonal attention; its merge puts the
  features on the ``[IMG]`` tokens only, the break tokens keep their embeddings)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlxcel_compat.testing import vision


def _png(seed: int, size: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _cache() -> Path:
    from tests.conftest import MODEL_CACHE

    return MODEL_CACHE


@pytest.fixture(scope="module")
def directory() -> Path:
    return vision.ensure_vision_model(_cache(), "mistral3")


@pytest.fixture(scope="module")
def loaded(directory: Path) -> Any:
    from mlxcel_compat.model.loader import load_model

    return load_model(str(directory), [])


@pytest.mark.parametrize("size, merged", [((112, 84), (3, 4)), ((30, 100), (4, 2)),
                                          pytest.param((56, 56), (2, 2), marks=pytest.mark.slow),
                                          pytest.param((300, 20), (1, 4), marks=pytest.mark.slow)])
def test_an_image_is_written_as_pixtral_processor_writes_it(directory: Path, size: tuple[int, int],
                                                              merged: tuple[int, int]) -> None:
    """The expansion of one ``[IMG]`` against PixtralProcessor's rule (``replace_image_token``: its
    module needs torchvision, not installed here, so the rule is spelled out) on the sizes
    Hugging Face's PixtralImageProcessor gives the image at 28-pixel merged patches, as
    PixtralProcessor calls it for Mistral Small 3.1 (``patch_size`` 14, ``spatial_merge_size`` 2)."""
    from transformers import AutoTokenizer
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from mlxcel_compat.server.media import ImageInput, MediaLimits
    from mlxcel_compat.vision.model import vision_facts

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    facts = vision_facts(directory, json.loads((directory / "config.json").read_text()))
    image = Image.open(io.BytesIO(_png(3, size))).convert("RGB")
    expected = PixtralImageProcessorPil.from_pretrained(str(directory))(
        images=[image], patch_size={"height": 28, "width": 28}, return_tensors="np")
    height, width = (int(x) for x in np.asarray(expected["image_sizes"]).reshape(-1))
    assert (height // 28, width // 28) == merged
    rows = [["[IMG]"] * (width // 28) + ["[IMG_BREAK]"] for _ in range(height // 28)]
    text = [t for row in rows for t in row]
    text[-1] = "[IMG_END]"
    prompt = [int(t) for t in tokenizer.encode("a[IMG]b", add_special_tokens=False)]
    tokens, media, _ = ImageInput(facts, MediaLimits()).prepare([base64.b64encode(_png(3, size)).decode()], prompt)
    assert tokens == [int(t) for t in tokenizer.encode("a" + "".join(text) + "b", add_special_tokens=False)]
    assert np.array_equal(media.images[0].pixel_values, expected["pixel_values"])
    assert tokens[media.images[0].span[1] - 1] == facts.image_end


def test_the_directory_gives_mlx_vlms_own_logits(directory: Path, loaded: Any) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model

    from mlxcel_compat.server.media import ImageInput, MediaLimits

    model, tokenizer = loaded.model, loaded.tokenizer
    marker = list(model.facts.marker)
    text = [list(tokenizer.encode(t, add_special_tokens=False)) for t in ("Two:", " and", " ok?")]
    encoded = [base64.b64encode(_png(1, (112, 56))).decode(), base64.b64encode(_png(2, (40, 90))).decode()]
    tokens, media, _ = ImageInput(model.facts, MediaLimits()).prepare(encoded, text[0] + marker + text[1] + marker + text[2])
    assert [img.grid_thw for img in media.images] == [(1, 4, 8), (1, 8, 4)]  # 112x56 and 56x112 (40x90 resized)
    assert tokens.count(model.facts.image_token_id) == 8 + 8 and tokens.count(model.facts.row_break) == 1 + 3
    bound, cache = model.bind(media, tokens), model.make_cache()
    ours = mx.concatenate([bound(mx.array(tokens[i : i + 5])[None], cache=cache) for i in range(0, len(tokens), 5)], axis=1)

    reference, ids = load_model(directory), mx.array(tokens)[None]
    # mlx-vlm's batch: both images padded to the largest size, their true sizes beside them
    pixels = np.zeros((2, 3, 112, 112), np.float32)
    for row, img in zip(pixels, media.images):
        row[:, : img.pixel_values.shape[2], : img.pixel_values.shape[3]] = img.pixel_values[0]
    sizes = [(img.grid_thw[1] * 14, img.grid_thw[2] * 14) for img in media.images]
    embeds = reference.get_input_embeddings(ids, mx.array(pixels), image_sizes=sizes).inputs_embeds
    theirs = reference.language_model(ids, inputs_embeds=embeds, cache=make_prompt_cache(reference.language_model)).logits
    assert float(mx.abs(ours - theirs).max()) < 1e-4


# ----- the GGUF pair: mistral3 text, pixtral projector (with the patch merger) -----


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path, Any]:
    from mlxcel_compat.model.loader import load_model

    text, mmproj = vision.ensure_vision_gguf(_cache(), "mistral3")
    return text, mmproj, load_model(str(text), [], mmproj=str(mmproj))


def test_the_pairs_tower_is_the_directorys_weights(directory: Path, pair: tuple[Path, Path, Any]) -> None:
    """Bit for bit, though the file holds the converter's permuted ``q_proj``/``k_proj`` rows
    (undone at load) and PyTorch's convolution layout; the text model is the GGUF's, whole."""
    from mlx.utils import tree_flatten

    from mlxcel_compat.model.mmproj import read_projector

    _, mmproj, loaded = pair
    ours = {k: v for k, v in tree_flatten(loaded.model.vlm.parameters()) if not k.startswith("language_model.")}
    theirs = {k: v for k, v in mx.load(str(directory / "model.safetensors")).items() if not k.startswith("language_model.")}
    assert ours.keys() == theirs.keys() and "multi_modal_projector.patch_merger.merging_layer.weight" in ours
    for name, value in theirs.items():
        assert ours[name].shape == value.shape and bool(mx.array_equal(ours[name], value)), name
    stored = read_projector(mmproj).read("v.blk.0.attn_q.weight")
    assert not np.array_equal(stored, np.asarray(theirs["vision_tower.vision_model.transformer.layers.0.attention.q_proj.weight"]))
    assert type(loaded.model.vlm.language_model).__module__ == "mlx_lm.models.ministral3"
    assert loaded.vision.model_type == "mistral3" and loaded.vision.processor_config["max_tokens"] == 1024


def test_a_prompt_with_images_gives_the_directorys_logits(loaded: Any, pair: tuple[Path, Path, Any]) -> None:
    from mlxcel_compat.server.media import ImageInput, MediaLimits

    runs = []
    for served in (loaded, pair[2]):
        model, tokenizer = served.model, served.tokenizer
        marker = list(model.facts.marker)
        text = [list(tokenizer.encode(t, add_special_tokens=False)) for t in ("Two:", " and", " ok?")]
        encoded = [base64.b64encode(_png(1, (112, 56))).decode(), base64.b64encode(_png(2, (84, 84))).decode()]
        tokens, media, _ = ImageInput(model.facts, MediaLimits()).prepare(encoded, text[0] + marker + text[1] + marker + text[2])
        bound, cache = model.bind(media, tokens), model.make_cache()
        runs.append((tokens, mx.concatenate([bound(mx.array(tokens[i : i + 7])[None], cache=cache)
                                             for i in range(0, len(tokens), 7)], axis=1)))
    (tokens, directory_logits), (pair_tokens, pair_logits) = runs
    assert pair_tokens == tokens  # the same [IMG] rows, breaks and end from the GGUF's vocabulary and metadata
    assert float(mx.abs(pair_logits - directory_logits).max()) < 1e-4


def test_a_pixtral_projector_without_a_patch_merger_is_refused(pair: tuple[Path, Path, Any]) -> None:
    from mlxcel_compat.model.mmproj import read_projector
    from mlxcel_compat.vision.served import projector_kind

    projector = read_projector(pair[1])
    kind = projector_kind(projector)
    assert type(kind).__name__ == "PixtralProjector"
    pixtral_12b = type(projector)(projector.path, {k: v for k, v in projector.metadata.items()
                                                   if k != "clip.vision.spatial_merge_size"},
                                  projector.names, projector.read)
    with pytest.raises(ValueError, match="without a patch merger"):
        kind.vlm_config(pixtral_12b, {"vocab_size": 8}, {"[IMG]": 1})


@pytest.mark.parametrize("size, limits, grid", [
    ((100, 70), (8, 1024), (3, 4)),     # sides rounded to the nearest merged patch (2.5 -> 3: C's round)
    ((2000, 1000), (8, 1024), (22, 45)),  # over 1024: scaled by sqrt(area / max), sides rounded down
    ((20, 20), (8, 1024), (3, 3)),       # under 8: scaled up, sides rounded up
    ((320, 240), (8, 16), (3, 4)),       # --image-max-tokens 16
])
def test_a_pairs_images_are_sized_as_mtmd_sizes_them(pair: tuple[Path, Path, Any], size: tuple[int, int],
                                                     limits: tuple[int, int], grid: tuple[int, int]) -> None:
    """The pair's processor (``vision/pixtral_mtmd.py``): llama.cpp's ``calc_size_preserved_ratio``
    for pixtral (clip.cpp's 8..1024 merged patches, or the flags'), not the directory's longest edge."""
    from mlxcel_compat.server.media import ImageInput, MediaLimits
    from mlxcel_compat.vision.served import projector_kind
    from mlxcel_compat.model.mmproj import read_projector

    facts = pair[2].vision
    projector = read_projector(pair[1])
    processor = projector_kind(projector).processor(projector, *(0 if x in (8, 1024) else x for x in limits))
    assert (processor.config["min_tokens"], processor.config["max_tokens"]) == limits
    images = ImageInput(type(facts)(**{**facts.__dict__, "processor_config": processor.config}), MediaLimits())
    _, media, _ = images.prepare([base64.b64encode(_png(4, size)).decode()], list(facts.marker))
    assert media.images[0].grid_thw == (1, 2 * grid[0], 2 * grid[1])
