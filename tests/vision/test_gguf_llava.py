"""GGUF pairs of LLaVA 1.5 (projector type ``mlp``): the factory's tiny ``llava`` directory written as
llama.cpp's legacy tools write it (``testing/vision_gguf_llava.py``), loaded back
(``vision/gguf_projector.py: LlavaProjector``) and compared with the directory it came from.

The projector holds CLIP's blocks up to the feature layer only (the tiny tower's ``-2`` of 2
blocks: 1), no post-layernorm, the MLP's ``fc1`` / ``fc2`` under the legacy names ``ffn_down`` /
``ffn_up``, and its patch convolution and projector matrices in F16. Loaded, the tower and
projector are the directory's (those in F16 to their rounding) and a prompt with an image gives the
directory model's logits once the directory takes the same F16 rounding. A file with gguf-py's own
FFN names reads the same; a feature layer mlx-vlm's projector cannot take is refused naming it."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxcel_compat.testing import vision
from mlxcel_compat.vision.inputs import MediaImage, MediaInput

PROMPT_TEXT = [5, 6, 7, 8, 9, 10, 11]
HALF = ("patch_embedding.weight", "multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_2.weight")


@pytest.fixture(scope="module")
def files() -> tuple[Path, Path, Path]:
    from tests.conftest import MODEL_CACHE

    directory = vision.ensure_vision_model(MODEL_CACHE, "llava")
    text, mmproj = vision.ensure_vision_gguf(MODEL_CACHE, "llava")
    return directory, text, mmproj


@pytest.fixture(scope="module")
def loaded(files):
    from mlxcel_compat.model.loader import load_model

    directory, text, mmproj = files
    return load_model(str(text), [], mmproj=str(mmproj)), load_model(str(directory), [])


def _directory_weights(directory: Path) -> dict[str, mx.array]:
    """The directory's tower and projector, with what the projector stores in F16 rounded to it."""
    out = {}
    for name, value in mx.load(str(directory / "model.safetensors")).items():
        if not name.startswith("language_model."):
            out[name] = value.astype(mx.float16).astype(mx.float32) if name.endswith(HALF) else value
    return out


def test_the_file_is_laid_out_as_the_legacy_tools_write_it(files) -> None:
    import gguf

    _, text, mmproj = files
    assert mmproj.name.startswith("mmproj-") and mmproj.parent == text.parent
    reader = gguf.GGUFReader(str(mmproj))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["clip.projector_type"] == "mlp" and fields["clip.has_llava_projector"] is True
    assert fields["clip.vision.block_count"] == 1 and fields["clip.vision.feature_layer"] == [1]
    stored = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in reader.tensors}
    assert not any(n.startswith(("v.blk.1.", "v.post_ln")) for n in stored)  # only the blocks LLaVA reads
    assert stored["v.blk.0.ffn_down.weight"] == ("F32", (32, 64))  # CLIP's fc1 (32 -> 64), the legacy name
    assert stored["v.patch_embd.weight"][0] == "F16" and stored["mm.0.weight"][0] == "F16"
    assert stored["v.class_embd"] == ("F32", (32,))


def test_the_tower_and_projector_are_the_directory_weights(files, loaded) -> None:
    directory, _, _ = files
    gguf, _ = loaded
    ours = {k: v for k, v in tree_flatten(gguf.model.vlm.parameters()) if not k.startswith("language_model.")}
    theirs = _directory_weights(directory)
    read = {k for k in theirs if ".encoder.layers.1." not in k and ".post_layernorm." not in k}
    assert read <= ours.keys() and ours.keys() - read == {f"vision_tower.vision_model.post_layernorm.{x}"
                                                          for x in ("weight", "bias")}
    for name in read:
        assert ours[name].shape == theirs[name].shape and bool(mx.array_equal(ours[name], theirs[name])), name
    assert gguf.vision.model_type == "llava" and gguf.vision.image_token_id == vision.vision_token_id("<image>", "llava")
    assert gguf.vision.processor_config["do_pad"] is True  # mtmd pads to a square of the mean colour


def test_a_prompt_with_an_image_gives_the_directory_models_logits(files, loaded) -> None:
    directory, _, _ = files
    gguf, hf = loaded
    hf.model.vlm.load_weights(list(_directory_weights(directory).items()), strict=False)
    blank = gguf.model.family.blank_image(gguf.model.vlm)
    pixels = np.random.default_rng(3).standard_normal(blank.pixel_values.shape).astype(np.float32)
    n_image = gguf.vision.image_token_count({"pixel_values": pixels})[0]
    assert n_image == 16  # 4x4 patches of the 56-pixel image, the class token dropped
    prompt = PROMPT_TEXT + [gguf.vision.image_token_id] * n_image + PROMPT_TEXT
    start = len(PROMPT_TEXT)
    media = MediaInput(images=[MediaImage(pixels, (1, 1, 1), (start, start + n_image))])
    logits = [m.model.bind(media, prompt)(mx.array([prompt]), cache=m.model.make_cache()) for m in (gguf, hf)]
    assert float(mx.abs(logits[0] - logits[1]).max()) < 1e-4
    plain = gguf.model.bind(None, prompt)(mx.array([prompt]), cache=gguf.model.make_cache())
    assert float(mx.abs(plain - logits[0]).max()) > 1e-3  # the image's features took the image tokens' place


def _rewrite(source: Path, target: Path, rename=lambda name: name, fields: dict | None = None) -> Path:
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), "clip")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value, kind = (fields or {}).get(field.name, field.contents()), field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, kind)
    for tensor in reader.tensors:
        writer.add_tensor(rename(tensor.name), np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_gguf_py_ffn_names_read_the_same_as_the_legacy_ones(files, tmp_path: Path) -> None:
    from mlxcel_compat.model.mmproj import read_projector
    from mlxcel_compat.vision.gguf_projector import projector_kind

    _, _, mmproj = files
    swap = {".ffn_up.": ".ffn_down.", ".ffn_down.": ".ffn_up."}

    def rename(name: str) -> str:
        return next((name.replace(a, b) for a, b in swap.items() if a in name), name)

    modern = read_projector(_rewrite(mmproj, tmp_path / "mmproj-modern.gguf", rename))
    legacy = read_projector(mmproj)
    assert modern.read("v.blk.0.ffn_up.weight").shape == (64, 32)  # fc1 under gguf-py's name
    shapes = {f"vision_tower.vision_model.encoder.layers.0.mlp.fc{i}.{p}": s
              for i, (w, b) in ((1, ((64, 32), (64,))), (2, ((32, 64), (32,)))) for p, s in (("weight", w), ("bias", b))}
    a, b = (projector_kind(p).weights(p, shapes) for p in (legacy, modern))
    assert all(np.array_equal(a[k], b[k]) for k in shapes)


def test_a_feature_layer_past_the_blocks_is_refused_naming_it(files, tmp_path: Path) -> None:
    from mlxcel_compat.model.loader import load_model

    _, text, mmproj = files
    bad = _rewrite(mmproj, tmp_path / "mmproj-bad.gguf", fields={"clip.vision.feature_layer": [1, 0]})
    with pytest.raises(ValueError, match=r"clip.vision.feature_layer \[1, 0\] is not served"):
        load_model(str(text), [], mmproj=str(bad))


def test_an_f16_projector_keeps_its_matrices_in_float16_and_computes_in_float32(files, loaded) -> None:
    """A projector's F16 (or block-quantized) matrices stay float16 in memory, as llama.cpp holds
    them (not doubled to float32: issue 52's RSS); MLX promotes them to the float32 activations, so
    an image's logits are the F32 file's within the weights' float16 rounding."""
    from mlxcel_compat.model.loader import load_model

    _, text, _ = files
    from tests.conftest import MODEL_CACHE

    _, half_mmproj = vision.ensure_vision_gguf(MODEL_CACHE, "llava", mmproj_type="f16")
    half = load_model(str(text), [], mmproj=str(half_mmproj))
    exact, _ = loaded
    tower = dict(tree_flatten(half.model.vlm.vision_tower.parameters()))
    kinds = {name: value.dtype for name, value in tower.items()}
    assert kinds["vision_model.encoder.layers.0.self_attn.q_proj.weight"] == mx.float16
    assert kinds["vision_model.encoder.layers.0.self_attn.q_proj.bias"] == mx.float32  # vectors stay float32
    assert kinds["vision_model.embeddings.patch_embedding.weight"] == mx.float32  # the pixels' dtype
    blank = half.model.family.blank_image(half.model.vlm)
    pixels = np.random.default_rng(5).standard_normal(blank.pixel_values.shape).astype(np.float32)
    rows = [m.model.family.features(m.model.vlm, [MediaImage(pixels, (1, 1, 1), (0, 16))]) for m in (half, exact)]
    assert rows[0].dtype == mx.float32
    scale = float(mx.abs(rows[1]).max())
    assert 0 < float(mx.abs(rows[0] - rows[1]).max()) < 1e-2 * scale
