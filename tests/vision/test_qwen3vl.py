"""Qwen3-VL (``vision/qwen3vl.py``): the factory's tiny directory (mlx-vlm's ``qwen3_vl``: learned
position embeddings interpolated to the grid, two deepstack mergers, a Qwen3 text model with
interleaved M-RoPE) and its GGUF pair (``qwen3vl`` text, ``qwen3vl_merger`` projector).

- the directory served (5-token chunks, two images of other shapes than the position table's)
  gives mlx-vlm's own logits, deepstack included (and the deepstack rows change them: they are
  not silently dropped);
- the pair's tower weights are the directory's bit for bit, and a prompt with an image gives the
  directory's logits, chunked; the text GGUF alone serves text as the pair does;
- an unknown projector type's refusal names ``qwen3vl_merger`` among the served ones, and a
  projector whose deepstack mergers are not the text GGUF's count is refused.
The comparison with llama-server's own mtmd on the converter's pair is ``scripts/check_mmproj.py
--families qwen3_vl`` (docs/vision.md)."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from PIL import Image

from mlxcel_compat.testing import vision


def _encoded(seed: int, size: tuple[int, int]) -> str:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def loaded() -> dict[str, Any]:
    """The directory and the F32 pair, each loaded as the server loads it."""
    from mlxcel_compat.model.loader import load_model
    from tests.conftest import MODEL_CACHE

    directory = vision.ensure_vision_model(MODEL_CACHE, "qwen3_vl")
    text, mmproj = vision.ensure_vision_gguf(MODEL_CACHE, "qwen3_vl")
    return {"directory": directory, "text": text, "hf": load_model(str(directory), []),
            "gguf": load_model(str(text), [], mmproj=str(mmproj))}


def _prompt(model: Any, tokenizer: Any) -> tuple[list[int], Any]:
    """Two images (6x8 and 10x4 patches, 12 and 10 tokens; the position table is 4x4) in a prompt."""
    from mlxcel_compat.server.media import ImageInput, MediaLimits

    images = ImageInput(model.facts, MediaLimits())
    marker = list(model.facts.marker)
    text = [list(tokenizer.encode(t, add_special_tokens=False)) for t in ("Two:", " and", " ok?")]
    tokens, media, _ = images.prepare([_encoded(1, (190, 130)), _encoded(2, (128, 256))],
                                      text[0] + marker + text[1] + marker + text[2])
    assert [img.grid_thw for img in media.images] == [(1, 6, 8), (1, 10, 4)]
    return tokens, media


def _chunked(model: Any, media: Any, tokens: list[int], step: int = 5) -> mx.array:
    bound, cache = model.bind(media, tokens), model.make_cache()
    return mx.concatenate([bound(mx.array(tokens[i : i + step])[None], cache=cache)
                           for i in range(0, len(tokens), step)], axis=1)


def test_the_directory_gives_mlx_vlms_own_logits_deepstack_included(loaded: dict[str, Any]) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model

    hf = loaded["hf"]
    tokens, media = _prompt(hf.model, hf.tokenizer)
    ours = _chunked(hf.model, media, tokens)
    reference, ids = load_model(loaded["directory"]), mx.array(tokens)[None]
    pixels = mx.array(np.concatenate([img.pixel_values for img in media.images]))
    grid = mx.array([list(img.grid_thw) for img in media.images])
    features = reference.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape), image_grid_thw=grid)
    language = reference.language_model

    def logits(**deepstack: Any) -> mx.array:
        return language(ids, inputs_embeds=features.inputs_embeds, cache=make_prompt_cache(language),
                        image_grid_thw=grid, **deepstack).logits

    theirs = logits(visual_pos_masks=features.visual_pos_masks, deepstack_visual_embeds=features.deepstack_visual_embeds)
    assert len(features.deepstack_visual_embeds) == 2
    assert float(mx.abs(ours - theirs).max()) < 1e-4
    assert float(mx.abs(logits() - theirs).max()) > 0.1  # the deepstack rows matter


def test_the_pairs_tower_is_the_directorys_weights(loaded: dict[str, Any]) -> None:
    gguf = loaded["gguf"]
    ours = {k: v for k, v in tree_flatten(gguf.model.vlm.parameters()) if not k.startswith("language_model.")}
    theirs = {k: v for k, v in mx.load(str(loaded["directory"] / "model.safetensors")).items()
              if not k.startswith("language_model.")}
    assert ours.keys() == theirs.keys() and any(".deepstack_merger_list.1." in k for k in ours)
    for name, value in theirs.items():
        assert ours[name].shape == value.shape and bool(mx.array_equal(ours[name], value)), name
    assert gguf.vision.model_type == "qwen3_vl" and gguf.vision.merge_size == 2
    assert gguf.vision.processor_config["patch_size"] == 16  # from the projector's metadata


def test_a_prompt_with_images_gives_the_directorys_logits(loaded: dict[str, Any]) -> None:
    gguf, hf = loaded["gguf"], loaded["hf"]
    tokens, media = _prompt(hf.model, hf.tokenizer)
    assert gguf.tokenizer.encode("Two:", add_special_tokens=False) == hf.tokenizer.encode("Two:", add_special_tokens=False)
    pair, directory = _chunked(gguf.model, media, tokens, step=7), _chunked(hf.model, media, tokens)
    assert float(mx.abs(pair - directory).max()) < 1e-4


def test_the_text_gguf_alone_serves_text_as_the_pair_does(loaded: dict[str, Any]) -> None:
    """``qwen3vl`` alone is mlx-lm's qwen3 (plain RoPE: interleaved M-RoPE with one position per
    token on its three axes); its sections and deepstack count are kept for a projector."""
    from mlxcel_compat.gguf.load import load_gguf

    model, _, config, summary = load_gguf(str(loaded["text"]))
    assert summary.architecture == "qwen3vl" and config["model_type"] == "qwen3"
    assert config["mrope_section"] == [6, 5, 5] and config["n_deepstack_layers"] == 2
    prompt = mx.array([[5, 6, 7, 8, 9, 10, 11] * 3])
    paired = loaded["gguf"].model(prompt, cache=loaded["gguf"].model.make_cache())
    assert float(mx.abs(model(prompt) - paired).max()) < 1e-3


def test_an_unknown_projector_types_refusal_names_qwen3vl(tmp_path: Path) -> None:
    from mlxcel_compat.model.mmproj import read_projector
    from mlxcel_compat.vision.served import projector_kind

    _, mmproj = vision.ensure_vision_gguf(_cache(), "qwen3_vl")
    projector = read_projector(mmproj)
    assert type(projector_kind(projector)).__name__ == "Qwen3VLProjector"
    other = type(projector)(projector.path, {**projector.metadata, "clip.projector_type": "llama4"},
                            projector.names, projector.read)
    with pytest.raises(ValueError, match="projector type 'llama4' .* is not served; served: .*qwen3vl_merger"):
        projector_kind(other)


def _cache() -> Path:
    from tests.conftest import MODEL_CACHE

    return MODEL_CACHE


def test_a_projector_whose_deepstack_count_differs_from_the_text_gguf_is_refused(loaded: dict[str, Any]) -> None:
    from mlxcel_compat.model.mmproj import read_projector
    from mlxcel_compat.vision.qwen3vl import Qwen3VLProjector

    _, mmproj = vision.ensure_vision_gguf(_cache(), "qwen3_vl")
    projector = read_projector(mmproj)
    fewer = type(projector)(projector.path, {**projector.metadata, "clip.vision.is_deepstack_layers": [True, False, False]},
                            projector.names, projector.read)
    text = {"mrope_section": [6, 5, 5], "n_deepstack_layers": 2, "vocab_size": 8}
    with pytest.raises(ValueError, match="has 1 deepstack mergers; its text GGUF takes 2"):
        Qwen3VLProjector().vlm_config(fewer, text, {})
