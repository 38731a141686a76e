"""Qwen3-VL: its family rules (a directory through mlx-vlm's ``qwen3_vl``) and its GGUF projector
(``clip.projector_type`` ``qwen3vl_merger``).

What Qwen3-VL adds to Qwen2.5-VL's path (``families.Qwen2VL``: ``image_grid_thw``, the patch
processor, ``get_rope_index``):

- **the tower**: 16-pixel patches of two frames, a learned table of position embeddings
  bilinearly interpolated (corners aligned) to each image's patch grid, plain attention over the
  whole image, LayerNorm and a GELU MLP per block, then the 2x2 merger;
- **deepstack**: some tower blocks (``deepstack_visual_indexes``) also feed a merger of their own,
  and the text model adds those rows to the image tokens' hidden states after its first layers
  (one layer per deepstack merger);
- **the text model**: Qwen3 (q/k norms) with *interleaved* M-RoPE (time, height and width take
  every third rotary frequency), llama.cpp's ``qwen3vl`` architecture (``IMROPE``).

One feature row carries both: the merger's row followed by each deepstack merger's
(``(tokens, hidden * (1 + deepstack))``), which is how llama.cpp's mtmd hands Qwen3-VL's image
embeddings to its text model (``n_embd_inp``). The bound model (``vision/model.py``) merges rows
of that width into embeddings of that width (the text tokens' extra columns zero), and
:meth:`Qwen3VL.hidden` splits them: the first ``hidden`` columns are the input embeddings, the
rest the deepstack additions; adding a text token's zeros changes nothing, so every position
takes them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.vision.families import Qwen2VL
from mlxcel_compat.vision.gguf_projector import Processor, ProjectorFile, ProjectorKind, qwen_vl_processor


def _deepstack_count(vlm: Any) -> int:
    return len(vlm.config.vision_config.deepstack_visual_indexes or [])


class Qwen3VL(Qwen2VL):
    """Qwen3-VL: Qwen2.5-VL's prompt side and positions (interleaved in the text model's RoPE), its
    features the merger's rows with the deepstack mergers' beside them (module docstring)."""

    model_types = ("qwen3_vl",)

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        tower = vlm.vision_tower
        pixels = mx.array(np.concatenate([img.pixel_values for img in images]))
        grid = mx.array(np.asarray([img.grid_thw for img in images], dtype=np.int64))
        merged, deepstack = tower(pixels.astype(tower.patch_embed.proj.weight.dtype), grid)
        return mx.concatenate([merged, *deepstack], axis=-1)

    def token_embeddings(self, vlm: Any, inputs: mx.array) -> mx.array:
        embeds = vlm.language_model.model.embed_tokens(inputs)
        extra = _deepstack_count(vlm) * embeds.shape[-1]
        if not extra:
            return embeds
        return mx.concatenate([embeds, mx.zeros((*embeds.shape[:-1], extra), embeds.dtype)], axis=-1)

    def hidden(self, language: Any, inputs: mx.array, cache: Any, embeds: mx.array | None,
               positions: mx.array | None) -> mx.array:
        width = int(language.args.hidden_size)
        if embeds is None or embeds.shape[-1] == width:
            return language.model(inputs, cache=cache, inputs_embeds=embeds, position_ids=positions)
        batch, length, total = embeds.shape
        deepstack = embeds[..., width:].reshape(batch * length, total // width - 1, width)
        return language.model(inputs, cache=cache, inputs_embeds=embeds[..., :width], position_ids=positions,
                              visual_pos_masks=mx.ones((batch, length), dtype=mx.bool_),
                              deepstack_visual_embeds=[deepstack[:, i] for i in range(deepstack.shape[1])])


class Qwen3VLProjector(ProjectorKind):
    """``qwen3vl_merger``, as the converter's ``Qwen3VLVisionModel`` writes it: the tower's blocks
    under gguf-py's names (``qkv`` fused, ``v.blk.N.attn_qkv``), the 3-D patch convolution split
    into two 2-D ones (``v.patch_embd.weight`` and ``.weight.1``), the merger's norm as
    ``v.post_ln`` and its two layers as ``mm.0`` and ``mm.2``, each deepstack merger under its
    tower block's index (``v.deepstack.N.{norm,fc1,fc2}``; ``clip.vision.is_deepstack_layers``
    flags those blocks). The text GGUF is ``qwen3vl`` (its M-RoPE sections as
    ``rope.dimension_sections``; ``gguf/arch_core.py``)."""

    types = ("qwen3vl_merger",)
    model_type = "qwen3_vl"

    @staticmethod
    def deepstack_blocks(projector: ProjectorFile) -> list[int]:
        flags = projector.metadata.get("clip.vision.is_deepstack_layers") or []
        return [i for i, flag in enumerate(flags) if flag]

    def vision_config(self, projector: ProjectorFile) -> dict[str, Any]:
        if "v.position_embd.weight" not in projector.names:
            raise ValueError(f"projector {projector.path} lacks tensor v.position_embd.weight")
        positions = int(projector.read("v.position_embd.weight").shape[0])
        return dict(model_type="qwen3_vl", depth=int(projector.vision("block_count")),
                    hidden_size=int(projector.vision("embedding_length")),
                    intermediate_size=int(projector.vision("feed_forward_length")),
                    out_hidden_size=int(projector.vision("projection_dim")),
                    num_heads=int(projector.vision("attention.head_count")),
                    patch_size=int(projector.vision("patch_size")),
                    spatial_merge_size=int(projector.vision("spatial_merge_size", 2)), temporal_patch_size=2,
                    in_channels=3, num_position_embeddings=positions,
                    deepstack_visual_indexes=self.deepstack_blocks(projector))

    def vlm_config(self, projector: ProjectorFile, text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
        sections = list(text.get("mrope_section") or [])
        if len(sections) != 3:
            raise ValueError("the text GGUF of a qwen3vl_merger projector needs qwen3vl's rope.dimension_sections")
        deepstack, layers = len(self.deepstack_blocks(projector)), int(text.get("n_deepstack_layers", 0))
        if deepstack != layers:  # llama.cpp's text model splits each image row by its own count
            raise ValueError(f"projector {projector.path} has {deepstack} deepstack mergers; its text GGUF "
                             f"takes {layers} (qwen3vl.n_deepstack_layers)")
        text_config = dict(text, model_type="qwen3_vl_text",
                           rope_scaling={"type": "default", "mrope_section": sections, "mrope_interleaved": True})
        return dict(model_type=self.model_type, text_config=text_config, vision_config=self.vision_config(projector),
                    vocab_size=int(text["vocab_size"]), eos_token_id=text.get("eos_token_id"),
                    image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids.get("<|video_pad|>", -1),
                    vision_start_token_id=token_ids["<|vision_start|>"],
                    vision_end_token_id=token_ids["<|vision_end|>"])

    def processor(self, projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
        return qwen_vl_processor(projector, min_tokens, max_tokens)

    def gguf_name(self, projector: ProjectorFile, mlx_name: str, names: Any) -> str | None:
        """The projector's tensor of an mlx-vlm parameter (the converter's hand-written names
        for the mergers; gguf-py's map for the rest)."""
        parts = mlx_name.removeprefix("vision_tower.").split(".")
        layer = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
        if parts[0] == "merger":
            return {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[parts[1]] + "." + parts[2]
        if parts[0] == "deepstack_merger_list":
            block = self.deepstack_blocks(projector)[int(parts[1])]
            return f"v.deepstack.{block}.{layer[parts[2]]}.{parts[3]}"
        return names.get_name("visual." + ".".join(parts), try_suffixes=(".weight", ".bias"))

    def weights(self, projector: ProjectorFile, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        import gguf

        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(int(projector.vision("block_count")), 3))
        out: dict[str, np.ndarray] = {}
        for mlx_name, shape in shapes.items():
            gguf_name = self.gguf_name(projector, mlx_name, names)
            if gguf_name is None:
                raise ValueError(f"projector {projector.path}: no GGUF tensor corresponds to {mlx_name}")
            needed = [gguf_name, gguf_name + ".1"] if gguf_name == "v.patch_embd.weight" else [gguf_name]
            if missing := [n for n in needed if n not in projector.names]:
                raise ValueError(f"projector {projector.path} lacks tensor {missing[0]} ({mlx_name})")
            if gguf_name == "v.patch_embd.weight":  # two 2-D convolutions, one per frame: MLX's (out, t, h, w, in)
                value = np.moveaxis(np.stack([projector.read(n) for n in needed], axis=2), 1, -1)
            else:
                value = projector.read(gguf_name)
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"projector {projector.path}: tensor {gguf_name} has shape {value.shape}; "
                                 f"mlx-vlm's {mlx_name} is {shape}")
            out[mlx_name] = np.ascontiguousarray(value)
        return out
