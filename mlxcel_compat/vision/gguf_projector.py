"""llama.cpp's ``clip`` projector GGUFs (``--mmproj``) mapped back onto mlx-vlm's vision towers.

A projector file holds a vision tower and its projector under gguf-py's ``MMPROJ`` tensor names
(``v.blk.N.attn_q.weight``, ``mm.0.weight``, ...) and its hyperparameters as ``clip.vision.*``
keys; ``clip.projector_type`` says which model it came from (``tools/mtmd/clip-impl.h``). Each
served type is one :class:`ProjectorKind` here, which says:

- the mlx-vlm ``config.json`` of the pair (:meth:`ProjectorKind.vlm_config`): the text part from
  the text GGUF's config, the vision part from the ``clip.vision.*`` keys;
- the tower's and projector's weights under mlx-vlm's names (:meth:`ProjectorKind.weights`):
  each mlx-vlm parameter's Hugging Face checkpoint name goes through gguf-py's own
  ``TensorNameMap`` (the table the converter writes with), and what the converter changed is
  undone: PyTorch's ``(out, in, kh, kw)`` convolutions back to MLX's channels-last layout,
  Gemma 3's soft-embedding norm stored as ``1 + w``, Qwen2.5-VL's fused ``qkv`` split in three
  and its 3-D patch convolution split into two 2-D ones (``v.patch_embd.weight`` and ``.weight.1``);
- the image preprocessing (:meth:`ProjectorKind.processor`): Hugging Face's processor of the
  family, configured from the metadata (size, mean and std, patch and merge sizes) and from
  llama.cpp's own rules where the file says nothing (Qwen-VL's 8 to 4096 image tokens, which
  ``--image-min-tokens`` / ``--image-max-tokens`` replace, as in ``clip.cpp``).

The file is read by ``model/loader.py`` (the ``gguf/`` room); this module sees plain metadata and a
function that returns one tensor's float32 values in NumPy order, so it holds no file format.

| ``clip.projector_type`` | mlx-vlm model | tower | projector |
|---|---|---|---|
| ``gemma3`` | ``gemma3`` | SigLIP | average pool (``projector.scale_factor``, default 4), RMS norm, linear |
| ``qwen2.5vl_merger`` | ``qwen2_5_vl`` | windowed ViT (``n_wa_pattern``; window ``clip.vision.window_size``, else 112) | 2x2 patch merger MLP |
| ``qwen2vl_merger`` | ``qwen2_vl`` | ViT (LayerNorm, GELU MLP) | the same merger |
| ``idefics3`` | ``idefics3`` (mlx-lm's Llama as its text model) | SigLIP over tiles | pixel shuffle, linear |
| ``mlp`` | ``llava`` (LLaVA 1.5) | CLIP up to ``feature_layer`` | 2-layer GELU MLP |

Types whose rules are a module of their own (``qwen3vl_merger``: ``vision/qwen3vl.py``;
``internvl``: ``vision/internvl.py``) join these
in ``vision/served.py``, which loading looks types up in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

ReadTensor = Callable[[str], np.ndarray]  # GGUF tensor name -> float32 values in NumPy order

GEMMA3_PROCESSOR = "transformers.models.gemma3.image_processing_pil_gemma3:Gemma3ImageProcessorPil"
IDEFICS3_PROCESSOR = "transformers.models.idefics3.image_processing_pil_idefics3:Idefics3ImageProcessorPil"
QWEN2VL_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil"


def siglip_tower_config(projector: ProjectorFile, model_type: str, default_eps: float) -> dict[str, Any]:
    """A SigLIP-shaped tower's config (Gemma 3's, Idefics3's) from the projector's ``clip.vision.*``
    keys: mlx-vlm's ``vision_config`` of ``model_type``."""
    return dict(model_type=model_type, num_hidden_layers=int(projector.vision("block_count")),
                hidden_size=int(projector.vision("embedding_length")),
                intermediate_size=int(projector.vision("feed_forward_length")),
                num_attention_heads=int(projector.vision("attention.head_count")),
                patch_size=int(projector.vision("patch_size")), image_size=int(projector.vision("image_size")),
                num_channels=3, layer_norm_eps=float(projector.vision("attention.layer_norm_epsilon", default_eps)))


@dataclass(frozen=True)
class ProjectorFile:
    """One projector GGUF as this module sees it: its metadata, tensor names and a reader."""

    path: str
    metadata: dict[str, Any]
    names: frozenset[str]
    read: ReadTensor

    @property
    def projector_type(self) -> str:
        return str(self.metadata.get("clip.vision.projector_type") or self.metadata.get("clip.projector_type") or "")

    def vision(self, key: str, default: Any = None) -> Any:
        """``clip.vision.<key>``; a required one (no default) missing is a clear error."""
        value = self.metadata.get(f"clip.vision.{key}", default)
        if value is None:
            raise ValueError(f"projector {self.path} lacks clip.vision.{key}")
        return value


@dataclass(frozen=True)
class Processor:
    """The Hugging Face image processor of a projector: ``"module:Class"`` and its constructor's
    arguments (what a ``preprocessor_config.json`` would hold)."""

    name: str
    config: dict[str, Any]


def _mmproj_names(n_blocks: int) -> Any:
    import gguf

    # gguf-py maps the projector's layers (mm.N) through block-indexed rows: at least 3 blocks.
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(n_blocks, 3))


class ProjectorKind:
    """The rules of one ``clip.projector_type`` (the base: one tensor per parameter)."""

    types: tuple[str, ...] = ()
    model_type = ""
    # The text GGUF's model replaces mlx-vlm's language model whole (its family runs mlx-lm's model),
    # rather than lending it its layers path by path (vision/gguf_model.py: transplant).
    whole_text_model = False

    def vlm_config(self, projector: ProjectorFile, text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
        raise NotImplementedError

    def processor(self, projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
        raise NotImplementedError

    def checkpoint_name(self, mlx_name: str) -> str:
        """The Hugging Face checkpoint's name of an mlx-vlm parameter (the converter's input)."""
        return mlx_name

    def read(self, projector: ProjectorFile, mlx_name: str, gguf_name: str) -> np.ndarray:
        """One parameter's values from the file, in mlx-vlm's layout (the converter undone)."""
        return projector.read(gguf_name)

    def weights(self, projector: ProjectorFile, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """mlx-vlm name -> values, for every parameter of the tower and projector (``shapes``);
        a parameter without its tensor, or a tensor of another shape, is an error naming it."""
        names = _mmproj_names(int(projector.vision("block_count")))
        out: dict[str, np.ndarray] = {}
        for mlx_name, shape in shapes.items():
            hf_name = self.checkpoint_name(mlx_name)
            gguf_name = self.tensor_name(names, hf_name)
            if gguf_name is None:
                raise ValueError(f"projector {projector.path}: no GGUF tensor corresponds to {mlx_name}")
            if not self.present(projector, gguf_name):
                raise ValueError(f"projector {projector.path} lacks tensor {gguf_name} ({mlx_name})")
            value = self.read(projector, mlx_name, gguf_name)
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"projector {projector.path}: tensor {gguf_name} has shape {value.shape}; "
                                 f"mlx-vlm's {mlx_name} is {shape}")
            out[mlx_name] = value
        return out

    def present(self, projector: ProjectorFile, gguf_name: str) -> bool:
        return gguf_name in projector.names

    def tensor_name(self, names: Any, hf_name: str) -> str | None:
        """The GGUF name of a checkpoint tensor: gguf-py's map (``names``), the converter's table."""
        return names.get_name(hf_name, try_suffixes=(".weight", ".bias"))


def _channels_last(value: np.ndarray) -> np.ndarray:
    """PyTorch's convolution ``(out, in, *kernel)`` as MLX's ``(out, *kernel, in)``."""
    return np.ascontiguousarray(np.moveaxis(value, 1, -1))


class Gemma3Projector(ProjectorKind):
    """Gemma 3: SigLIP, then the projector's average pool to ``(patches per side / scale)²``
    tokens, RMS norm (``1 + w``; the converter stores ``1 + w``) and linear projection."""

    types = ("gemma3",)
    model_type = "gemma3"

    @staticmethod
    def tokens_per_image(projector: ProjectorFile) -> int:
        side = int(projector.vision("image_size")) // int(projector.vision("patch_size"))
        scale = int(projector.metadata.get("clip.vision.projector.scale_factor") or 4)  # clip.cpp's default
        return (side // scale) ** 2

    def vlm_config(self, projector: ProjectorFile, text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
        tokens = self.tokens_per_image(projector)
        vision = siglip_tower_config(projector, "siglip_vision_model", 1e-6)
        text_config = dict(text, model_type="gemma3_text", rope_global_base_freq=float(text.get("rope_theta", 1e6)),
                           mm_tokens_per_image=tokens)
        return dict(model_type="gemma3", text_config=text_config, vision_config=vision,
                    hidden_size=int(text["hidden_size"]), vocab_size=int(text["vocab_size"]), mm_tokens_per_image=tokens,
                    boi_token_index=token_ids["<start_of_image>"], eoi_token_index=token_ids["<end_of_image>"],
                    image_token_index=token_ids["<image_soft_token>"], eos_token_id=text.get("eos_token_id"))

    def processor(self, projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
        size = int(projector.vision("image_size"))
        config = dict(do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, rescale_factor=1 / 255,
                      resample=2, size={"height": size, "width": size}, do_pan_and_scan=False,
                      image_mean=[float(x) for x in projector.vision("image_mean")],
                      image_std=[float(x) for x in projector.vision("image_std")])
        return Processor(GEMMA3_PROCESSOR, config)

    def checkpoint_name(self, mlx_name: str) -> str:
        return mlx_name.replace("mm_input_projection_weight", "mm_input_projection.weight")

    def read(self, projector: ProjectorFile, mlx_name: str, gguf_name: str) -> np.ndarray:
        value = projector.read(gguf_name)
        if mlx_name.endswith("patch_embedding.weight"):
            return _channels_last(value)
        if mlx_name.endswith("mm_soft_emb_norm.weight"):
            return value - np.float32(1.0)
        return value

def qwen_vl_processor(projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
    """Qwen2VLImageProcessor as the projector's keys set it (Qwen2-VL, Qwen2.5-VL and Qwen3-VL alike):
    the patch and merge sizes, the normalisation, and the pixel bounds from ``--image-min/max-tokens``
    (8 and 4096 merged patches by default)."""
    patch = int(projector.vision("patch_size"))
    merge = int(projector.vision("spatial_merge_size", 2))
    area = (patch * merge) ** 2
    least, most = (min_tokens if min_tokens > 0 else 8) * area, (max_tokens if max_tokens > 0 else 4096) * area
    config = dict(do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, rescale_factor=1 / 255,
                  image_mean=[float(x) for x in projector.vision("image_mean")],
                  image_std=[float(x) for x in projector.vision("image_std")], patch_size=patch,
                  merge_size=merge, temporal_patch_size=2, size={"shortest_edge": least, "longest_edge": most})
    return Processor(QWEN2VL_PROCESSOR, config)


class Qwen25VLProjector(ProjectorKind):
    """Qwen2.5-VL: a ViT with windowed attention (every ``n_wa_pattern``-th block full) over
    14-pixel patches of two frames, then the 2x2 patch merger (RMS norm, 2-layer MLP)."""

    types = ("qwen2.5vl_merger",)
    model_type = "qwen2_5_vl"
    LLAMA_CPP_WINDOW = 112  # clip.cpp's window for Qwen2.5-VL (pixels)

    def vision_config(self, projector: ProjectorFile) -> dict[str, Any]:
        depth = int(projector.vision("block_count"))
        pattern = int(projector.vision("n_wa_pattern"))
        patch = int(projector.vision("patch_size"))
        return dict(model_type="qwen2_5_vl", depth=depth, hidden_size=int(projector.vision("embedding_length")),
                    intermediate_size=int(projector.vision("feed_forward_length")),
                    out_hidden_size=int(projector.vision("projection_dim")),
                    num_heads=int(projector.vision("attention.head_count")), patch_size=patch,
                    spatial_patch_size=patch, spatial_merge_size=int(projector.vision("spatial_merge_size", 2)),
                    temporal_patch_size=2, in_channels=3, in_chans=3, tokens_per_second=2,
                    window_size=int(projector.vision("window_size", self.LLAMA_CPP_WINDOW)),
                    fullatt_block_indexes=[i for i in range(depth) if (i + 1) % pattern == 0],
                    layer_norm_eps=float(projector.vision("attention.layer_norm_epsilon", 1e-6)))

    def vlm_config(self, projector: ProjectorFile, text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
        sections = list(text.get("mrope_section") or [])
        if len(sections) != 3:
            raise ValueError(f"the text GGUF of a {self.types[0]} projector needs qwen2vl's rope.dimension_sections")
        return dict(text, model_type=self.model_type, vision_config=self.vision_config(projector),
                    rope_scaling={"type": "mrope", "mrope_section": sections},
                    image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids.get("<|video_pad|>", -1),
                    vision_start_token_id=token_ids["<|vision_start|>"],
                    vision_end_token_id=token_ids["<|vision_end|>"], vision_token_id=token_ids["<|vision_start|>"])

    def processor(self, projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
        return qwen_vl_processor(projector, min_tokens, max_tokens)

    def checkpoint_name(self, mlx_name: str) -> str:
        return "visual." + mlx_name.removeprefix("vision_tower.")

    def present(self, projector: ProjectorFile, gguf_name: str) -> bool:
        parts = [gguf_name.replace("attn_qkv", f"attn_{x}") for x in "qkv"] if "attn_qkv" in gguf_name else [gguf_name]
        if gguf_name == "v.patch_embd.weight":
            parts.append(gguf_name + ".1")
        return all(p in projector.names for p in parts)

    def read(self, projector: ProjectorFile, mlx_name: str, gguf_name: str) -> np.ndarray:
        if "attn_qkv" in gguf_name:  # the converter split the fused projection
            return np.concatenate([projector.read(gguf_name.replace("attn_qkv", f"attn_{x}")) for x in "qkv"])
        if mlx_name.endswith("patch_embed.proj.weight"):  # two 2-D convolutions, one per frame
            second = projector.read(gguf_name + ".1")
            stacked = np.stack([projector.read(gguf_name), second], axis=2)  # (out, in, frames, kh, kw)
            return _channels_last(stacked)
        return projector.read(gguf_name)


class Qwen2VLProjector(Qwen25VLProjector):
    """Qwen2-VL: a plain ViT (LayerNorm, GELU MLP; no windows) over the same patches, the same
    merger. The converter writes the checkpoint's ``hidden_size`` (the merger's output width) as
    ``feed_forward_length``, so the MLP's width is read from ``v.blk.0.ffn_up.weight``."""

    types = ("qwen2vl_merger",)
    model_type = "qwen2_vl"

    def vision_config(self, projector: ProjectorFile) -> dict[str, Any]:
        embed = int(projector.vision("embedding_length"))
        if "v.blk.0.ffn_up.weight" not in projector.names:
            raise ValueError(f"projector {projector.path} lacks tensor v.blk.0.ffn_up.weight")
        width = int(projector.read("v.blk.0.ffn_up.weight").shape[0])
        patch = int(projector.vision("patch_size"))
        return dict(model_type="qwen2_vl", depth=int(projector.vision("block_count")), embed_dim=embed,
                    hidden_size=int(projector.vision("projection_dim")), mlp_ratio=width / embed,
                    num_heads=int(projector.vision("attention.head_count")), patch_size=patch,
                    spatial_patch_size=patch, spatial_merge_size=int(projector.vision("spatial_merge_size", 2)),
                    temporal_patch_size=2, in_channels=3, in_chans=3,
                    layer_norm_eps=float(projector.vision("attention.layer_norm_epsilon", 1e-6)))


class Idefics3Projector(ProjectorKind):
    """Idefics3 / SmolVLM: SigLIP over tiles of ``image_size``, then the connector's pixel shuffle
    (``projector.scale_factor``) and one linear projection (``mm.model.fc``). Images are resized to
    ``preproc_image_size`` on their longest edge and cut into tiles plus the whole image, as
    Idefics3ImageProcessor does (llama.cpp's mtmd too, except that it also cuts an image of one
    tile, encoding it twice: as the whole and as a 1x1 grid)."""

    types = ("idefics3",)
    model_type = "idefics3"
    whole_text_model = True

    def vlm_config(self, projector: ProjectorFile, text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
        vision = siglip_tower_config(projector, "idefics3_vision", 1e-5)
        scale = int(projector.metadata.get("clip.vision.projector.scale_factor") or 2)
        return dict(model_type="idefics3", text_config=dict(text, model_type="llama"), vision_config=vision,
                    vocab_size=int(text["vocab_size"]), scale_factor=scale, image_token_id=token_ids["<image>"],
                    eos_token_id=text.get("eos_token_id"))

    def processor(self, projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
        tile = int(projector.vision("image_size"))
        longest = int(projector.metadata.get("clip.vision.preproc_image_size") or tile)
        config = dict(do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, rescale_factor=1 / 255,
                      resample=1, do_image_splitting=True, do_pad=True, size={"longest_edge": longest},
                      max_image_size={"longest_edge": tile},
                      image_mean=[float(x) for x in projector.vision("image_mean")],
                      image_std=[float(x) for x in projector.vision("image_std")])
        return Processor(IDEFICS3_PROCESSOR, config)

    def checkpoint_name(self, mlx_name: str) -> str:
        return "model." + mlx_name  # model.vision_model.*, model.connector.*

    def read(self, projector: ProjectorFile, mlx_name: str, gguf_name: str) -> np.ndarray:
        value = projector.read(gguf_name)
        return _channels_last(value) if mlx_name.endswith("patch_embedding.weight") else value


LLAVA_PROCESSOR = "transformers.models.llava.image_processing_pil_llava:LlavaImageProcessorPil"


class LlavaProjector(ProjectorKind):
    """LLaVA 1.5 (``mlp``): CLIP (a class token, a pre-layernorm, quick GELU), its hidden states
    after ``clip.vision.feature_layer`` blocks (absent: ``block_count - 1``, as clip.cpp runs it),
    the class token dropped, then the 2-layer GELU MLP ``mm.0`` / ``mm.2`` (mlx-vlm's ``llava``).

    These files come from llama.cpp's legacy ``convert_image_encoder_to_gguf.py`` (its
    ``convert_hf_to_gguf.py`` writes no CLIP LLaVA projector), which keeps only the blocks up to
    the feature layer, drops CLIP's post-layernorm and names ``fc1`` ``ffn_down`` and ``fc2``
    ``ffn_up``; clip.cpp swaps them back when ``ffn_down``'s input width is the tower's, and so
    does this (a file with gguf-py's names reads as is). Images are padded to a square of the
    mean colour, then resized to ``image_size`` (mtmd's fixed-size preprocessing; LlavaImageProcessor
    with ``do_pad``)."""

    types = ("mlp",)
    model_type = "llava"

    @staticmethod
    def feature_layer(projector: ProjectorFile) -> int:
        blocks = int(projector.vision("block_count"))
        layers = [int(x) for x in projector.metadata.get("clip.vision.feature_layer") or [blocks - 1]]
        if len(layers) != 1 or not 0 <= layers[0] <= blocks:
            raise ValueError(f"projector {projector.path}: clip.vision.feature_layer {layers} is not served "
                             f"(one layer of the {blocks} blocks; mlx-vlm's LLaVA projector takes one)")
        return layers[0]

    def vlm_config(self, projector: ProjectorFile, text: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
        if projector.metadata.get("clip.use_gelu") or projector.metadata.get("clip.use_silu"):
            raise ValueError(f"projector {projector.path}: a CLIP tower with exact GELU or SiLU is not served "
                             "(mlx-vlm's CLIP uses quick GELU, clip.cpp's default)")
        layer = self.feature_layer(projector)
        vision = dict(model_type="clip_vision_model", num_hidden_layers=layer,
                      hidden_size=int(projector.vision("embedding_length")),
                      intermediate_size=int(projector.vision("feed_forward_length")),
                      num_attention_heads=int(projector.vision("attention.head_count")),
                      patch_size=int(projector.vision("patch_size")), image_size=int(projector.vision("image_size")),
                      projection_dim=int(projector.vision("projection_dim", 768)), num_channels=3,
                      layer_norm_eps=float(projector.vision("attention.layer_norm_epsilon", 1e-5)))
        return dict(model_type="llava", text_config=dict(text), vision_config=vision,
                    vocab_size=int(text["vocab_size"]), image_token_index=token_ids["<image>"],
                    vision_feature_layer=layer, vision_feature_select_strategy="default",
                    eos_token_id=text.get("eos_token_id"))

    def processor(self, projector: ProjectorFile, min_tokens: int, max_tokens: int) -> Processor:
        size = int(projector.vision("image_size"))
        config = dict(do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True, rescale_factor=1 / 255,
                      resample=3, do_pad=True, do_center_crop=True, size={"shortest_edge": size},
                      crop_size={"height": size, "width": size},
                      image_mean=[float(x) for x in projector.vision("image_mean")],
                      image_std=[float(x) for x in projector.vision("image_std")])
        return Processor(LLAVA_PROCESSOR, config)

    def tensor_name(self, names: Any, hf_name: str) -> str | None:
        if hf_name.startswith("multi_modal_projector.linear_"):  # the legacy converter's mm.0 and mm.2
            index = {"1": 0, "2": 2}[hf_name.split(".")[1].removeprefix("linear_")]
            return f"mm.{index}.{hf_name.rsplit('.', 1)[-1]}"
        return super().tensor_name(names, hf_name)

    def weights(self, projector: ProjectorFile, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        # CLIP's post-layernorm only feeds its pooled output, which LLaVA never reads: not in the file.
        wanted = {name: shape for name, shape in shapes.items() if ".post_layernorm." not in name}
        return super().weights(self.ffn_in_order(projector), wanted)

    @staticmethod
    def ffn_in_order(projector: ProjectorFile) -> ProjectorFile:
        """The projector read with ``ffn_up`` as CLIP's ``fc1`` (the legacy converter's swap undone)."""
        down = "v.blk.0.ffn_down.weight"
        if down not in projector.names:
            return projector
        if int(projector.read(down).shape[-1]) != int(projector.vision("embedding_length")):
            return projector

        def read(name: str) -> np.ndarray:
            if ".ffn_up." in name:
                return projector.read(name.replace(".ffn_up.", ".ffn_down."))
            if ".ffn_down." in name:
                return projector.read(name.replace(".ffn_down.", ".ffn_up."))
            return projector.read(name)

        return ProjectorFile(projector.path, projector.metadata, projector.names, read)

    def read(self, projector: ProjectorFile, mlx_name: str, gguf_name: str) -> np.ndarray:
        value = projector.read(gguf_name)
        return _channels_last(value) if mlx_name.endswith("patch_embedding.weight") else value


KINDS: dict[str, ProjectorKind] = {t: k for k in (Gemma3Projector(), Qwen25VLProjector(), Qwen2VLProjector(),
                                                  Idefics3Projector(), LlavaProjector())
                                   for t in k.types}
SERVED_PROJECTOR_TYPES: tuple[str, ...] = tuple(KINDS)


def projector_kind(projector: ProjectorFile, kinds: dict[str, ProjectorKind] = KINDS) -> ProjectorKind:
    """The projector's rules in ``kinds`` (``vision/served.py`` passes every served type, those of
    their own modules too); an unknown type is refused with its name and the served ones."""
    kind = projector.projector_type
    if projector.metadata.get("general.architecture") != "clip":
        raise ValueError(f"{projector.path} is not a multimodal projector (general.architecture is "
                         f"'{projector.metadata.get('general.architecture')}', not 'clip')")
    if not projector.metadata.get("clip.has_vision_encoder", False):
        raise ValueError(f"projector {projector.path} has no vision encoder (audio projectors are not served)")
    if kind not in kinds:
        raise ValueError(f"projector type '{kind}' of {projector.path} is not served; served: "
                         f"{', '.join(kinds)}")
    return kinds[kind]
