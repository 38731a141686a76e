"""The factory's LFM2-VL projector as llama.cpp's converter writes it (``LFM2VLModel``, type
``lfm2``): the checkpoint's ``model.vision_tower.*`` and ``model.multi_modal_projector.*`` under
gguf-py's ``MMPROJ`` names, written independently of the loader that reads them back
(``vision/lfm2vl.py: Lfm2VlProjector``):

- the SigLIP2 patch embedding, a linear layer over ``patch * patch * 3`` values (row, column,
  channel), as the converter stores it: a ``(width, 3, patch, patch)`` convolution;
- ``clip.vision.image_size`` 256 (the converter's fixed value: NaFlex has none), the tower's
  widths, ``block_count`` less the blocks past ``vision_feature_layer``, the LayerNorm epsilon,
  ``use_gelu``, the pixel unshuffle's ``downsample_factor`` as ``projector.scale_factor``, the
  processor's mean and std;
- tensors F32, or F16 / Q8_0 matrices in such a file (the position table and vectors F32, the patch
  embedding F16 only in an F16 file), as the converter's ``tensor_force_quant`` keeps them.

The text GGUF is ``lfm2`` (``testing/vision_gguf.py: write_text_gguf``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .mmproj_writer import clip_writer, tower_keys, write_tensors

CONVERTER_IMAGE_SIZE = 256  # LFM2VLModel writes this for every checkpoint


def converted_lfm2vl_projector(weights: dict[str, np.ndarray], n_blocks: int, patch: int) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array of the tower and projector (mlx-vlm's names and layouts in ``weights``)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(n_blocks, 3))
    out: dict[str, np.ndarray] = {}
    for name, value in sorted(weights.items()):
        if name.startswith("language_model."):
            continue
        if name.startswith("vision_tower."):  # the checkpoint's name, after the converter's "model." strip
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        block = name.split("encoder.layers.")[1].split(".")[0] if "encoder.layers." in name else None
        if block is not None and int(block) >= n_blocks:
            continue  # blocks past vision_feature_layer: the converter's block_count leaves them out
        if name.endswith("patch_embedding.weight"):  # (width, p*p*3) -> (width, 3, p, p)
            value = value.reshape(value.shape[0], patch, patch, 3).transpose(0, 3, 1, 2)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF projector name for {name}")
        out[gguf_name] = np.ascontiguousarray(value, dtype=np.float32)
    return out


def _stored(name: str, data: np.ndarray, mmproj_type: str) -> str:
    if data.ndim < 2 or mmproj_type == "f32" or "position_embd" in name:
        return "f32"
    if "patch_embd" in name:
        return "f16" if mmproj_type == "f16" else "f32"
    return "q8_0" if mmproj_type == "q8_0" and data.shape[-1] % 32 == 0 else "f16"


def write_lfm2vl_mmproj(directory: Path, weights: dict[str, Any], out: Path, mmproj_type: str = "f32") -> Path:
    """The LFM2-VL directory's tower and projector as llama.cpp's clip GGUF."""
    import gguf

    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    processor = json.loads((directory / "preprocessor_config.json").read_text(encoding="utf-8"))
    vision, text = config["vision_config"], config["text_config"]
    feature_layer = int(config.get("vision_feature_layer", -1))
    n_blocks = int(vision["num_hidden_layers"]) + feature_layer + 1  # -1: every block
    patch = int(vision["patch_size"])
    writer = clip_writer(out, mmproj_type, int(text["hidden_size"]), patch, processor)
    tower_keys(writer, vision, image_size=CONVERTER_IMAGE_SIZE, n_blocks=n_blocks)
    writer.add_clip_projector_type(gguf.VisionProjectorType.LFM2)
    writer.add_vision_attention_layernorm_eps(float(vision.get("layer_norm_eps", 1e-6)))
    writer.add_vision_projector_scale_factor(int(config.get("downsample_factor", 2)))
    writer.add_vision_use_gelu(True)
    arrays = {name: np.array(value, dtype=np.float32) for name, value in weights.items()}
    tensors = converted_lfm2vl_projector(arrays, n_blocks, patch)
    return write_tensors(writer, out, tensors, lambda name, data: _stored(name, data, mmproj_type))
