"""The tiny vision-language factory directories (``testing/vision.py``: Qwen2.5-VL, Qwen2-VL, Qwen3-VL,
Gemma 3, LLaVA, SmolVLM, InternVL, Mistral 3): deterministic bytes, loadable by mlx-vlm, their vision tokens single ids, their templates
rendering image parts, their real image processors bounded by the configured size."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mlxcel_compat.testing import vision, vision_configs


# Mistral 3's row runs with --slow (the suite's budget): tests/vision/test_pixtral.py loads it through mlx-vlm
# and checks its processor's sizes by default.
@pytest.fixture(scope="module", params=[pytest.param(f, marks=[pytest.mark.slow] if f == "mistral3" else [])
                                        for f in vision.FAMILIES])
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

    from mlxcel_compat.vision.model import vision_facts
    from mlxcel_compat.server.media import ImageInput, MediaLimits

    facts = vision_facts(vlm_dir, json.loads((vlm_dir / "config.json").read_text()))
    processor = ImageInput(facts, MediaLimits()).processor()
    big = Image.fromarray(np.zeros((900, 1200, 3), np.uint8))
    out = processor(images=[big], return_tensors="np", **facts.processor_kwargs)
    count, (t, h, w) = facts.image_token_count(out)
    if family(vlm_dir).startswith("qwen"):  # Qwen3-VL: 16-pixel patches, Qwen2-VL and Qwen2.5-VL: 14
        patch, most = (vision_configs.QWEN3_PATCH_SIZE, vision_configs.QWEN3_MAX_PIXELS) if family(vlm_dir) == "qwen3_vl" else (14, vision.MAX_PIXELS)
        assert t == 1 and h * w * patch * patch <= most and count == h * w // 4
        assert out["pixel_values"].shape == (h * w, 3 * 2 * patch * patch)
    elif family(vlm_dir) == "smolvlm":  # 1200x900 -> 112x84 -> 112x112: a 2x2 grid of 56-pixel tiles, and the whole
        assert out["pixel_values"].shape == (1, 5, 3, vision.IMAGE_SIZE, vision.IMAGE_SIZE) and (h, w) == (2, 2)
        assert count == 5 * 4  # 4 tokens a tile; then 2 markers a tile, newline, blank line, 2 + 1 around the whole
        tokens = facts.image_tokens(count, (t, h, w))
        assert tokens.count(facts.image_token_id) == count and len(tokens) == count + 4 * 2 + 1 + 1 + 2 + 1
    elif family(vlm_dir) == "internvl_chat":  # 1200x900: a 2x2 grid of 56-pixel tiles (at most 4), and a thumbnail
        assert out["pixel_values"].shape == (5, 3, vision.IMAGE_SIZE, vision.IMAGE_SIZE) and count == 5 * 4
        assert facts.image_tokens(count, (t, h, w)) == [facts.image_token_id] * count
    elif family(vlm_dir) == "mistral3":  # 1200x900 -> 112x84 (whole 28-pixel merged patches): 4x3 merged, 8x6 patches
        assert out["pixel_values"].shape == (1, 3, 84, 112) and (t, h, w) == (1, 6, 8) and count == 12
        assert len(facts.image_tokens(count, (t, h, w))) == count + 3  # [IMG_BREAK] twice, [IMG_END]
    else:  # a fixed-size image: 4x4 patches of 14 pixels
        assert out["pixel_values"].shape == (1, 3, vision.IMAGE_SIZE, vision.IMAGE_SIZE)
        assert count == (vision.GEMMA_TOKENS_PER_IMAGE if family(vlm_dir) == "gemma3" else 16)


def test_the_small_qwen_is_a_consistent_config_for_benchmarks_and_only_qwen_has_it() -> None:
    """The benchmarks' size (``bench_vision_ttft.py``): its mrope sections cover the head's rotary
    half, and its processor keeps a 448x448 image at 256 merged tokens (the tiny one's: 16). Not
    built here (it takes seconds and ~180 MB); the benchmark builds and serves it."""
    config = vision.model_config("qwen2_5_vl", "small")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert sum(config["rope_scaling"]["mrope_section"]) == head_dim // 2
    assert config["vision_config"]["out_hidden_size"] == config["hidden_size"]
    assert config["vision_config"]["hidden_size"] % config["vision_config"]["num_heads"] == 0
    small, tiny = vision.preprocessor_config("qwen2_5_vl", "small"), vision.preprocessor_config("qwen2_5_vl")
    patch_area = (small["patch_size"] * small["merge_size"]) ** 2
    assert small["max_pixels"] // patch_area == 256 and tiny["max_pixels"] // patch_area == 16
    for family in ("gemma3", "llava", "qwen2_vl"):
        with pytest.raises(ValueError, match="small for qwen2_5_vl"):
            vision.ensure_vision_model("/nonexistent", family, "small")


def test_smolvlm_tiles_give_mlx_vlms_own_logits() -> None:
    """SmolVLM served (its tiles' markers expanded by the prompt side, mlx-lm's Llama as the text
    model, 5-token chunks) against mlx-vlm's own model on the same prompt, two images of 2x2 tiles."""
    import base64
    import io

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model
    from PIL import Image

    from mlxcel_compat.server.media import ImageInput, MediaLimits
    from mlxcel_compat.vision.model import load_vision_directory
    from tests.conftest import MODEL_CACHE

    directory = vision.ensure_vision_model(MODEL_CACHE, "smolvlm")
    model, tokenizer, _, _ = load_vision_directory(directory)
    images = ImageInput(model.facts, MediaLimits())
    encoded = []
    for seed in (1, 2):
        out = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(out, "PNG")
        encoded.append(base64.b64encode(out.getvalue()).decode())
    marker = list(model.facts.marker)
    text = [list(tokenizer.encode(t, add_special_tokens=False)) for t in ("Two:", " and", " ok?")]
    tokens, media, _ = images.prepare(encoded, text[0] + marker + text[1] + marker + text[2])
    assert len(media.images) == 2 and all(img.grid_thw == (1, 2, 2) for img in media.images)
    bound, cache = model.bind(media, tokens), make_prompt_cache(model)
    ours = mx.concatenate([bound(mx.array(tokens[i : i + 5])[None], cache=cache) for i in range(0, len(tokens), 5)], axis=1)
    reference, ids = load_model(directory), mx.array(tokens)[None]
    pixels = mx.array(np.concatenate([img.pixel_values for img in media.images]))
    embeds = reference.get_input_embeddings(ids, pixels).inputs_embeds
    theirs = reference.language_model(ids, inputs_embeds=embeds, cache=make_prompt_cache(reference.language_model)).logits
    assert float(mx.abs(ours - theirs).max()) < 1e-4


@pytest.mark.parametrize("rows, cols", [(0, 0), (1, 2), (2, 2)])
def test_smolvlm_tiles_are_written_as_hugging_faces_processor_writes_them(rows: int, cols: int) -> None:
    """The prompt side's expansion of one image (``TileLayout``) against SmolVLMProcessor's own
    prompt string for the same grid, tokenized by the model's tokenizer."""
    from transformers import AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    from mlxcel_compat.vision.model import vision_facts
    from tests.conftest import MODEL_CACHE

    directory = vision.ensure_vision_model(MODEL_CACHE, "smolvlm")
    facts = vision_facts(directory, json.loads((directory / "config.json").read_text()))
    per_tile = facts.tiles.tokens_per_tile
    text = get_image_prompt_string(rows, cols, per_tile, "<fake_token_around_image>", "<image>", "<global-img>")
    expected = AutoTokenizer.from_pretrained(str(directory)).encode(text, add_special_tokens=False)
    assert facts.image_tokens((rows * cols + 1) * per_tile, (1, rows, cols)) == expected
