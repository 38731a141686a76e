"""The vision-language families served through mlx-vlm, one class each: every rule that differs
between them is here.

A family says, for its ``config.json`` ``model_type``:

- **prompt side** (:meth:`VisionFamily.facts`, plain data for the HTTP side, ``server/media.py``):
  what the chat template writes for one image part, which token of it the server expands, into
  how many image tokens and between which marker tokens, and which Hugging Face image processor
  (its PIL implementation, configured by the directory's ``preprocessor_config.json``) prepares
  the pixels;
- **model side** (engine thread, MLX): how the vision tower and projector turn a request's images
  into one feature row per image token (:meth:`VisionFamily.features`), the token positions
  (plain RoPE ``offset + index``, or Qwen's multimodal RoPE), the KV cache layers, and the
  language model's forward pass with the features in place of the image tokens' embeddings.

Each model side does what mlx-vlm's own ``generate`` path does for that family (its
``get_input_embeddings`` and ``language_model``), one prefill chunk at a time.

| family | template writes | one image becomes | features | positions |
|---|---|---|---|---|
| Qwen2-VL, Qwen2.5-VL | ``<|vision_start|><|image_pad|><|vision_end|>`` | the pad repeated ``t*h*w/merge**2`` | the tower over the patches | mrope (``get_rope_index``) |
| Gemma 3 | ``<start_of_image>`` | ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` x ``<image_soft_token>`` + ``<end_of_image>\\n\\n`` | SigLIP, pooled, normed, projected, divided by ``sqrt(hidden_size)`` (the text model multiplies every embedding by it) | plain |
| LLaVA | ``<image>`` | ``<image>`` repeated once per patch (plus one with the ``full`` strategy) | CLIP's hidden states at ``vision_feature_layer``, class token dropped (``default``), projected | plain |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class VisionFacts:
    """What the HTTP layer needs to know about the served model's image input (plain data, no MLX).

    A prompt holds ``marker`` once per image (the chat template writes it; a raw prompt's media
    marker becomes it); ``server/media.py`` replaces its ``expand_token`` by
    ``before + [image_token_id] * n + after``, ``n`` the image's token count
    (:meth:`image_token_count`)."""

    model_type: str
    image_token_id: int  # the tokens whose embeddings the image's feature rows replace
    marker: tuple[int, ...]  # what the chat template writes for one image part
    expand_token: int  # the token of ``marker`` that becomes the image's tokens
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    tokens_per_image: int = 0  # a fixed count; 0: from the processor's output (below)
    merge_size: int = 1  # Qwen: patches merged per side (``image_grid_thw`` / merge**2 tokens)
    patch_size: int = 14  # LLaVA: one token per patch of the processed image ...
    extra_tokens: int = 0  # ... plus this many (the class token, with the "full" strategy)
    processor: str = ""  # "module:Class" of the image processor (Hugging Face, PIL backend)
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    processor_dir: Path = Path(".")  # holds preprocessor_config.json

    def image_token_count(self, processed: Any) -> tuple[int, tuple[int, int, int]]:
        """``(tokens, grid_thw)`` of one image from its processor output; ``grid_thw`` is
        Qwen's patch grid, ``(1, 1, 1)`` for a family whose images have a fixed size."""
        if "image_grid_thw" in processed:
            grid = tuple(int(x) for x in processed["image_grid_thw"][0])
            return grid[0] * grid[1] * grid[2] // (self.merge_size ** 2), grid  # type: ignore[return-value]
        if self.tokens_per_image:
            return self.tokens_per_image, (1, 1, 1)
        height, width = processed["pixel_values"].shape[-2:]
        return (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens, (1, 1, 1)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


class VisionFamily:
    """The rules of one mlx-vlm family (the base: plain RoPE, one KV table per layer)."""

    model_types: tuple[str, ...] = ()
    # preprocessor_config.json image_processor_type -> "module:Class" (the first: when it names none)
    processors: dict[str, str] = {}
    mrope = False

    # ----- prompt side -----

    def facts(self, path: Path, config: dict[str, Any], tokenizer: Any) -> VisionFacts:
        raise NotImplementedError

    def processor_name(self, path: Path) -> str:
        import json

        kind = json.loads((path / "preprocessor_config.json").read_text(encoding="utf-8")).get("image_processor_type")
        kind = str(kind or "").removesuffix("Fast")
        if not kind:  # an older or converted directory that does not say: the family's own
            return next(iter(self.processors.values()))
        if kind not in self.processors:
            raise ValueError(f"image processor '{kind}' of {path} is not served for {self.model_types[0]}; "
                             f"supported: {', '.join(self.processors)}")
        return self.processors[kind]

    # ----- model side (engine thread) -----

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        """``(image tokens, hidden)``: one row per image token of ``images`` (``MediaImage``s), in order."""
        raise NotImplementedError

    def blank_image(self, vlm: Any) -> Any:
        """A ``MediaImage`` of zeros at the tower's input size (the load's warm-up)."""
        raise NotImplementedError

    def make_cache(self, vlm: Any) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in vlm.language_model.model.layers]

    def text_positions(self, start: int, length: int, batch: int = 1) -> mx.array | None:
        """Positions of tokens without images (``None``: the model's own ``offset + index``)."""
        return None

    def prompt_positions(self, vlm: Any, prompt: np.ndarray, images: list[Any]) -> tuple[mx.array, int] | None:
        """``(positions, delta)`` of a prompt with images, when they are not ``offset + index``."""
        return None

    def hidden(self, language: Any, inputs: mx.array, cache: Any, embeds: mx.array | None,
               positions: mx.array | None) -> mx.array:
        return language.model(inputs, inputs_embeds=embeds, cache=cache)


class Qwen2VL(VisionFamily):
    """Qwen2-VL and Qwen2.5-VL: images of any size cut into 14-pixel patches, merged 2x2; mrope."""

    model_types = ("qwen2_vl", "qwen2_5_vl")
    processors = {"Qwen2VLImageProcessor": "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil"}
    mrope = True

    def facts(self, path: Path, config: dict[str, Any], tokenizer: Any) -> VisionFacts:
        pad = int(config["image_token_id"])
        start, end = int(config.get("vision_start_token_id", -1)), int(config.get("vision_end_token_id", -1))
        return VisionFacts(
            model_type=str(config["model_type"]), image_token_id=pad,
            marker=tuple(t for t in (start, pad, end) if t >= 0), expand_token=pad,
            merge_size=int((config.get("vision_config") or {}).get("spatial_merge_size", 2)),
            processor=self.processor_name(path), processor_dir=path,
        )

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        tower = vlm.vision_tower
        pixels = mx.array(np.concatenate([img.pixel_values for img in images]))
        grid = mx.array(np.asarray([img.grid_thw for img in images], dtype=np.int64))
        return tower(pixels.astype(tower.patch_embed.proj.weight.dtype), grid, output_hidden_states=False)

    def blank_image(self, vlm: Any) -> Any:
        from mlxcel_compat.engine.request import MediaImage

        tower = vlm.vision_tower
        merge = int(getattr(tower, "spatial_merge_size", 2))
        weight = tower.patch_embed.proj.weight
        width = int(weight.size // weight.shape[0])
        return MediaImage(np.zeros((merge * merge, width), np.float32), (1, merge, merge), (0, 1))

    def text_positions(self, start: int, length: int, batch: int = 1) -> mx.array:
        return mx.broadcast_to(mx.arange(start, start + length)[None, None], (3, batch, length))

    def prompt_positions(self, vlm: Any, prompt: np.ndarray, images: list[Any]) -> tuple[mx.array, int]:
        grid = mx.array(np.asarray([img.grid_thw for img in images], dtype=np.int64))
        positions, deltas = vlm.language_model.get_rope_index(mx.array(prompt)[None], grid, None, None)
        return positions, int(deltas.reshape(-1)[0].item())

    def hidden(self, language: Any, inputs: mx.array, cache: Any, embeds: mx.array | None,
               positions: mx.array | None) -> mx.array:
        return language.model(inputs, cache=cache, inputs_embeds=embeds, position_ids=positions)


class _FixedSize(VisionFamily):
    """A family whose processor gives every image the tower's one input size (channels first)."""

    def blank_image(self, vlm: Any) -> Any:
        from mlxcel_compat.engine.request import MediaImage

        size = int(vlm.config.vision_config.image_size)
        return MediaImage(np.zeros((1, 3, size, size), np.float32), (1, 1, 1), (0, 1))


class Gemma3(_FixedSize):
    """Gemma 3 with vision: fixed-size images (``size`` of the processor), SigLIP, a pooled projection.

    As mlx-vlm's ``gemma3`` generates: the features are divided by ``sqrt(hidden_size)`` (the
    top-level config's) before they replace the image tokens' embeddings, because its text model
    multiplies every input embedding by ``sqrt(hidden_size)``; attention stays causal over image
    tokens too (mlx-vlm builds a 4-D mask but its language model does not use it). Pan-and-scan
    crops are off (the processor is called with ``do_pan_and_scan=False``). One difference: with
    images, mlx-vlm also zeroes the embeddings of ``pad_token_id`` tokens in the prompt; here they
    keep their embeddings, so the text before an image stays what a text-only request computes
    (the prompt cache shares it) — a rendered chat holds no pad tokens.

    The sliding-window layers keep every token's KV (a plain ``KVCache``; mlx-vlm's attention masks
    them to the window, so the logits are those of mlx-vlm's ``RotatingKVCache``), unlike the text
    model's rotating window: a rotating cache cannot be cut to a prefix, and the prompt cache's
    image rules (a hit ends before or after an image; the text before the first image is shared
    with other images) need that cut. The cost is the memory of a full KV on those layers."""

    model_types = ("gemma3",)
    processors = {"Gemma3ImageProcessor": "transformers.models.gemma3.image_processing_pil_gemma3:Gemma3ImageProcessorPil"}

    def facts(self, path: Path, config: dict[str, Any], tokenizer: Any) -> VisionFacts:
        text = _text_config(config)
        boi, eoi = int(config.get("boi_token_index", 255999)), int(config.get("eoi_token_index", 256000))
        # Gemma3Processor writes "\n\n" around the image's tokens.
        gap = tuple(int(t) for t in tokenizer.encode("\n\n", add_special_tokens=False))
        return VisionFacts(
            model_type="gemma3", image_token_id=int(config.get("image_token_index", 262144)),
            marker=(boi,), expand_token=boi, before=gap + (boi,), after=(eoi,) + gap,
            tokens_per_image=int(text.get("mm_tokens_per_image", config.get("mm_tokens_per_image", 256))),
            processor=self.processor_name(path), processor_kwargs={"do_pan_and_scan": False}, processor_dir=path,
        )

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        # mlx-vlm casts to the embeddings' dtype; the tower's weight has it too, and stays a float
        # where a quantized checkpoint packs the embedding table into integers.
        dtype = vlm.vision_tower.vision_model.embeddings.patch_embedding.weight.dtype
        pixels = mx.array(np.concatenate([img.pixel_values for img in images])).transpose(0, 2, 3, 1)
        hidden, _, _ = vlm.vision_tower(pixels.astype(dtype), output_hidden_states=True)
        projected = vlm.multi_modal_projector(hidden)
        projected = projected / (vlm.config.hidden_size ** 0.5)
        return projected.reshape(-1, projected.shape[-1])

class Llava(_FixedSize):
    """LLaVA (1.5-style): fixed-size images (center-cropped), CLIP, a 2-layer GELU projector."""

    model_types = ("llava",)
    processors = {
        "CLIPImageProcessor": "transformers.models.clip.image_processing_pil_clip:CLIPImageProcessorPil",
        "LlavaImageProcessor": "transformers.models.llava.image_processing_pil_llava:LlavaImageProcessorPil",
    }

    def facts(self, path: Path, config: dict[str, Any], tokenizer: Any) -> VisionFacts:
        image = int(config.get("image_token_index", 32000))
        strategy = config.get("vision_feature_select_strategy", "default")
        return VisionFacts(
            model_type="llava", image_token_id=image, marker=(image,), expand_token=image,
            patch_size=int((config.get("vision_config") or {}).get("patch_size", 14)),
            extra_tokens=0 if strategy == "default" else 1,
            processor=self.processor_name(path), processor_dir=path,
        )

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        pixels = mx.array(np.concatenate([img.pixel_values for img in images])).transpose(0, 2, 3, 1)
        *_, states = vlm.vision_tower(pixels, output_hidden_states=True)
        layer = vlm.vision_feature_layer
        default = vlm.vision_feature_select_strategy == "default"
        if isinstance(layer, int):
            selected = states[layer][:, 1:] if default else states[layer]
        else:
            selected = mx.concatenate([states[i][:, 1:] if default else states[i] for i in layer], axis=-1)
        projected = vlm.multi_modal_projector(selected)
        return projected.reshape(-1, projected.shape[-1])


FAMILIES: dict[str, VisionFamily] = {t: f for f in (Qwen2VL(), Gemma3(), Llava()) for t in f.model_types}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(config: dict[str, Any]) -> VisionFamily:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"vision model type '{model_type}' is not served yet; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return FAMILIES[model_type]
