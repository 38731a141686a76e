"""A vision-language model from llama.cpp's GGUF pair: the text model's GGUF and its projector.

The text GGUF loads as it does alone (``gguf/load.py``: an mlx-lm model whose linear layers and
embedding stay in the file's blocks, multiplied by ggml's kernels). The projector's kind
(``vision/gguf_projector.py``) says which mlx-vlm model the pair is; that model is built from the
pair's config, and then:

- its language model's layers are **the text model's own modules**, moved in by path
  (:func:`transplant`): mlx-lm's and mlx-vlm's language models name their layers alike
  (``model.layers.N.self_attn.q_proj``, ``model.norm``, ``lm_head``), so the block layers, norms
  and RoPE of the loaded text model run inside mlx-vlm's forward pass, which adds what the
  family needs (Qwen2.5-VL's multimodal RoPE positions, Gemma 3's embeddings scaled in place);
  a weight-holding layer on either side without its counterpart is an error naming it, and a
  head the text model ties to its embeddings is dropped from mlx-vlm's;
- its vision tower and projector take the projector file's tensors.

The result is served by the same :class:`~mlxcel_compat.vision.model.VisionLM` and family rules
(``vision/families.py``) as an mlx-vlm directory: same prompt expansion, features, positions,
KV cache and prompt-cache rules. Only the prompt side's image processor differs: configured from
the projector's metadata (:class:`~mlxcel_compat.vision.gguf_projector.Processor`), not from a
``preprocessor_config.json``.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.nn as nn

from mlxcel_compat.vision.families import VisionFacts
from mlxcel_compat.vision.gguf_projector import ProjectorFile
from mlxcel_compat.vision.model import VisionLM
from mlxcel_compat.vision.served import family_of, projector_kind

# The tokens each projector kind's prompts use, looked up in the text GGUF's vocabulary.
MARKER_TOKENS: dict[str, tuple[str, ...]] = {
    "gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
    "qwen2_5_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "qwen2_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "qwen3_vl": ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    "idefics3": ("<fake_token_around_image>", "<image>", "<global-img>"),
    "internvl_chat": ("<img>", "</img>", "<IMG_CONTEXT>"),
    "llava": ("<image>",),
    "mistral3": ("[IMG]", "[IMG_BREAK]", "[IMG_END]"),
    "lfm2_vl": ("<image>",),
}
OPTIONAL_TOKENS = ("<|video_pad|>",)


def _token_ids(tokenizer: Any, model_type: str, path: str) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    found = {t: int(vocab[t]) for t in MARKER_TOKENS[model_type] if t in vocab}
    missing = [t for t in MARKER_TOKENS[model_type] if t not in found and t not in OPTIONAL_TOKENS]
    if missing:
        raise ValueError(f"the text model's vocabulary lacks {', '.join(missing)}, which {model_type} projector "
                         f"{path} needs for its images")
    return found


def _holds_weights(module: nn.Module) -> bool:
    from mlx.utils import tree_flatten

    return hasattr(module, "block") or isinstance(module, (nn.Linear, nn.Embedding)) or bool(
        tree_flatten(module.parameters())) and hasattr(module, "weight")


def _leaves(root: nn.Module) -> dict[str, nn.Module]:
    from mlx.utils import tree_flatten

    return {path: m for path, m in root.named_modules() if path and not tree_flatten(m.children())}


def _set_module(root: Any, path: str, module: nn.Module) -> None:
    *parents, last = path.split(".")
    node = root
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    if isinstance(node, list):
        node[int(last)] = module
    else:
        setattr(node, last, module)


def transplant(text_model: nn.Module, language: nn.Module) -> int:
    """Move ``text_model``'s leaf layers into mlx-vlm's ``language`` model at the same paths;
    returns how many. Leaves of one side with weights and no counterpart are an error, except
    mlx-vlm's ``lm_head`` when the text model ties its head (removed)."""
    source, target = _leaves(text_model), _leaves(language)
    if "lm_head" in target and "lm_head" not in source:
        del language["lm_head"]
        target.pop("lm_head")
    unplaced = [p for p, m in source.items() if p not in target and _holds_weights(m)]
    unfilled = [p for p, m in target.items() if p not in source and _holds_weights(m)]
    if unplaced or unfilled:
        raise ValueError("the text GGUF's model and mlx-vlm's language model differ: "
                         + "; ".join(filter(None, [unplaced and f"no place for {', '.join(unplaced[:4])}",
                                                   unfilled and f"nothing for {', '.join(unfilled[:4])}"])))
    for path in source.keys() & target.keys():
        _set_module(language, path, source[path])
    return len(source.keys() & target.keys())


def _vlm(config: dict[str, Any]) -> Any:
    """mlx-vlm's model for ``config`` (its weights not yet loaded: MLX builds them lazily)."""
    from mlx_vlm.utils import get_model_and_args

    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model_config.text_config = module.TextConfig.from_dict(config.get("text_config", config))
    return module.Model(model_config)


def load_gguf_vision(text_model: nn.Module, text_config: dict[str, Any], tokenizer: Any, projector: ProjectorFile,
                     image_min_tokens: int = 0, image_max_tokens: int = 0
                     ) -> tuple[VisionLM, dict[str, Any], VisionFacts]:
    """``(model, config, facts)`` of the pair: ``text_model`` (loaded from the text GGUF) joined
    with the projector's tower (engine thread)."""
    from mlx.utils import tree_flatten

    kind = projector_kind(projector)
    config = kind.vlm_config(projector, text_config, _token_ids(tokenizer, kind.model_type, projector.path))
    vlm = _vlm(config)
    if kind.whole_text_model:
        vlm.language_model = text_model
    else:
        transplant(text_model, vlm.language_model)
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(vlm.parameters()) if not name.startswith("language_model.")}
    import mlx.core as mx

    weights = kind.weights(projector, shapes)
    vlm.load_weights([(name, mx.array(value)) for name, value in weights.items()], strict=False)
    vlm.eval()
    family = family_of(config)
    processor = kind.processor(projector, image_min_tokens, image_max_tokens)
    facts = family.facts_from(config, tokenizer, processor.name, processor.config)
    return VisionLM(vlm, family, facts), config, facts
