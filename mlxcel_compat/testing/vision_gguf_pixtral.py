"""The factory's Mistral 3 projector as llama.cpp's converter writes it (``LlavaVisionModel`` for a
``pixtral`` vision config, ``clip.projector_type`` ``pixtral``), with this project's GGUF writer.

What the converter does that matters here:

- the tower's checkpoint names (``vision_tower.transformer.layers.N.attention.q_proj``, ...) go
  through gguf-py's ``MMPROJ`` map; the projector's ``multi_modal_projector.norm`` becomes
  ``mm.input_norm``, its ``patch_merger.merging_layer`` ``mm.patch_merger``, its ``linear_1`` /
  ``linear_2`` ``mm.1`` / ``mm.2``;
- the tower's ``q_proj`` and ``k_proj`` rows are permuted as ``LlamaModel.permute`` permutes a text
  model's (each head's two rotary halves interleaved, the layout of ggml's RoPE);
- the text model's embedding row of ``[IMG_BREAK]`` is copied into the projector as
  ``v.token_embd.img_break`` (mtmd appends it after each row of an image's embeddings);
- keys: the tower's sizes, ``use_silu``, the layer-norm epsilon (1e-5: Pixtral's, hard-coded in
  Hugging Face's model) and ``spatial_merge_size``; no ``image_size``-derived limits (clip.cpp
  takes 8 to 1024 tokens an image for ``pixtral``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .mmproj_writer import clip_writer, tower_keys, write_tensors

PIXTRAL_LAYER_NORM_EPS = 1e-5  # not in Pixtral's config.json: the converter hard-codes it, as modeling_pixtral does


def permute_rotary_rows(value: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute``'s layout: each head's rows ``[first half, second half]`` interleaved pairwise."""
    return value.reshape(n_head, 2, value.shape[0] // n_head // 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)


def pixtral_projector_tensors(weights: dict[str, np.ndarray], n_heads: int, n_blocks: int,
                              img_break_row: np.ndarray) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array of the tower, the projector and the ``[IMG_BREAK]`` embedding."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(n_blocks, 3))
    out: dict[str, np.ndarray] = {}
    for name, value in sorted(weights.items()):
        if name.startswith("language_model."):
            continue
        hf_name = name.replace("vision_tower.vision_model.", "vision_tower.")
        if hf_name.endswith("patch_conv.weight"):  # mlx (O, H, W, I) -> torch (O, I, H, W)
            value = value.transpose(0, 3, 1, 2)
        if hf_name.endswith(("attention.q_proj.weight", "attention.k_proj.weight")):
            value = permute_rotary_rows(value, n_heads)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF projector name for {hf_name}")
        out[gguf_name] = np.ascontiguousarray(value, dtype=np.float32)
    out[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK]] = np.ascontiguousarray(img_break_row, dtype=np.float32)
    return out


def write_pixtral_mmproj(directory: Path, weights: dict[str, Any], out: Path, mmproj_type: str = "f32") -> Path:
    """The tower and projector of the factory's ``mistral3`` directory as llama.cpp's clip GGUF."""
    import gguf

    if mmproj_type not in ("f32", "f16", "q8_0"):
        raise ValueError(f"projector type {mmproj_type!r}: one of f32, f16, q8_0")
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    processor = json.loads((directory / "preprocessor_config.json").read_text(encoding="utf-8"))
    vocab = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    vision, text = config["vision_config"], config["text_config"]
    writer = clip_writer(out, mmproj_type, int(text["hidden_size"]), int(vision["patch_size"]), processor)
    n_blocks = tower_keys(writer, vision)
    writer.add_clip_projector_type(gguf.VisionProjectorType.PIXTRAL)
    writer.add_vision_attention_layernorm_eps(PIXTRAL_LAYER_NORM_EPS)
    writer.add_vision_use_silu(True)
    writer.add_vision_spatial_merge_size(int(config["spatial_merge_size"]))
    img_break = next(int(t["id"]) for t in vocab["added_tokens"] if t["content"] == "[IMG_BREAK]")
    arrays = {name: np.array(value, dtype=np.float32) for name, value in weights.items()}
    row = arrays["language_model.model.embed_tokens.weight"][img_break]
    tensors = pixtral_projector_tensors(arrays, int(vision["num_attention_heads"]), n_blocks, row)
    return write_tensors(writer, out, tensors, lambda name, data: stored_type(name, data, mmproj_type))


def stored_type(name: str, data: np.ndarray, mmproj_type: str) -> str:
    """The converter's storage of a projector tensor in an ``--outtype`` file: vectors (and any tensor of
    an F32 file) F32, the patch convolution F16 only in an F16 file, other matrices Q8_0 where their rows
    are whole 32-value blocks, else F16."""
    if data.ndim < 2 or mmproj_type == "f32":
        return "f32"
    if "patch_embd" in name:
        return "f16" if mmproj_type == "f16" else "f32"
    return "q8_0" if mmproj_type == "q8_0" and data.shape[-1] % 32 == 0 else "f16"
