"""The tiny vision-language factory directories (``testing/vision.py``: Qwen2.5-VL, Qwen2-VL, Gemma 3,
LLaVA): deterministic bytes, loadable by mlx-vlm, their vision tokens single ids, their templates
rendering image parts, their real image processors bounded by the configured size."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mlxcel_compat.testing import vision


@pytest.fixture(scope="module", params=vision.FAMILIES)
def vlm_dir(request: pytest.FixtureRequest) -> Path:
    from tests.conftest import MODEL_CACHE

    return vision.ensure_vision_model(MODEL_CACHE, request.param)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_builds_write_the_same_bytes(vlm_dir: Path, tmp_path: Path) -> None:
    other = vision.ensure_vision_model(tmp_path, json.loads((vlm_dir / "config.json").read_text())["model_type"])
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert _sha(other / name) == _sha(vlm_dir / name), name


def family(vlm_dir: Path) -> str:
    return json.loads((vlm_dir / "config.json").read_text())["model_type"]


def test_mlx_vlm_loads_it_and_the_tokenizer_knows_the_vision_tokens(vlm_dir: Path) -> None:
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load_model

    model = load_model(vlm_dir)
    assert type(model).__module__.startswith(f"mlx_vlm.models.{family(vlm_dir)}")
    tokenizer = load_tokenizer(vlm_dir)
    tokens = vision.FAMILY_TOKENS[family(vlm_dir)]
    assert tokenizer.encode("".join(tokens)) == [vision.vision_token_id(t, family(vlm_dir)) for t in tokens]
    config = json.loads((vlm_dir / "config.json").read_text())
    image = config.get("image_token_id", config.get("image_token_index"))
    assert image in [vision.vision_token_id(t, family(vlm_dir)) for t in tokens] and image < config["vocab_size"]


def test_the_template_renders_image_parts_and_still_refuses_unknown_ones(vlm_dir: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(vlm_dir)
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert f"look{vision.TEMPLATE_IMAGE[family(vlm_dir)]}<|im_end|>" in text
    with pytest.raises(Exception, match="Unsupported content part type: sound"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "sound"}]}], tokenize=False)


def test_the_image_processor_keeps_images_within_the_configured_size(vlm_dir: Path) -> None:
    from PIL import Image

    from mlxcel_compat.model.vision import vision_facts
    from mlxcel_compat.server.media import ImageInput, MediaLimits

    facts = vision_facts(vlm_dir, json.loads((vlm_dir / "config.json").read_text()))
    processor = ImageInput(facts, MediaLimits()).processor()
    big = Image.fromarray(np.zeros((900, 1200, 3), np.uint8))
    out = processor(images=[big], return_tensors="np", **facts.processor_kwargs)
    count, (t, h, w) = facts.image_token_count(out)
    if family(vlm_dir).startswith("qwen"):
        assert t == 1 and h * w * 14 * 14 <= vision.MAX_PIXELS and count == h * w // 4
        assert out["pixel_values"].shape == (h * w, 3 * 2 * 14 * 14)
    else:  # a fixed-size image: 4x4 patches of 14 pixels
        assert out["pixel_values"].shape == (1, 3, vision.IMAGE_SIZE, vision.IMAGE_SIZE)
        assert count == (vision.GEMMA_TOKENS_PER_IMAGE if family(vlm_dir) == "gemma3" else 16)
