"""What every factory projector GGUF (``clip``) writer shares: the keys llama.cpp's converter
writes for any vision projector, and the tensors stored each in the type the converter gives it.

Why one place: the projector writers (``vision_gguf.py`` for Gemma 3, Qwen-VL, SmolVLM, InternVL;
``vision_gguf_llava.py``, ``vision_gguf_pixtral.py``, ``vision_gguf_lfm2.py``) differ in their
towers' keys and tensor names, not in how a file starts or how its tensors are written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np


def clip_writer(out: Path, mmproj_type: str, projection_dim: int, patch_size: int, processor: dict[str, Any]) -> Any:
    """A ``clip`` GGUF writer holding the keys ``MmprojModel`` writes for every projector: the
    file's type and name, a vision encoder, the projection's width (the text model's), the patch
    size, and the image processor's mean and std."""
    import gguf

    writer = gguf.GGUFWriter(None, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(out.stem)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if mmproj_type == "f16" else gguf.LlamaFileType.ALL_F32))
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(projection_dim)
    writer.add_vision_patch_size(patch_size)
    writer.add_vision_image_mean([float(x) for x in processor["image_mean"]])
    writer.add_vision_image_std([float(x) for x in processor["image_std"]])
    return writer


def tower_keys(writer: Any, vision: dict[str, Any], image_size: int | None = None, n_blocks: int | None = None) -> int:
    """A ViT tower's ``clip.vision.*`` sizes as the converter writes them (the image size, width,
    MLP width, block count and heads: SigLIP's, Pixtral's, SigLIP2's); ``image_size`` and
    ``n_blocks`` where the converter writes other numbers than the config's. Returns the block count."""
    n_blocks = int(vision["num_hidden_layers"]) if n_blocks is None else n_blocks
    writer.add_vision_image_size(int(vision["image_size"]) if image_size is None else image_size)
    writer.add_vision_embedding_length(int(vision["hidden_size"]))
    writer.add_vision_feed_forward_length(int(vision["intermediate_size"]))
    writer.add_vision_block_count(n_blocks)
    writer.add_vision_head_count(int(vision["num_attention_heads"]))
    return n_blocks


def write_tensors(writer: Any, out: Path, tensors: dict[str, np.ndarray], stored: Callable[[str, np.ndarray], str]) -> Path:
    """Every tensor in the type ``stored(name, data)`` names (``"f32"``, ``"f16"`` or ``"q8_0"``:
    the converter's choice for it), then the file written and closed."""
    import gguf

    for name, data in tensors.items():
        kind = stored(name, data)
        if kind == "q8_0":
            writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data.astype(np.float16) if kind == "f16" else data)
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


__all__ = ["clip_writer", "tower_keys", "write_tensors"]
