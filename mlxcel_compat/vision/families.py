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
| Idefics3, SmolVLM | ``<image>`` | each tile's ``<fake_token_around_image><row_r_col_c>`` + its tokens, then the whole image's (:class:`TileLayout`) | SigLIP per tile, pixel shuffle, linear | plain |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.vision.tiles import TileLayout, llama_language_model


@dataclass(frozen=True)
class AudioFacts:
    """The prompt-side facts of a family's audio input (plain data): the template writes ``marker``
    once per audio part; ``server/media.py`` replaces its ``expand_token`` by ``before +
    [audio_token_id] * tokens_per_clip + after`` and prepares the samples with the family's Hugging
    Face feature extractor (configured by ``preprocessor_config.json``)."""

    audio_token_id: int
    marker: tuple[int, ...]
    expand_token: int
    before: tuple[int, ...]
    after: tuple[int, ...]
    tokens_per_clip: int  # every clip takes this many tokens (the features are padded to it)
    sampling_rate: int  # the extractor's input rate: decoded audio is resampled to it
    max_samples: int  # the longest clip the tokens hold (longer: 400, never cut)
    extractor: str  # "module:Class" of the feature extractor
    extractor_dir: Path = Path(".")


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
    # The processor's settings when no preprocessor_config.json holds them (a GGUF projector's
    # metadata, vision/gguf_projector.py): the processor is built from these instead.
    processor_config: dict[str, Any] | None = None
    tiles: TileLayout | None = None  # an image cut into tiles (Idefics3): its tokens interleave text
    tokens_per_tile: int = 0  # InternVL: an image's tiles (pixel_values' first axis) take this many tokens each
    images: bool = True  # the family's images are served (Gemma 3n: not yet, its audio is)
    # Pixtral / Mistral 3: a row of merged patches ends with this token (the last row with ``image_end``);
    # the patch grid comes from the processor's ``image_sizes`` (``patch_size`` pixels, ``merge_size`` per side)
    row_break: int = -1
    image_end: int = -1
    audio: AudioFacts | None = None  # the family's audio input, when it has an audio tower
    # A family's own image layout (LFM2-VL: vision/lfm2vl_images.py): ``count(processed) -> (tokens,
    # grid)`` and ``tokens(image_token_id, count, grid) -> list[int]``, the whole expansion.
    layout: Any = None

    def image_token_count(self, processed: Any) -> tuple[int, tuple[int, int, int]]:
        """``(tokens, grid_thw)`` of one image from its processor output; ``grid_thw`` is
        Qwen's patch grid, ``(1, 1, 1)`` for a family whose images have a fixed size."""
        if self.layout is not None:
            return self.layout.count(processed)
        if self.tiles is not None:  # (1, tiles, 3, H, W); the grid from return_row_col_info (absent: one tile)
            tiles = int(np.asarray(processed["pixel_values"]).shape[1])
            rows, cols = (int(np.asarray(processed[k]).reshape(-1)[0]) if k in processed else 0 for k in ("rows", "cols"))
            return tiles * self.tiles.tokens_per_tile, (1, rows, cols)
        if self.row_break >= 0:  # (1, 3, H, W) of whole merged patches: grid_thw is the patch grid
            sizes = processed.get("image_sizes")
            height, width = (np.asarray(sizes).reshape(-1)[:2] if sizes is not None
                             else np.asarray(processed["pixel_values"]).shape[-2:])
            grid = (1, int(height) // self.patch_size, int(width) // self.patch_size)
            return (grid[1] // self.merge_size) * (grid[2] // self.merge_size), grid
        if self.tokens_per_tile:  # (tiles, 3, H, W): the tiles' tokens one after another
            return int(np.asarray(processed["pixel_values"]).shape[0]) * self.tokens_per_tile, (1, 1, 1)
        if "image_grid_thw" in processed:
            grid = tuple(int(x) for x in processed["image_grid_thw"][0])
            return grid[0] * grid[1] * grid[2] // (self.merge_size ** 2), grid  # type: ignore[return-value]
        if self.tokens_per_image:
            return self.tokens_per_image, (1, 1, 1)
        height, width = processed["pixel_values"].shape[-2:]
        return (height // self.patch_size) * (width // self.patch_size) + self.extra_tokens, (1, 1, 1)

    def image_tokens(self, count: int, grid: tuple[int, int, int]) -> list[int]:
        """The tokens one image of ``count`` image tokens becomes (between ``before`` and ``after``)."""
        if self.layout is not None:
            return self.layout.tokens(self.image_token_id, count, grid)
        if self.tiles is not None:
            return self.tiles.tokens(self.image_token_id, grid[1], grid[2])
        if self.row_break >= 0:  # each row of merged patches, then [IMG_BREAK]; the last one's [IMG_END]
            rows, cols = grid[1] // self.merge_size, grid[2] // self.merge_size
            tokens = ([self.image_token_id] * cols + [self.row_break]) * rows
            tokens[-1] = self.image_end
            return tokens
        return [self.image_token_id] * count


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
        return self.facts_from(config, tokenizer, self.processor_name(path), None, path)

    def facts_from(self, config: dict[str, Any], tokenizer: Any, processor: str,
                   processor_config: dict[str, Any] | None, processor_dir: Path = Path(".")) -> VisionFacts:
        """The facts of ``config`` with its image processor: ``processor`` ("module:Class"),
        configured from ``processor_dir``'s ``preprocessor_config.json`` or by ``processor_config``."""
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

    def text_model(self, vlm: Any) -> Any:
        """The mlx-lm language model whose steps are this family's steps on tokens without media
        (the same cache, plain positions: ``vlm.language_model`` called as mlx-lm calls it), which
        the CPU decode runtime may then run; None where they differ (M-RoPE, mlx-vlm's own text
        modules)."""
        return None

    def text_positions(self, start: int, length: int, batch: int = 1) -> mx.array | None:
        """Positions of tokens without images (``None``: the model's own ``offset + index``)."""
        return None

    def prompt_positions(self, vlm: Any, prompt: np.ndarray, images: list[Any]) -> tuple[mx.array, int] | None:
        """``(positions, delta)`` of a prompt with images, when they are not ``offset + index``."""
        return None

    def hidden(self, language: Any, inputs: mx.array, cache: Any, embeds: mx.array | None,
               positions: mx.array | None) -> mx.array:
        return language.model(inputs, inputs_embeds=embeds, cache=cache)

    def logits(self, language: Any, hidden: mx.array) -> mx.array:
        head = getattr(language, "lm_head", None)  # absent when tied to the embeddings
        return head(hidden) if head is not None else language.model.embed_tokens.as_linear(hidden)

    def load(self, path: Path) -> Any:
        from mlx_vlm.utils import load_model

        return load_model(path)

    def token_embeddings(self, vlm: Any, inputs: mx.array) -> mx.array:
        """The input embeddings of ``inputs`` that media features are merged into."""
        return vlm.language_model.model.embed_tokens(inputs)

    def text_embeddings(self, vlm: Any, inputs: mx.array) -> mx.array | None:
        """Embeddings for a chunk without media rows (``None``: the text model embeds the tokens)."""
        return None

    def audio_features(self, vlm: Any, clips: list[Any]) -> mx.array:
        """``(audio tokens, hidden)``: one row per audio token of ``clips`` (``MediaAudio``s), in order."""
        raise NotImplementedError


class Qwen2VL(VisionFamily):
    """Qwen2-VL and Qwen2.5-VL: images of any size cut into 14-pixel patches, merged 2x2; mrope."""

    model_types = ("qwen2_vl", "qwen2_5_vl")
    processors = {"Qwen2VLImageProcessor": "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil"}
    mrope = True

    def facts_from(self, config: dict[str, Any], tokenizer: Any, processor: str,
                   processor_config: dict[str, Any] | None, processor_dir: Path = Path(".")) -> VisionFacts:
        pad = int(config["image_token_id"])
        start, end = int(config.get("vision_start_token_id", -1)), int(config.get("vision_end_token_id", -1))
        return VisionFacts(
            model_type=str(config["model_type"]), image_token_id=pad,
            marker=tuple(t for t in (start, pad, end) if t >= 0), expand_token=pad,
            merge_size=int((config.get("vision_config") or {}).get("spatial_merge_size", 2)),
            processor=processor, processor_dir=processor_dir, processor_config=processor_config,
        )

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        tower = vlm.vision_tower
        pixels = mx.array(np.concatenate([img.pixel_values for img in images]))
        grid = mx.array(np.asarray([img.grid_thw for img in images], dtype=np.int64))
        return tower(pixels.astype(tower.patch_embed.proj.weight.dtype), grid, output_hidden_states=False)

    def blank_image(self, vlm: Any) -> Any:
        from mlxcel_compat.vision.inputs import MediaImage

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
        from mlxcel_compat.vision.inputs import MediaImage

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

    def facts_from(self, config: dict[str, Any], tokenizer: Any, processor: str,
                   processor_config: dict[str, Any] | None, processor_dir: Path = Path(".")) -> VisionFacts:
        text = _text_config(config)
        boi, eoi = int(config.get("boi_token_index", 255999)), int(config.get("eoi_token_index", 256000))
        # Gemma3Processor writes "\n\n" around the image's tokens.
        gap = tuple(int(t) for t in tokenizer.encode("\n\n", add_special_tokens=False))
        return VisionFacts(
            model_type="gemma3", image_token_id=int(config.get("image_token_index", 262144)),
            marker=(boi,), expand_token=boi, before=gap + (boi,), after=(eoi,) + gap,
            tokens_per_image=int(text.get("mm_tokens_per_image", config.get("mm_tokens_per_image", 256))),
            processor=processor, processor_kwargs={"do_pan_and_scan": False}, processor_dir=processor_dir,
            processor_config=processor_config,
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

    def facts_from(self, config: dict[str, Any], tokenizer: Any, processor: str,
                   processor_config: dict[str, Any] | None, processor_dir: Path = Path(".")) -> VisionFacts:
        image = int(config.get("image_token_index", 32000))
        strategy = config.get("vision_feature_select_strategy", "default")
        return VisionFacts(
            model_type="llava", image_token_id=image, marker=(image,), expand_token=image,
            patch_size=int((config.get("vision_config") or {}).get("patch_size", 14)),
            extra_tokens=0 if strategy == "default" else 1,
            processor=processor, processor_dir=processor_dir, processor_config=processor_config,
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


class Idefics3(VisionFamily):
    """Idefics3 and SmolVLM: the image resized to ``size.longest_edge``, cut into tiles of the
    tower's size plus the whole image shrunk to one tile (Idefics3ImageProcessor), each tile through
    SigLIP, pixel-shuffled by ``scale_factor`` and projected (the connector); the tiles' tokens
    interleave ``<fake_token_around_image><row_r_col_c>`` markers (:class:`TileLayout`).

    The language model is mlx-lm's Llama holding the checkpoint's text weights, in place of
    mlx-vlm's own copy of it (the same layers, RoPE and norms): a GGUF pair's text model, loaded
    by ``gguf/load.py`` on the block kernels, then takes that place whole (``vision/gguf_model.py``)."""

    model_types = ("idefics3", "smolvlm")
    processors = {
        "SmolVLMImageProcessor": "transformers.models.smolvlm.image_processing_pil_smolvlm:SmolVLMImageProcessorPil",
        "Idefics3ImageProcessor": "transformers.models.idefics3.image_processing_pil_idefics3:Idefics3ImageProcessorPil",
    }
    MAX_GRID = 8  # rows and columns whose <row_r_col_c> markers the prompt side tokenizes

    def facts_from(self, config: dict[str, Any], tokenizer: Any, processor: str,
                   processor_config: dict[str, Any] | None, processor_dir: Path = Path(".")) -> VisionFacts:
        vision = config.get("vision_config") or {}
        side = int(vision.get("image_size", 384)) // int(vision.get("patch_size", 14))
        image = int(config.get("image_token_id", config.get("image_token_index", 49153)))

        vocab = tokenizer.get_vocab()

        def ids(text: str) -> tuple[int, ...]:
            return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))

        def piece(text: str) -> tuple[int, ...]:
            # One vocabulary entry that is this text, as llama.cpp's mtmd looks it up (spelled as is, or in
            # byte-level BPE's letters: a GGUF's tokenizer lists an added "\n\n" as "ĊĊ"); else the text's tokens.
            for spelling in (text, text.replace("\n", "\u010a")):
                if spelling in vocab:
                    return (int(vocab[spelling]),)
            return ids(text)

        prefixes = tuple(tuple(ids(f"<fake_token_around_image><row_{r}_col_{c}>") for c in range(1, self.MAX_GRID + 1))
                         for r in range(1, self.MAX_GRID + 1))
        layout = TileLayout(tokens_per_tile=(side // int(config.get("scale_factor", 2))) ** 2, tile_prefix=prefixes,
                            row_end=piece("\n"), gap=piece("\n\n"), global_start=ids("<fake_token_around_image><global-img>"),
                            global_end=ids("<fake_token_around_image>"))
        return VisionFacts(model_type=str(config["model_type"]), image_token_id=image, marker=(image,), expand_token=image,
                           tiles=layout, processor=processor, processor_kwargs={"return_row_col_info": True},
                           processor_dir=processor_dir, processor_config=processor_config)

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        tiles = np.concatenate([np.asarray(img.pixel_values).reshape(-1, *img.pixel_values.shape[-3:]) for img in images])
        tower = vlm.vision_model
        pixels = mx.array(tiles).transpose(0, 2, 3, 1).astype(tower.embeddings.patch_embedding.weight.dtype)
        hidden, *_ = tower(pixels)
        projected = vlm.connector(hidden)
        return projected.reshape(-1, projected.shape[-1])

    def blank_image(self, vlm: Any) -> Any:
        from mlxcel_compat.vision.inputs import MediaImage

        size = int(vlm.config.vision_config.image_size)
        return MediaImage(np.zeros((1, 1, 3, size, size), np.float32), (1, 0, 0), (0, 1))

    def load(self, path: Path) -> Any:
        import json

        vlm = super().load(path)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        vlm.language_model = llama_language_model(config["text_config"], vlm.language_model)
        return vlm

    def hidden(self, language: Any, inputs: mx.array, cache: Any, embeds: mx.array | None,
               positions: mx.array | None) -> mx.array:
        return language.model(inputs, cache=cache, input_embeddings=embeds)


class _SharedKV:
    """One KV layer for one forward pass, as Gemma 3n's KV-sharing layers need it: ``state`` is the
    keys and values held so far, this chunk's included (mlx-lm's cache, which the engine keeps,
    gives its whole buffer), and ``offset`` stays the pass's first position. mlx-vlm 0.7.10's
    sharing layers read the offset after the layer they share has stored the chunk, so their
    queries' RoPE positions run ahead by the chunk's length and the logits depend on the chunking;
    Hugging Face's model gives every layer the tokens' own positions, as this does."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.offset = layer.offset

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.layer.keys[..., : self.layer.offset, :], self.layer.values[..., : self.layer.offset, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.layer.update_and_fetch(keys, values)

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer.make_mask(*args, **kwargs)


class Gemma3n(VisionFamily):
    """Gemma 3n's audio: a USM-style conformer over log-mel features, every clip padded to
    ``audio_soft_tokens_per_image`` tokens (188: 30 s), between ``<start_of_audio>`` and
    ``<end_of_audio>``, as Gemma3nProcessor writes them.

    As Hugging Face's Gemma3nModel embeds a prompt: text tokens through ``embed_tokens`` scaled by
    ``sqrt(hidden_size)``, the vision and audio vocabularies' tokens (``<end_of_audio>`` among them)
    through their own embedders, the audio tokens replaced by the tower's rows (padding frames: the
    audio vocabulary's last embedding); per-layer inputs from the token ids. One difference from
    mlx-vlm 0.7.10: its ``get_input_embeddings`` leaves the text tokens unscaled when a prompt has
    media, unlike its text-only path; here both scale, so the text before a clip is what a
    text-only request computes (the prompt cache shares it). Every layer keeps a full KV (the
    sliding-window layers masked to the window, as for Gemma 3), so a cache hit can end anywhere
    outside a clip. The KV-sharing layers' queries take the tokens' own positions (``_SharedKV``;
    mlx-vlm's run ahead by the chunk's length). Images are not served (its MobileNetV5 tower is
    not wired here)."""

    model_types = ("gemma3n",)
    extractors = {"Gemma3nAudioFeatureExtractor":
                  "transformers.models.gemma3n.feature_extraction_gemma3n:Gemma3nAudioFeatureExtractor"}
    REDUCTION = 16  # mel frames per audio token: two stride-2 convolutions, then the conformer's 4x reduction
    EXTRACTOR_MAX_SAMPLES = 480_000  # Gemma3nAudioFeatureExtractor's default max_length (30 s at 16 kHz)

    def processor_name(self, path: Path) -> str:
        return ""  # images are not served for this family

    def facts(self, path: Path, config: dict[str, Any], tokenizer: Any) -> VisionFacts:
        import json

        pre = json.loads((path / "preprocessor_config.json").read_text(encoding="utf-8"))
        kind = str(pre.get("feature_extractor_type") or "Gemma3nAudioFeatureExtractor")
        if kind not in self.extractors:
            raise ValueError(f"feature extractor '{kind}' of {path} is not served for gemma3n; "
                             f"supported: {', '.join(self.extractors)}")
        rate = int(pre.get("sampling_rate", 16000))
        hop = int(round(rate * float(pre.get("hop_length_ms", 10.0)) / 1000.0))
        tokens = int(config.get("audio_soft_tokens_per_image", 188))
        audio_token, boa = int(config.get("audio_token_id", 262273)), int(config.get("boa_token_id", 256000))
        gap = tuple(int(t) for t in tokenizer.encode("\n\n", add_special_tokens=False))
        audio = AudioFacts(
            audio_token_id=audio_token, marker=(audio_token,), expand_token=audio_token,
            before=gap + (boa,), after=(int(config.get("eoa_token_id", 262272)),) + gap, tokens_per_clip=tokens,
            sampling_rate=rate, max_samples=min(tokens * self.REDUCTION * hop, self.EXTRACTOR_MAX_SAMPLES),
            extractor=self.extractors[kind],
            extractor_dir=path)
        image = int(config.get("image_token_id", 262145))
        return VisionFacts(model_type="gemma3n", image_token_id=image, marker=(image,), expand_token=image,
                           images=False, audio=audio, processor_dir=path)

    def load(self, path: Path) -> Any:
        """mlx-vlm's loader; a directory without the vision tower's weights (an audio-and-text one,
        as the test factory writes, already in mlx-vlm's names and layouts) loads without it."""
        import json

        import mlx.core as mx

        files = sorted(path.glob("*.safetensors"))
        names = {k for f in files for k in mx.load(str(f)).keys()}
        if any(k.startswith("vision_tower.") for k in names):
            return super().load(path)
        from mlx_vlm.utils import get_model_and_args

        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        module, _ = get_model_and_args(config)
        model_config = module.ModelConfig.from_dict(config)
        model_config.text_config = module.TextConfig.from_dict(config["text_config"])
        model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
        model_config.audio_config = module.AudioConfig.from_dict(config["audio_config"])
        vlm = module.Model(model_config)
        vlm.vision_tower = None
        weights: dict[str, Any] = {}
        for f in files:
            weights.update(mx.load(str(f)))
        vlm.load_weights(list(weights.items()), strict=True)
        vlm.eval()
        return vlm

    def make_cache(self, vlm: Any) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in range(vlm.language_model.model.first_kv_shared_layer_idx)]

    def token_embeddings(self, vlm: Any, inputs: mx.array) -> mx.array:
        model = vlm.language_model.model
        embeds = model.embed_tokens(inputs) * (model.hidden_size ** 0.5)
        for embedder, upper in ((vlm.embed_vision, vlm.embed_audio.vocab_offset), (vlm.embed_audio, None)):
            if embedder is None:
                continue
            low = embedder.vocab_offset
            inside = inputs >= low if upper is None else mx.logical_and(inputs >= low, inputs < upper)
            safe = mx.where(inside, inputs, low + embedder.vocab_size - 1)
            embeds = mx.where(inside[..., None], embedder(input_ids=safe).astype(embeds.dtype), embeds)
        return embeds

    def text_embeddings(self, vlm: Any, inputs: mx.array) -> mx.array | None:
        # Only a chunk with tokens of the vision or audio vocabulary needs their embedders.
        if not bool((inputs >= vlm.language_model.model.vocab_size_per_layer_input).any().item()):
            return None
        return self.token_embeddings(vlm, inputs)

    def audio_features(self, vlm: Any, clips: list[Any]) -> mx.array:
        pad_id = mx.array([[vlm.language_model.model.vocab_size - 1]])
        padding = vlm.embed_audio(input_ids=pad_id)[0]
        tokens = int(vlm.config.audio_soft_tokens_per_image)
        rows = []
        for clip in clips:
            features = mx.array(clip.features)
            mask = mx.array(clip.mask)
            encoded, padded = vlm.audio_tower(features, ~mask)
            embedded = vlm.embed_audio(inputs_embeds=encoded)[0]
            embedded = mx.where(padded[0][:, None], padding, embedded)
            if embedded.shape[0] > tokens:
                raise ValueError(f"the audio tower gives {embedded.shape[0]} rows for a clip of {tokens} tokens")
            extra = mx.broadcast_to(padding, (tokens - embedded.shape[0], padding.shape[-1]))
            rows.append(mx.concatenate([embedded, extra.astype(embedded.dtype)], axis=0))
        return mx.concatenate(rows, axis=0)

    def logits(self, language: Any, hidden: mx.array) -> mx.array:
        out = language.model.embed_tokens.as_linear(hidden)
        cap = language.final_logit_softcapping
        return out if not cap else mx.tanh(out / cap) * cap

    def hidden(self, language: Any, inputs: mx.array, cache: Any, embeds: mx.array | None,
               positions: mx.array | None) -> mx.array:
        layers = [_SharedKV(layer) for layer in cache] if cache else cache
        if embeds is None:
            return language.model(inputs, cache=layers)
        per_layer = language.model.get_per_layer_inputs(inputs)
        return language.model(inputs, inputs_embeds=embeds, cache=layers, per_layer_inputs=per_layer)


FAMILIES: dict[str, VisionFamily] = {t: f for f in (Qwen2VL(), Gemma3(), Llava(), Idefics3(), Gemma3n())
                                     for t in f.model_types}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(config: dict[str, Any], families: dict[str, VisionFamily] = FAMILIES) -> VisionFamily:
    """The family of ``config``'s ``model_type`` in ``families`` (``vision/served.py`` passes every
    served one, those of their own modules too); another type is refused with the list."""
    model_type = config.get("model_type")
    if model_type not in families:
        raise ValueError(f"vision model type '{model_type}' is not served yet; supported: {', '.join(families)}")
    return families[model_type]
