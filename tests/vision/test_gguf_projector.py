"""GGUF pairs (``--mmproj``): the factory's tiny Gemma 3, Qwen2.5-VL, SmolVLM and Qwen2-VL (``slow``) written as llama.cpp's
converter writes them (``testing/vision_gguf.py``), loaded back (``model/mmproj.py``,
``vision/gguf_projector.py``, ``vision/gguf_model.py``) and compared with the mlx-vlm directory
they came from: the tower's weights are the directory's, bit for bit (Gemma 3's input projection:
its float16 rounding, as the converter stores it); a prompt with an image gives
the directory model's logits (the text model's layers from the GGUF, the tower from the
projector). A quantized text GGUF keeps its weights in ggml's blocks inside mlx-vlm's model. An
unknown projector type, a file that is not a projector and a projector missing a tensor are
refused with a message that names what is wrong."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxcel_compat.testing import vision
from mlxcel_compat.vision.inputs import MediaImage, MediaInput

PROMPT_TEXT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def model_cache() -> Path:
    from tests.conftest import MODEL_CACHE

    return MODEL_CACHE


# Gemma 3's text GGUF in Q8_0 (its weights stay in ggml's blocks inside mlx-vlm's model), Qwen2.5-VL's
# in F32 (the logits then equal the directory model's to float32 rounding).
PAIRS = [("gemma3", "q8_0"), ("qwen2_5_vl", "f32"), ("qwen2_vl", "f32"), ("smolvlm", "f32")]
SLOW_PAIRS = {("qwen2_vl", "f32")}  # the same merger and text as Qwen2.5-VL's: its own tower only
TOLERANCE = {"f32": 1e-4, "q8_0": 0.3}


@pytest.fixture(scope="module", params=[pytest.param(p, id=f"{p[0]}-{p[1]}",
                                                    marks=[pytest.mark.slow] if p in SLOW_PAIRS else [])
                                       for p in PAIRS])
def pair(request: pytest.FixtureRequest, model_cache: Path):
    """(family, text GGUF type, GGUF-loaded model, directory-loaded model, directory)."""
    from mlxcel_compat.model.loader import load_model

    family, gguf_type = request.param
    directory = vision.ensure_vision_model(model_cache, family)
    text, mmproj = vision.ensure_vision_gguf(model_cache, family, gguf_type=gguf_type)
    assert "mmproj" in mmproj.name and mmproj.parent == text.parent
    return family, gguf_type, load_model(str(text), [], mmproj=str(mmproj)), load_model(str(directory), []), directory


def _image(loaded, seed: int = 0) -> MediaImage:
    """Random pixels of the tower's input shape (a real image's span is set by the caller)."""
    blank = loaded.model.family.blank_image(loaded.model.vlm)
    pixels = np.random.default_rng(seed).standard_normal(blank.pixel_values.shape).astype(np.float32)
    return MediaImage(pixels, blank.grid_thw, blank.span)


def test_the_tower_and_projector_are_the_directory_weights(pair) -> None:
    family, gguf_type, gguf, hf, directory = pair
    ours = {k: v for k, v in tree_flatten(gguf.model.vlm.parameters()) if not k.startswith("language_model.")}
    theirs = {k: v for k, v in mx.load(str(directory / "model.safetensors")).items() if not k.startswith("language_model.")}
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        if family == "gemma3" and "mm_input_projection" in name:  # stored F16, as the converter stores it
            value = value.astype(mx.float16).astype(mx.float32)
        assert ours[name].shape == value.shape and bool(mx.array_equal(ours[name], value)), name
    assert gguf.vision is not None and gguf.vision.model_type == hf.vision.model_type.replace("smolvlm", "idefics3")
    assert gguf.vision.tiles == hf.vision.tiles  # SmolVLM: the same tile markers from the GGUF's vocabulary
    assert gguf.vision.processor_config is not None  # from the projector's metadata, no preprocessor_config.json


def test_a_prompt_with_an_image_gives_the_directory_models_logits(pair) -> None:
    family, gguf_type, gguf, hf, _ = pair
    image = _image(gguf, seed=3)
    n_image = gguf.vision.image_token_count({"pixel_values": image.pixel_values,
                                             **({"image_grid_thw": np.asarray([image.grid_thw])}
                                                if family.startswith("qwen") else {})})[0]
    facts = gguf.vision
    body = facts.image_tokens(n_image, image.grid_thw)  # SmolVLM: its tile markers around the image tokens
    prompt = PROMPT_TEXT + list(facts.before) + body + list(facts.after) + PROMPT_TEXT
    start = len(PROMPT_TEXT) + len(facts.before)
    media = MediaInput(images=[MediaImage(image.pixel_values, image.grid_thw, (start, start + len(body)))])
    logits = []
    for loaded in (gguf, hf):
        bound = loaded.model.bind(media, prompt)
        cache = loaded.model.make_cache()
        logits.append(bound(mx.array([prompt]), cache=cache))
    assert logits[0].shape == logits[1].shape
    error = mx.abs(logits[0] - logits[1])
    # F32: float32 rounding; Q8_0: ggml's kernels round the weights and the activations to 8 bits.
    assert float(error.max()) < TOLERANCE[gguf_type] and float(error.mean()) < TOLERANCE[gguf_type] / 5


def test_a_quantized_text_gguf_keeps_its_blocks_inside_the_vision_model(pair) -> None:
    from mlxcel_compat.runtime.block_layers import BlockLinear

    family, gguf_type, gguf, _, _ = pair
    layer = gguf.model.vlm.language_model.model.layers[0]
    if gguf_type == "f32":
        assert not isinstance(layer.self_attn.q_proj, BlockLinear)
        return
    assert any(f"blocks {gguf_type}" in label for label in gguf.gguf.precision)
    assert isinstance(layer.self_attn.q_proj, BlockLinear) and isinstance(layer.mlp.down_proj, BlockLinear)


def _write_projector(path: Path, projector_type: str, drop: str = "") -> Path:
    """A copy of the tiny Gemma 3 projector with another type, or without one tensor."""
    import gguf

    from mlxcel_compat.testing.vision_gguf import write_mmproj_gguf

    directory = vision.ensure_vision_model(_cache(), "gemma3")
    weights = {k: np.array(v) for k, v in mx.load(str(directory / "model.safetensors")).items()}
    write_mmproj_gguf("gemma3", directory, weights, path)
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(path) + ".new", "clip")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = projector_type if field.name == "clip.projector_type" else field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, kind)
    for tensor in reader.tensors:
        if tensor.name != drop:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(path) + ".new").replace(path)
    return path


def _cache() -> Path:
    from tests.conftest import MODEL_CACHE

    return MODEL_CACHE


def test_an_unknown_projector_type_is_refused_naming_it(tmp_path: Path) -> None:
    from mlxcel_compat.model.mmproj import check_projector

    path = _write_projector(tmp_path / "mmproj-other.gguf", "llama4")
    with pytest.raises(ValueError, match="projector type 'llama4' .* is not served; served: gemma3, qwen2.5vl_merger, qwen2vl_merger"):
        check_projector(path)


def test_a_projector_missing_a_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    from mlxcel_compat.model.mmproj import read_projector
    from mlxcel_compat.vision.gguf_projector import projector_kind

    projector = read_projector(_write_projector(tmp_path / "mmproj-short.gguf", "gemma3", drop="v.blk.1.attn_q.weight"))
    shapes = {"vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight": (32, 32),
              "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight": (32, 32)}
    with pytest.raises(ValueError, match=r"lacks tensor v\.blk\.1\.attn_q\.weight"):
        projector_kind(projector).weights(projector, shapes)
    del shapes["vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight"]
    assert projector_kind(projector).weights(projector, shapes)["vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    with pytest.raises(ValueError, match=r"has shape \(32, 32\); mlx-vlm's .* is \(16, 32\)"):
        projector_kind(projector).weights(projector, {name: (16, 32) for name in shapes})


def test_a_file_that_is_not_a_projector_is_refused(model_cache: Path, tmp_path: Path) -> None:
    from mlxcel_compat.model.mmproj import check_projector

    text, _ = vision.ensure_vision_gguf(model_cache, "gemma3")
    with pytest.raises(ValueError, match="not a multimodal projector .*'gemma3', not 'clip'"):
        check_projector(text)
    with pytest.raises(ValueError, match="no such file"):
        check_projector(tmp_path / "missing.gguf")


def test_mmproj_with_a_model_directory_is_refused_saying_why(model_cache: Path) -> None:
    from mlxcel_compat.model.loader import load_model

    directory = vision.ensure_vision_model(model_cache, "qwen2_5_vl")
    _, mmproj = vision.ensure_vision_gguf(model_cache, "qwen2_5_vl")
    with pytest.raises(ValueError, match="--mmproj is a GGUF projector for a GGUF text model"):
        load_model(str(directory), [], mmproj=str(mmproj))


def test_image_token_bounds_come_from_llama_cpp_unless_set(model_cache: Path) -> None:
    """Qwen-VL images take 8 to 4096 tokens as in clip.cpp; --image-min-tokens / --image-max-tokens
    replace either bound; the processor then gives a large image no more tokens than the bound."""
    from PIL import Image

    from mlxcel_compat.model.mmproj import read_projector
    from mlxcel_compat.vision.gguf_projector import projector_kind

    _, mmproj = vision.ensure_vision_gguf(model_cache, "qwen2_5_vl")
    projector = read_projector(mmproj)
    kind = projector_kind(projector)
    area = 28 * 28  # 14-pixel patches merged 2x2
    assert kind.processor(projector, 0, 0).config["size"] == {"shortest_edge": 8 * area, "longest_edge": 4096 * area}
    bounded = kind.processor(projector, 4, 16)
    assert bounded.config["size"] == {"shortest_edge": 4 * area, "longest_edge": 16 * area}
    module, _, name = bounded.name.partition(":")
    import importlib

    processor = getattr(importlib.import_module(module), name)(**bounded.config)
    out = processor(images=[Image.new("RGB", (448, 448))], return_tensors="np")
    t, h, w = out["image_grid_thw"][0]
    assert t * h * w // 4 <= 16


def test_the_text_gguf_alone_serves_text_as_it_does_with_its_projector(pair) -> None:
    """Without ``--mmproj`` the text GGUF is mlx-lm's model (``qwen2vl``: mlx-lm's qwen2, plain
    RoPE, which is M-RoPE with one position per token on its three axes; Gemma 3: its rotating
    window, longer than this prompt): the logits the pair gives a text-only prompt."""
    from mlxcel_compat.gguf.load import load_gguf

    family, gguf_type, gguf, _, _ = pair
    model, _, config, summary = load_gguf(str(gguf.path))
    if family.startswith("qwen"):
        assert summary.architecture == "qwen2vl" and config["model_type"] == "qwen2" and len(config["mrope_section"]) == 3
    prompt = mx.array([PROMPT_TEXT * 3])
    alone = model(prompt)
    paired = gguf.model(prompt, cache=gguf.model.make_cache())
    assert float(mx.abs(alone - paired).max()) < 1e-3


@pytest.mark.parametrize("mmproj_type", ["f16", "q8_0"])
def test_half_and_q8_0_projectors_read_within_their_rounding(mmproj_type: str, model_cache: Path) -> None:
    """Projectors are often shipped in F16 or Q8_0 (``mmproj-*-f16.gguf``): read through the same
    dequantizer as text GGUFs, each matrix is the F32 file's within its type's rounding, vectors
    exact (they stay F32)."""
    import gguf

    from mlxcel_compat.model.mmproj import read_projector
    from mlxcel_compat.vision.gguf_projector import projector_kind

    _, exact = vision.ensure_vision_gguf(model_cache, "qwen2_5_vl")
    _, rounded = vision.ensure_vision_gguf(model_cache, "qwen2_5_vl", mmproj_type=mmproj_type)
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(rounded)).tensors}
    assert mmproj_type.upper() in rounded.name and stored["mm.0.weight"] == mmproj_type.upper()
    assert stored["v.blk.0.ln1.weight"] == "F32"
    a, b = read_projector(exact), read_projector(rounded)
    kind = projector_kind(b)
    shapes = {"vision_tower.blocks.0.attn.qkv.weight": (96, 32), "vision_tower.merger.mlp.0.weight": (128, 128),
              "vision_tower.blocks.0.norm1.weight": (32,)}
    reference, got = kind.weights(a, shapes), kind.weights(b, shapes)
    for name, value in reference.items():
        bound = float(np.abs(value).max()) * (1e-3 if mmproj_type == "f16" else 1e-2) if value.ndim > 1 else 0.0
        assert float(np.abs(got[name] - value).max()) <= bound, name


def test_load_options_reach_the_pairs_text_model(model_cache: Path) -> None:
    """``--override-kv`` and the RoPE flags load the pair's text GGUF as they load it alone: the
    layers the text model runs inside mlx-vlm's model take them, the logits change, and so does the
    fingerprint the prompt cache keys on; RoPE scaling on Qwen-VL's multimodal RoPE is refused."""
    from mlxcel_compat.gguf.overrides import parse_kv_overrides
    from mlxcel_compat.model.load_options import LoadOptions, RopeOverrides
    from mlxcel_compat.model.loader import load_model

    text, mmproj = vision.ensure_vision_gguf(model_cache, "smolvlm")
    plain = load_model(str(text), [], mmproj=str(mmproj))
    options = LoadOptions(rope=RopeOverrides(freq_base=7000.0),
                          kv_overrides=parse_kv_overrides(["llama.attention.layer_norm_rms_epsilon=float:0.25"]))
    changed = load_model(str(text), [], mmproj=str(mmproj), options=options)
    layers = [loaded.model.vlm.language_model.model.layers[0] for loaded in (plain, changed)]
    assert [(float(x.self_attn.rope.base), float(x.input_layernorm.eps)) for x in layers] == [
        (1e5, pytest.approx(1e-5)), (7000.0, 0.25)]
    prompt = mx.array([PROMPT_TEXT * 4])
    first, second = (loaded.model(prompt, cache=loaded.model.make_cache()) for loaded in (plain, changed))
    assert float(mx.abs(first - second).max()) > 1e-3 and plain.fingerprint != changed.fingerprint
    qwen_text, qwen_mmproj = vision.ensure_vision_gguf(model_cache, "qwen2_5_vl")
    with pytest.raises(ValueError, match="multimodal RoPE"):  # refused before the text model loads
        load_model(str(qwen_text), [], mmproj=str(qwen_mmproj), options=LoadOptions(rope=RopeOverrides(scale=2.0)))
