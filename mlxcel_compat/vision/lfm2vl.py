"""LFM2-VL: its family rules (a directory through mlx-vlm's ``lfm2_vl``) and its GGUF projector
(``clip.projector_type`` ``lfm2``).

- **images** (``vision/lfm2vl_images.py``, the HTTP side): one view at the image's own aspect
  ratio, or ``tile_size`` tiles and a thumbnail, each view packed into patches for the SigLIP2
  NaFlex tower with its patch grid (``spatial_shapes``, carried in ``MediaImage.spatial_shapes``);
  the prompt's ``<image>`` becomes ``<|image_start|>``, the tiles' ``<|img_row_R_col_C|>`` markers
  and tokens, ``<|img_thumbnail|>`` and the thumbnail's tokens, ``<|image_end|>``;
- **the tower**: SigLIP2 NaFlex (learned position embeddings resized to each view's grid, attention
  over the view's real patches only), then per view the pixel unshuffle by ``downsample_factor``
  and the projector (LayerNorm, linear, GELU, linear): mlx-vlm's ``encode_images``;
- **the text model**: LFM2, a hybrid of short-convolution layers (a state of the last
  ``conv_L_cache - 1`` inputs) and attention layers; mlx-lm's ``lfm2`` holding the checkpoint's
  text weights, in place of mlx-vlm's copy (the same layers), so its cache is mlx-lm's:
  ``ArraysCache`` for the convolutions, ``KVCache`` for attention. Plain positions, causal.

**The prompt cache**: a convolution state cannot be cut back to a prefix, so the cache keeps whole
states for this model, as for every hybrid text model (session snapshots, ``cache/snapshot.py``;
``docs/prompt-cache.md``): a finished turn's state is kept under its session with the request's
``mm_digest`` in the key, and the next turn about the same image, whose prompt starts with those
tokens, restores it whole and prefills only what follows (images included in the restored part:
their tower does not run again).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.vision.families import VisionFacts, VisionFamily
from mlxcel_compat.vision.gguf_projector import Processor, ProjectorFile, ProjectorKind
from mlxcel_compat.vision.lfm2vl_images import DEFAULTS, Lfm2VlLayout

LFM2VL_PROCESSOR = "mlxcel_compat.vision.lfm2vl_images:Lfm2VlImageProcessorPil"


def processor_settings(processor_dir: Path, processor_config: dict[str, Any] | None) -> dict[str, Any]:
    """Lfm2VlImageProcessor's settings: its defaults, overridden by the given config or the
    directory's ``preprocessor_config.json``."""
    if processor_config is None:
        processor_config = json.loads((processor_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
    return {**DEFAULTS, **processor_config}


def lfm2_language_model(text_config: dict[str, Any], mlx_vlm_language: Any) -> Any:
    """mlx-lm's LFM2 with the weights of mlx-vlm's LFM2-VL ``LanguageModel`` (tied embeddings)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import lfm2

    model = lfm2.Model(lfm2.ModelArgs.from_dict(dict(text_config, model_type="lfm2")))
    weights = [(name, value) for name, value in tree_flatten(mlx_vlm_language.parameters()) if not name.startswith("lm_head.")]
    model.load_weights(weights, strict=True)
    model.eval()
    return model


class Lfm2Vl(VisionFamily):
    """LFM2-VL (``lfm2_vl``): NaFlex views of each image, pixel unshuffle and projector, the LFM2
    hybrid text model (module docstring)."""

    model_types = ("lfm2_vl", "lfm2-vl")
    processors = {"Lfm2VlImageProcessor": LFM2VL_PROCESSOR}

    def facts_from(self, config: dict[str, Any], tokenizer: Any, processor: str,
                   processor_config: dict[str, Any] | None, processor_dir: Path = Path(".")) -> VisionFacts:
        settings = processor_settings(processor_dir, processor_config)
        vocab = tokenizer.get_vocab()
        image = int(config.get("image_token_id", config.get("image_token_index", vocab.get("<image>", 396))))
        special = bool(config.get("use_image_special_tokens", True))

        def one(text: str) -> tuple[int, ...]:
            # one vocabulary entry, as LFM2-VL's tokenizer has them; else the text's tokens, as
            # Lfm2VlProcessor's string and llama.cpp's mtmd would tokenize it
            if not special:
                return ()
            return (int(vocab[text]),) if text in vocab else tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))

        grid = int(settings["max_tiles"])  # a grid has at most max_tiles rows or columns
        markers = tuple(tuple(one(f"<|img_row_{r}_col_{c}|>") if r * c <= grid else () for c in range(1, grid + 1))
                        for r in range(1, grid + 1))
        factor = int(settings["downsample_factor"])
        side = -(-(int(settings["tile_size"]) // int(settings["encoder_patch_size"])) // factor)
        layout = Lfm2VlLayout(downsample_factor=factor, tokens_per_tile=side * side, image_start=one("<|image_start|>"),
                              image_end=one("<|image_end|>"), thumbnail=one("<|img_thumbnail|>"), tile_markers=markers)
        return VisionFacts(model_type="lfm2_vl", image_token_id=image, marker=(image,), expand_token=image, layout=layout,
                           processor=processor, processor_dir=processor_dir, processor_config=processor_config)

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        pixels = np.concatenate([np.asarray(img.pixel_values) for img in images])
        shapes = np.asarray([shape for img in images for shape in img.spatial_shapes], np.int64).reshape(-1, 2)
        if len(shapes) != len(pixels):
            raise ValueError(f"{len(pixels)} views with {len(shapes)} patch grids")
        mask = (np.arange(pixels.shape[1])[None, :] < (shapes[:, 0] * shapes[:, 1])[:, None]).astype(np.int32)
        dtype = vlm.vision_tower.embeddings.patch_embedding.weight.dtype
        views = vlm.encode_images(mx.array(pixels).astype(dtype), spatial_shapes=mx.array(shapes),
                                  pixel_attention_mask=mx.array(mask))
        return mx.concatenate(list(views), axis=0)

    def blank_image(self, vlm: Any) -> Any:
        from mlxcel_compat.vision.inputs import MediaImage

        factor = int(vlm.config.downsample_factor)
        width = int(vlm.vision_tower.embeddings.patch_embedding.weight.shape[1])
        return MediaImage(np.zeros((1, factor * factor, width), np.float32), (1, 1, 1), (0, 1), ((factor, factor),))

    def load(self, path: Path) -> Any:
        vlm = super().load(path)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        vlm.language_model = lfm2_language_model(config["text_config"], vlm.language_model)
        return vlm

    def make_cache(self, vlm: Any) -> list[Any]:
        return vlm.language_model.make_cache()

    def text_model(self, vlm: Any) -> Any:
        return vlm.language_model  # mlx-lm's LFM2 (lfm2_language_model), plain positions

    def hidden(self, language: Any, inputs: mx.array, cache: Any, embeds: mx.array | None,
               positions: mx.array | None) -> mx.array:
        return language.model(inputs, cache=cache, input_embeddings=embeds)


class Lfm2VlProjector(ProjectorKind):
    """``lfm2``, as the converter's ``LFM2VLModel`` writes it: the SigLIP2 tower under gguf-py's
    names (its linear patch embedding as a ``(width, 3, patch, patch)`` convolution, the position
    table as ``v.position_embd``, blocks past ``vision_feature_layer`` dropped from
    ``block_count``), the projector's LayerNorm as ``mm.input_norm`` and its layers as ``mm.1`` and
    ``mm.2``, the pixel unshuffle's factor as ``projector.scale_factor``. The text GGUF is ``lfm2``,
    whole: mlx-lm's LFM2 on the block kernels, as the family runs a directory's.

    Images are prepared as llama.cpp's mtmd prepares them (its settings are fixed, not in the
    file): 64 to 256 tokens a view (``--image-min-tokens`` / ``--image-max-tokens``), 512-pixel
    tiles, 2 to 10 of them and a thumbnail past twice the most, bilinear resampling."""

    types = ("lfm2",)
    model_type = "lfm2_vl"
    whole_text_model = True
    TILE_SIZE, MIN_TILES, MAX_TILES, MIN_TOKENS, MAX_TOKENS = 512, 2, 10, 64, 256  # clip.cpp / mtmd-image.h

    def vlm_config(self, projector: ProjectorFile, text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
        for needed in ("v.position_embd.weight", "mm.1.weight"):
            if needed not in projector.names:
                raise ValueError(f"projector {projector.path} lacks tensor {needed}")
        patch = int(projector.vision("patch_size"))
        vision = dict(model_type="siglip2_vision_model", num_hidden_layers=int(projector.vision("block_count")),
                      hidden_size=int(projector.vision("embedding_length")),
                      intermediate_size=int(projector.vision("feed_forward_length")),
                      num_attention_heads=int(projector.vision("attention.head_count")), num_channels=3,
                      patch_size=patch, image_size=int(projector.vision("image_size")),
                      num_patches=int(projector.read("v.position_embd.weight").shape[0]),
                      layer_norm_eps=float(projector.vision("attention.layer_norm_epsilon", 1e-6)), vision_use_head=False)
        return dict(model_type="lfm2_vl", text_config=dict(text, model_type="lfm2"), vision_config=vision,
                    vocab_size=int(text["vocab_size"]), image_token_id=token_ids["<image>"],
                    downsample_factor=int(projector.metadata.get("clip.vision.projector.scale_factor") or 2),
                    encoder_patch_size=patch, projector_hidden_size=int(projector.read("mm.1.weight").shape[0]),
                    projector_bias=True, projector_use_layernorm="mm.input_norm.weight" in projector.names,
                    vision_feature_layer=-1, max_tiles=self.MAX_TILES, eos_token_id=text.get("eos_token_id"))

    def processor(self, projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
        config = dict(DEFAULTS, encoder_patch_size=int(projector.vision("patch_size")),
                      downsample_factor=int(projector.metadata.get("clip.vision.projector.scale_factor") or 2),
                      min_image_tokens=min_tokens or self.MIN_TOKENS, max_image_tokens=max_tokens or self.MAX_TOKENS,
                      tile_size=self.TILE_SIZE, min_tiles=self.MIN_TILES, max_tiles=self.MAX_TILES, resample=2,
                      image_mean=[float(x) for x in projector.vision("image_mean")],
                      image_std=[float(x) for x in projector.vision("image_std")])
        return Processor(LFM2VL_PROCESSOR, config)

    def checkpoint_name(self, mlx_name: str) -> str:
        if mlx_name.startswith("vision_tower."):  # mlx-vlm drops the checkpoint's "vision_model."
            return "vision_tower.vision_model." + mlx_name.removeprefix("vision_tower.")
        return mlx_name

    def read(self, projector: ProjectorFile, mlx_name: str, gguf_name: str) -> np.ndarray:
        value = projector.read(gguf_name)
        if mlx_name.endswith("patch_embedding.weight"):  # (width, 3, p, p) back to the linear's (width, p * p * 3)
            return np.ascontiguousarray(value.transpose(0, 2, 3, 1).reshape(value.shape[0], -1))
        return value
