"""InternVL: its family rules (a directory through mlx-vlm's ``internvl_chat``) and its GGUF
projector (``clip.projector_type`` ``internvl``).

- **tiles**: an image is cut into tiles of the tower's size (between ``min_dynamic_patch`` and
  ``max_dynamic_patch`` of them, the grid whose aspect ratio is closest to the image's) plus the
  whole image shrunk to one tile when there is more than one, last; Hugging Face's
  ``GotOcr2ImageProcessor`` cuts them so (``crop_to_patches``), as InternVL's own preprocessing does;
- **the tower**: InternViT (a class token, learned position embeddings, layer scales on both
  residual branches), its last layer's patches (the class token dropped);
- **the projector**: pixel shuffle by ``downsample_ratio`` (0.5: 2x2 patches into one row), then
  LayerNorm, linear, GELU, linear (``mlp1``);
- **the prompt**: ``<img>`` + ``<IMG_CONTEXT>`` per feature row of every tile + ``</img>``: the
  template writes ``<img><IMG_CONTEXT></img>``, the server repeats the middle token;
- **the text model**: Qwen2 (or Qwen3: q/k norms, no biases), plain RoPE, causal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.vision.families import VisionFacts, VisionFamily
from mlxcel_compat.vision.gguf_projector import Processor, ProjectorFile, ProjectorKind

GOT_OCR2_PROCESSOR = "transformers.models.got_ocr2.image_processing_pil_got_ocr2:GotOcr2ImageProcessorPil"


def _vision(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("vision_config") or {}


class InternVL(VisionFamily):
    """InternVL 2.5 / 3 (``internvl_chat``): dynamic tiles and a thumbnail, InternViT, pixel shuffle,
    the ``mlp1`` projector; plain positions (module docstring)."""

    model_types = ("internvl_chat",)
    processors = {"GotOcr2ImageProcessor": GOT_OCR2_PROCESSOR}

    def facts_from(self, config: dict[str, Any], tokenizer: Any, processor: str,
                   processor_config: dict[str, Any] | None, processor_dir: Path = Path(".")) -> VisionFacts:
        vocab = tokenizer.get_vocab()
        missing = [t for t in ("<img>", "</img>", "<IMG_CONTEXT>") if t not in vocab]
        if missing:
            raise ValueError(f"the InternVL tokenizer lacks {', '.join(missing)}")
        context = int(config.get("image_token_index") or vocab["<IMG_CONTEXT>"])
        vision = _vision(config)
        side = int(vision.get("image_size", 448)) // int(vision.get("patch_size", 14))
        per_tile = int(side * float(config.get("downsample_ratio", 0.5))) ** 2
        return VisionFacts(model_type="internvl_chat", image_token_id=context,
                           marker=(int(vocab["<img>"]), context, int(vocab["</img>"])), expand_token=context,
                           tokens_per_tile=per_tile, processor=processor, processor_dir=processor_dir,
                           processor_config=processor_config)

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        tower = vlm.vision_model
        tiles = np.concatenate([np.asarray(img.pixel_values).reshape(-1, *img.pixel_values.shape[-3:]) for img in images])
        pixels = mx.array(tiles).transpose(0, 2, 3, 1).astype(tower.embeddings.patch_embedding.weight.dtype)
        hidden, _, _ = tower(pixels, output_hidden_states=True)
        from mlx_vlm.models.base import pixel_shuffle

        rows = pixel_shuffle(hidden[:, 1:, :], shuffle_ratio=vlm.downsample_ratio)
        for layer in vlm.mlp1:
            rows = layer(rows)
        return rows.reshape(-1, rows.shape[-1])

    def blank_image(self, vlm: Any) -> Any:
        from mlxcel_compat.vision.inputs import MediaImage

        size = int(vlm.config.vision_config.image_size)
        return MediaImage(np.zeros((1, 3, size, size), np.float32), (1, 1, 1), (0, 1))


class InternVLProjector(ProjectorKind):
    """``internvl``, as the converter's ``InternVisionModel`` writes it: InternViT's blocks under
    gguf-py's names with the fused ``qkv`` split in three (``attn_q/k/v``), the layer scales as
    ``v.blk.N.ls1``/``ls2``, the class and position embeddings as ``v.class_embd`` and
    ``v.position_embd``, the projector's ``mlp1.{0,1,3}`` as ``mm.model.mlp.{0,1,3}``; the pixel
    shuffle's factor as ``projector.scale_factor`` and the tiles' bounds as
    ``preproc_min_tiles``/``preproc_max_tiles`` (clip.cpp's 1 and 12 when absent). The text GGUF
    is the model's own (``qwen2``, ``qwen3``, ``llama``), its layers moved into mlx-vlm's."""

    types = ("internvl",)
    model_type = "internvl_chat"

    def vlm_config(self, projector: ProjectorFile, text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
        names = projector.names
        vision = dict(model_type="intern_vit_6b", hidden_size=int(projector.vision("embedding_length")),
                      num_attention_heads=int(projector.vision("attention.head_count")),
                      intermediate_size=int(projector.vision("feed_forward_length")),
                      num_hidden_layers=int(projector.vision("block_count")),
                      image_size=int(projector.vision("image_size")), patch_size=int(projector.vision("patch_size")),
                      num_channels=3, layer_norm_eps=float(projector.vision("attention.layer_norm_epsilon", 1e-6)),
                      qkv_bias="v.blk.0.attn_q.bias" in names, qk_normalization="v.blk.0.attn_q_norm.weight" in names,
                      norm_type="layer_norm" if "v.blk.0.ln1.bias" in names else "rms_norm", drop_path_rate=0.0)
        scale = int(projector.metadata.get("clip.vision.projector.scale_factor") or 2)
        # mlx-vlm's InternVL text model: Qwen2's q/k/v biases, or Qwen3's q/k norms without them
        text_config = dict(text, attention_bias=text.get("model_type") != "qwen3")
        return dict(model_type=self.model_type, text_config=text_config, vision_config=vision,
                    downsample_ratio=1.0 / scale, vocab_size=int(text["vocab_size"]),
                    image_token_index=token_ids["<IMG_CONTEXT>"], eos_token_id=text.get("eos_token_id"))

    def processor(self, projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
        size = int(projector.vision("image_size"))
        config = dict(do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, rescale_factor=1 / 255,
                      resample=3, size={"height": size, "width": size}, crop_to_patches=True,
                      min_patches=int(projector.metadata.get("clip.vision.preproc_min_tiles") or 1),
                      max_patches=int(projector.metadata.get("clip.vision.preproc_max_tiles") or 12),
                      image_mean=[float(x) for x in projector.vision("image_mean")],
                      image_std=[float(x) for x in projector.vision("image_std")])
        return Processor(GOT_OCR2_PROCESSOR, config)

    @staticmethod
    def gguf_name(mlx_name: str, names: Any) -> str | None:
        """The projector's tensor of an mlx-vlm parameter (the fused ``qkv``: its ``attn_q`` part),
        through gguf-py's map of the checkpoint's names as the converter renames them."""
        name = mlx_name.replace(".attn.qkv.", ".self_attn.q_proj.")
        if name.endswith((".ls1", ".ls2", ".position_embedding")):  # the class embedding keeps its bare name
            name += ".weight"
        if name.startswith("vision_model."):
            name = "vision_tower." + name
        return names.get_name(name, try_suffixes=(".weight", ".bias"))

    def weights(self, projector: ProjectorFile, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        import gguf

        # gguf-py maps the projector's mlp1.N through block-indexed rows: at least 4 blocks for mlp1.3
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(int(projector.vision("block_count")), 4))
        out: dict[str, np.ndarray] = {}
        for mlx_name, shape in shapes.items():
            gguf_name = self.gguf_name(mlx_name, names)
            if gguf_name is None:
                raise ValueError(f"projector {projector.path}: no GGUF tensor corresponds to {mlx_name}")
            fused = ".attn.qkv." in mlx_name
            needed = [gguf_name.replace("attn_q", f"attn_{x}") for x in "qkv"] if fused else [gguf_name]
            if missing := [n for n in needed if n not in projector.names]:
                raise ValueError(f"projector {projector.path} lacks tensor {missing[0]} ({mlx_name})")
            value = np.concatenate([projector.read(n) for n in needed])
            if mlx_name.endswith("patch_embedding.weight"):  # PyTorch's (out, in, kh, kw) as MLX's (out, kh, kw, in)
                value = np.moveaxis(value, 1, -1)
            if mlx_name.endswith((".class_embedding", ".position_embedding")) and value.size == int(np.prod(shape)):
                value = value.reshape(shape)
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"projector {projector.path}: tensor {gguf_name} has shape {value.shape}; "
                                 f"mlx-vlm's {mlx_name} is {shape}")
            out[mlx_name] = np.ascontiguousarray(value)
        return out
