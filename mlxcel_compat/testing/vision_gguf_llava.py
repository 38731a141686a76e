"""The factory's LLaVA 1.5 directory's projector as llama.cpp's legacy tools write it (``mlp``).

llama.cpp's ``convert_hf_to_gguf.py`` writes no projector for a CLIP LLaVA (its ``LlavaVisionModel``
takes Pixtral towers only); LLaVA 1.5 projectors come from ``tools/mtmd/legacy-models``: the
checkpoint split into a CLIP vision model and the projector's tensors, then
``convert_image_encoder_to_gguf.py --clip-model-is-vision --llava-projector``. What that writes,
and so what this module writes from the factory's weights (mlx-vlm's names and layouts):

- the CLIP tower's blocks up to the feature layer only (``vision_feature_layer`` made
  non-negative: ``-2`` of 2 blocks is 1), its block count that layer, and the layer as
  ``clip.vision.feature_layer``; CLIP's post-layernorm left out (LLaVA never reads it);
- gguf-py's ``MMPROJ`` names, except the MLP's: ``fc1`` as ``ffn_down`` and ``fc2`` as
  ``ffn_up`` (the legacy script's names; clip.cpp swaps them back by their shapes), and the
  projector's ``linear_1`` / ``linear_2`` as ``mm.0`` / ``mm.2``;
- the patch convolution in PyTorch's ``(out, in, kh, kw)`` layout, always F16; the projector's
  matrices always F16; in an F16 file every other 2-D ``.weight`` F16 too; vectors F32;
- the keys ``clip.has_text_encoder`` (false), ``clip.has_vision_encoder``,
  ``clip.has_llava_projector``, ``clip.projector_type = mlp``, ``clip.use_gelu`` (false: CLIP's
  quick GELU), ``clip.vision.*`` (``projection_dim`` the CLIP config's) and no ``general.type``.

``scripts/check_mmproj.py --families llava`` runs the legacy script itself on the same weights and
compares the two files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .mmproj_writer import write_tensors

TOWER = "vision_tower.vision_model."


def feature_layer(config: dict[str, Any]) -> int:
    """``vision_feature_layer`` as the legacy script makes it non-negative (an index of the
    hidden states, whose first is the encoder's input)."""
    layer = int(config.get("vision_feature_layer", -2))
    blocks = int(config["vision_config"]["num_hidden_layers"])
    return layer if layer >= 0 else blocks + layer + 1


def llava_tensors(config: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values (PyTorch layouts), as the legacy script names them."""
    import gguf

    keep = feature_layer(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(keep, 3))
    out: dict[str, np.ndarray] = {}
    for name, value in sorted(weights.items()):
        if name.startswith("multi_modal_projector.linear_"):
            index = {"1": 0, "2": 2}[name.split(".")[1].removeprefix("linear_")]
            out[f"mm.{index}.{name.rsplit('.', 1)[-1]}"] = value
            continue
        if not name.startswith(TOWER) or ".post_layernorm." in name:
            continue
        if ".encoder.layers." in name and int(name.split(".encoder.layers.")[1].split(".")[0]) >= keep:
            continue
        if name.endswith("patch_embedding.weight"):  # mlx (O, H, W, I) -> torch (O, I, H, W)
            value = value.transpose(0, 3, 1, 2)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF projector name for {name}")
        swapped = {".ffn_up.": ".ffn_down.", ".ffn_down.": ".ffn_up."}
        for old, new in swapped.items():
            if old in gguf_name:
                gguf_name = gguf_name.replace(old, new)
                break
        out[gguf_name] = np.ascontiguousarray(value, dtype=np.float32)
    return out


def stored_type(name: str, data: np.ndarray, mmproj_type: str) -> str:
    """The legacy script's types: convolutions and the projector's matrices F16 always; other
    2-D weights F16 in an F16 file (Q8_0 here in a Q8_0 one, where rows are whole blocks)."""
    if data.ndim == 4 or (name.startswith("mm.") and data.ndim == 2):
        return "f16"
    if data.ndim < 2 or mmproj_type == "f32" or not name.endswith(".weight"):
        return "f32"
    if mmproj_type == "q8_0" and data.shape[-1] % 32 == 0:
        return "q8_0"
    return "f16"


def write_llava_mmproj(directory: Path, weights: dict[str, Any], out: Path, mmproj_type: str = "f32") -> Path:
    """The CLIP tower and 2-layer projector of the factory's ``llava`` directory as a ``clip`` GGUF."""
    import gguf

    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    processor = json.loads((directory / "preprocessor_config.json").read_text(encoding="utf-8"))
    vision = config["vision_config"]
    layer = feature_layer(config)
    writer = gguf.GGUFWriter(None, "clip")
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if mmproj_type != "f32" else gguf.LlamaFileType.ALL_F32))
    writer.add_name(out.stem)
    writer.add_description("image encoder for LLaVA")
    writer.add_string("clip.projector_type", "mlp")
    writer.add_uint32("clip.vision.image_size", int(vision["image_size"]))
    writer.add_uint32("clip.vision.patch_size", int(vision["patch_size"]))
    writer.add_uint32("clip.vision.embedding_length", int(vision["hidden_size"]))
    writer.add_uint32("clip.vision.feed_forward_length", int(vision["intermediate_size"]))
    writer.add_uint32("clip.vision.projection_dim", int(vision["projection_dim"]))
    writer.add_uint32("clip.vision.attention.head_count", int(vision["num_attention_heads"]))
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", float(vision.get("layer_norm_eps", 1e-5)))
    writer.add_uint32("clip.vision.block_count", layer)
    writer.add_array("clip.vision.feature_layer", [layer])
    writer.add_array("clip.vision.image_mean", [float(x) for x in processor["image_mean"]])
    writer.add_array("clip.vision.image_std", [float(x) for x in processor["image_std"]])
    writer.add_bool("clip.use_gelu", False)
    arrays = {name: np.array(value, dtype=np.float32) for name, value in weights.items()}
    return write_tensors(writer, out, llava_tensors(config, arrays), lambda name, data: stored_type(name, data, mmproj_type))
