"""Mistral 3 (Mistral Small 3.1 / 3.2: Pixtral's tower and a patch merger): its family rules (a
directory through mlx-vlm's ``mistral3`` classes) and its GGUF projector (``clip.projector_type``
``pixtral``, :class:`PixtralProjector`).

- **the image processor**: Hugging Face's ``PixtralImageProcessor`` resizes an image so its longest
  edge fits ``size.longest_edge`` (never up), each side rounded up to whole units of
  ``patch_size * spatial_merge_size`` pixels (the processor is handed that unit as its patch size,
  as ``PixtralProcessor`` hands it), no crop, no padding for one image;
- **the tower**: Pixtral's ViT over 14-pixel patches with 2-D RoPE (a patch at row ``r`` and
  column ``c`` rotates half its frequencies by ``r`` and half by ``c``), RMS norms, SwiGLU MLPs,
  attention within the image;
- **the projector**: an RMS norm, the patch merger (each 2x2 block of patches concatenated and
  projected back to the tower's width), then a GELU MLP to the text width;
- **the prompt**: the template writes ``[IMG]`` once per image; the server expands it row by row of
  merged patches, ``[IMG]`` per merged patch and ``[IMG_BREAK]`` after each row, the last row's
  ``[IMG_BREAK]`` replaced by ``[IMG_END]`` (``PixtralProcessor.replace_image_token``); the
  features replace the ``[IMG]`` tokens only, the break and end tokens keep their embeddings;
- **the text model**: Mistral (plain RoPE, causal, ``KVCache`` per layer); a GGUF pair's is the
  text GGUF's model whole (mlx-lm's ``ministral3`` for the ``mistral3`` architecture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.vision.families import VisionFacts, VisionFamily
from mlxcel_compat.vision.gguf_projector import Processor, ProjectorFile, ProjectorKind

PIXTRAL_PROCESSOR = "transformers.models.pixtral.image_processing_pil_pixtral:PixtralImageProcessorPil"
IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
# A pair's images: PixtralImageProcessor sized as mtmd sizes them (vision/pixtral_mtmd.py, which imports transformers)
MTMD_PIXTRAL_PROCESSOR = "mlxcel_compat.vision.pixtral_mtmd:MtmdPixtralImageProcessor"
MTMD_LIMITS = (8, 1024)  # clip.cpp's merged patches an image for pixtral (set_limit_image_tokens)


class Mistral3(VisionFamily):
    """Mistral 3 (``mistral3``): Pixtral's tower, the 2x2 patch merger, ``[IMG_BREAK]`` rows (module docstring)."""

    model_types = ("mistral3",)
    processors = {"PixtralImageProcessor": PIXTRAL_PROCESSOR}

    def facts_from(self, config: dict[str, Any], tokenizer: Any, processor: str,
                   processor_config: dict[str, Any] | None, processor_dir: Path = Path(".")) -> VisionFacts:
        vocab = tokenizer.get_vocab()
        if missing := [t for t in IMAGE_TOKENS if t not in vocab]:
            raise ValueError(f"the Mistral 3 tokenizer lacks {', '.join(missing)}")
        image = int(config.get("image_token_index") or config.get("image_token_id") or vocab["[IMG]"])
        patch = int((config.get("vision_config") or {}).get("patch_size", 14))
        merge = int(config.get("spatial_merge_size", 2))
        unit = patch * merge  # PixtralProcessor resizes to whole merged patches
        return VisionFacts(model_type="mistral3", image_token_id=image, marker=(image,), expand_token=image,
                           row_break=int(vocab["[IMG_BREAK]"]), image_end=int(vocab["[IMG_END]"]),
                           patch_size=patch, merge_size=merge, processor=processor,
                           processor_kwargs={"patch_size": {"height": unit, "width": unit}},
                           processor_dir=processor_dir, processor_config=processor_config)

    def features(self, vlm: Any, images: list[Any]) -> mx.array:
        # One image at a time: mlx-vlm's batch is block-diagonal attention over the images' patches,
        # which is each image alone.
        patch = int(vlm.config.vision_config.patch_size)
        rows = []
        for image in images:
            _, height, width = image.grid_thw
            sizes = [(height * patch, width * patch)]
            pixels = mx.array(np.asarray(image.pixel_values)).transpose(0, 2, 3, 1)
            *_, states = vlm.vision_tower(pixels, output_hidden_states=True, image_sizes=sizes)
            selected = states[vlm.vision_feature_layer]
            rows.append(vlm.multi_modal_projector(selected.reshape(-1, selected.shape[-1]), sizes))
        return mx.concatenate(rows, axis=0)

    def hidden(self, language: Any, inputs: mx.array, cache: Any, embeds: mx.array | None,
               positions: mx.array | None) -> mx.array:
        if type(language).__module__.startswith("mlx_lm."):  # a GGUF pair's text model, whole
            return language.model(inputs, cache=cache, input_embeddings=embeds)
        return language.model(inputs, inputs_embeds=embeds, cache=cache)

    def blank_image(self, vlm: Any) -> Any:
        """A blank image of 2x2 merged patches (the tower's largest size, 1540 pixels for Mistral Small
        3.1, would take the warm-up minutes on a CPU; the graph is the same at any size)."""
        from mlxcel_compat.vision.inputs import MediaImage

        side = 2 * int(vlm.config.spatial_merge_size)
        size = side * int(vlm.config.vision_config.patch_size)
        return MediaImage(np.zeros((1, 3, size, size), np.float32), (1, side, side), (0, 1))


def unpermute_rotary_rows(value: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the converter's ``LlamaModel.permute`` of a ``q_proj`` / ``k_proj`` matrix (each head's
    rows interleaved pairwise for ggml's RoPE): back to the checkpoint's two rotary halves."""
    return value.reshape(n_head, value.shape[0] // n_head // 2, 2, *value.shape[1:]).swapaxes(1, 2).reshape(value.shape)


class PixtralProjector(ProjectorKind):
    """``pixtral`` with a patch merger (Mistral Small 3.1 / 3.2, as the converter's
    ``LlavaVisionModel`` writes it): the tower under gguf-py's names with ``q_proj``/``k_proj``
    permuted for ggml's RoPE (undone here), ``mm.input_norm``, ``mm.patch_merger``, ``mm.1``/``mm.2``;
    ``spatial_merge_size`` as a key. The file's ``v.token_embd.img_break`` is the text model's own
    ``[IMG_BREAK]`` row (mtmd appends it after each row); here the prompt holds the token, embedded
    by the text model. A ``pixtral`` file without a patch merger (Pixtral 12B, a ``llava`` model in
    Hugging Face's layout) is refused. The text GGUF (``mistral3``: mlx-lm's ``ministral3``) is the
    language model whole.

    Images are sized as llama.cpp's mtmd sizes them for this type (``vision/pixtral_mtmd.py``: each
    side rounded to whole merged patches, then bounded to 8..1024 merged patches, which
    ``--image-min-tokens`` / ``--image-max-tokens`` replace), then rescaled and normalized by
    PixtralImageProcessor, where a directory's take the processor's own longest edge (docs/vision.md)."""

    types = ("pixtral",)
    model_type = "mistral3"
    whole_text_model = True

    def vlm_config(self, projector: ProjectorFile, text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
        merge = int(projector.vision("spatial_merge_size", 0))
        if not merge or "mm.patch_merger.weight" not in projector.names:
            raise ValueError(f"projector {projector.path}: a pixtral projector without a patch merger "
                             "(Pixtral 12B) is not served yet; Mistral Small 3.1 / 3.2 projectors are")
        width, heads = int(projector.vision("embedding_length")), int(projector.vision("attention.head_count"))
        vision = dict(model_type="pixtral", hidden_size=width, head_dim=width // heads, num_attention_heads=heads,
                      intermediate_size=int(projector.vision("feed_forward_length")),
                      num_hidden_layers=int(projector.vision("block_count")),
                      image_size=int(projector.vision("image_size")), patch_size=int(projector.vision("patch_size")),
                      num_channels=3, rope_theta=10000.0,  # clip.cpp's, whatever the file says
                      rms_norm_eps=float(projector.vision("attention.layer_norm_epsilon", 1e-5)))
        # mlx-vlm builds its own Mistral text model, which the text GGUF's replaces whole
        text_config = dict(text, model_type="mistral", rope_theta=float(text.get("rope_theta") or 1e9))
        return dict(model_type=self.model_type, text_config=text_config, vision_config=vision,
                    image_token_index=token_ids["[IMG]"], spatial_merge_size=merge, vision_feature_layer=-1,
                    multimodal_projector_bias="mm.1.bias" in projector.names, vocab_size=int(text["vocab_size"]),
                    eos_token_id=text.get("eos_token_id"))

    def processor(self, projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
        config = dict(do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, rescale_factor=1 / 255,
                      resample=3, size={"longest_edge": int(projector.vision("image_size"))},
                      patch_size=int(projector.vision("patch_size")),
                      image_mean=[float(x) for x in projector.vision("image_mean")],
                      image_std=[float(x) for x in projector.vision("image_std")],
                      min_tokens=min_tokens if min_tokens > 0 else MTMD_LIMITS[0],
                      max_tokens=max_tokens if max_tokens > 0 else MTMD_LIMITS[1])
        return Processor(MTMD_PIXTRAL_PROCESSOR, config)

    def checkpoint_name(self, mlx_name: str) -> str:
        return mlx_name.replace("vision_tower.vision_model.", "vision_tower.")

    def read(self, projector: ProjectorFile, mlx_name: str, gguf_name: str) -> np.ndarray:
        value = projector.read(gguf_name)
        if mlx_name.endswith("patch_conv.weight"):  # PyTorch's (out, in, kh, kw) as MLX's (out, kh, kw, in)
            return np.ascontiguousarray(np.moveaxis(value, 1, -1))
        if mlx_name.endswith(("attention.q_proj.weight", "attention.k_proj.weight")):
            return np.ascontiguousarray(unpermute_rotary_rows(value, int(projector.vision("attention.head_count"))))
        return value
