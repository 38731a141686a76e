"""InternVL (``vision/internvl.py``): the factory's tiny directory (mlx-vlm's ``internvl_chat``:
InternViT with a class token and layer scales, pixel shuffle, the ``mlp1`` projector, a Qwen2
text model; images cut into up to 4 tiles plus a thumbnail) and its GGUF pair (``qwen2`` text,
``internvl`` projector).

- the directory served (5-token chunks, two images of several tiles each) gives mlx-vlm's own
  logits on the same pixels;
- the pair's tower weights are the directory's bit for bit, and a prompt with an image gives the
  directory's logits, chunked; the text GGUF alone serves text as the pair does;
- an unknown projector type's refusal names ``internvl`` among the served ones.
The comparison with llama-server's own mtmd on the converter's pair is ``scripts/check_mmproj.py
--families internvl_chat`` (docs/vision.md, with llama.cpp's class-token position difference)."""

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

from mlxcel_compat.testing import vision, vision_configs


def _encoded(seed: int, size: tuple[int, int]) -> str:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def _cache() -> Path:
    from tests.conftest import MODEL_CACHE

    return MODEL_CACHE


@pytest.fixture(scope="module")
def loaded() -> dict[str, Any]:
    """The directory and the F32 pair, each loaded as the server loads it."""
    from mlxcel_compat.model.loader import load_model

    directory = vision.ensure_vision_model(_cache(), "internvl_chat")
    text, mmproj = vision.ensure_vision_gguf(_cache(), "internvl_chat")
    return {"directory": directory, "text": text, "hf": load_model(str(directory), []),
            "gguf": load_model(str(text), [], mmproj=str(mmproj))}


def _prompt(model: Any, tokenizer: Any) -> tuple[list[int], Any]:
    """Two images: 120x60 (2x1 tiles and the thumbnail) and 60x120 (1x2 and the thumbnail), 12 tokens each."""
    from mlxcel_compat.server.media import ImageInput, MediaLimits

    images = ImageInput(model.facts, MediaLimits())
    marker = list(model.facts.marker)
    text = [list(tokenizer.encode(t, add_special_tokens=False)) for t in ("Two:", " and", " ok?")]
    tokens, media, _ = images.prepare([_encoded(1, (120, 60)), _encoded(2, (60, 120))],
                                      text[0] + marker + text[1] + marker + text[2])
    assert [img.pixel_values.shape[0] for img in media.images] == [3, 3]
    assert tokens.count(model.facts.image_token_id) == 2 * 3 * 4
    return tokens, media


def _chunked(model: Any, media: Any, tokens: list[int], step: int = 5) -> mx.array:
    bound, cache = model.bind(media, tokens), model.make_cache()
    return mx.concatenate([bound(mx.array(tokens[i : i + step])[None], cache=cache)
                           for i in range(0, len(tokens), step)], axis=1)


def test_the_directory_gives_mlx_vlms_own_logits(loaded: dict[str, Any]) -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model

    hf = loaded["hf"]
    tokens, media = _prompt(hf.model, hf.tokenizer)
    ours = _chunked(hf.model, media, tokens)
    reference, ids = load_model(loaded["directory"]), mx.array(tokens)[None]
    pixels = mx.array(np.concatenate([img.pixel_values for img in media.images]))
    embeds = reference.get_input_embeddings(ids, pixels).inputs_embeds
    language = reference.language_model
    theirs = language(ids, inputs_embeds=embeds, cache=make_prompt_cache(language)).logits
    assert float(mx.abs(ours - theirs).max()) < 1e-4


def test_the_pairs_tower_is_the_directorys_weights(loaded: dict[str, Any]) -> None:
    gguf = loaded["gguf"]
    ours = {k: v for k, v in tree_flatten(gguf.model.vlm.parameters()) if not k.startswith("language_model.")}
    theirs = {k: v for k, v in mx.load(str(loaded["directory"] / "model.safetensors")).items()
              if not k.startswith("language_model.")}
    assert ours.keys() == theirs.keys() and "vision_model.embeddings.class_embedding" in ours
    for name, value in theirs.items():
        assert ours[name].shape == value.shape and bool(mx.array_equal(ours[name], value)), name
    facts = gguf.vision
    assert facts.model_type == "internvl_chat" and facts.tokens_per_tile == 4
    assert facts.processor_config["max_patches"] == vision_configs.INTERNVL_MAX_TILES  # from the projector's metadata


def test_a_prompt_with_images_gives_the_directorys_logits(loaded: dict[str, Any]) -> None:
    gguf, hf = loaded["gguf"], loaded["hf"]
    tokens, media = _prompt(hf.model, hf.tokenizer)
    pair_tokens, _ = _prompt(gguf.model, gguf.tokenizer)
    assert pair_tokens == tokens  # the same tiles and markers from the GGUF's vocabulary and metadata
    pair, directory = _chunked(gguf.model, media, tokens, step=7), _chunked(hf.model, media, tokens)
    assert float(mx.abs(pair - directory).max()) < 1e-4


def test_the_text_gguf_alone_serves_text_as_the_pair_does(loaded: dict[str, Any]) -> None:
    from mlxcel_compat.gguf.load import load_gguf

    model, _, config, summary = load_gguf(str(loaded["text"]))
    assert summary.architecture == "qwen2" and config["model_type"] == "qwen2"
    prompt = mx.array([[5, 6, 7, 8, 9, 10, 11] * 3])
    paired = loaded["gguf"].model(prompt, cache=loaded["gguf"].model.make_cache())
    assert float(mx.abs(model(prompt) - paired).max()) < 1e-3


def test_an_unknown_projector_types_refusal_names_internvl() -> None:
    from mlxcel_compat.model.mmproj import read_projector
    from mlxcel_compat.vision.served import projector_kind

    _, mmproj = vision.ensure_vision_gguf(_cache(), "internvl_chat")
    projector = read_projector(mmproj)
    assert type(projector_kind(projector)).__name__ == "InternVLProjector"
    other = type(projector)(projector.path, {**projector.metadata, "clip.projector_type": "llama4"},
                            projector.names, projector.read)
    with pytest.raises(ValueError, match="projector type 'llama4' .* is not served; served: .*internvl"):
        projector_kind(other)
