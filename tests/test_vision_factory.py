"""The tiny Qwen2.5-VL and Qwen2-VL factory directories (``testing/vision.py``): deterministic bytes, loadable by
mlx-vlm, its vision tokens single ids, its template rendering image parts, its real image
processor bounded by the configured pixel budget."""

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


def test_mlx_vlm_loads_it_and_the_tokenizer_knows_the_vision_tokens(vlm_dir: Path) -> None:
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load_model

    model = load_model(vlm_dir)
    assert type(model).__module__.startswith(f"mlx_vlm.models.{vlm_dir.name.split('-')[0]}")
    tokenizer = load_tokenizer(vlm_dir)
    ids = tokenizer.encode("<|vision_start|><|image_pad|><|vision_end|>")
    assert ids == [vision.vision_token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    config = json.loads((vlm_dir / "config.json").read_text())
    assert config["image_token_id"] == vision.vision_token_id("<|image_pad|>") < config["vocab_size"]


def test_the_template_renders_image_parts_and_still_refuses_unknown_ones(vlm_dir: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(vlm_dir)
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "look<|vision_start|><|image_pad|><|vision_end|><|im_end|>" in text
    with pytest.raises(Exception, match="Unsupported content part type: sound"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "sound"}]}], tokenize=False)


def test_the_image_processor_keeps_images_within_max_pixels(vlm_dir: Path) -> None:
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(vlm_dir)
    big = Image.fromarray(np.zeros((900, 1200, 3), np.uint8))
    out = processor(images=[big], return_tensors="np")
    t, h, w = (int(x) for x in out["image_grid_thw"][0])
    assert t == 1 and h * w * 14 * 14 <= vision.MAX_PIXELS
    assert out["pixel_values"].shape == (h * w, 3 * 2 * 14 * 14)
