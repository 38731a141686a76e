"""Dense decoder families beyond the first ones: the factory's rows for them, their configs and their GGUF conversion.

Each family is named by its mlx-lm ``model_type`` and built at small sizes with its real model's
config structure; :data:`GGUF_TARGETS` says what llama.cpp's converter does to it, and its
``hparams`` writer writes the ``{arch}.*`` keys the converter's class writes for it
(``convert_hf_to_gguf.py``: ``TextModel.set_gguf_parameters`` and the class's own additions).
"""

from __future__ import annotations

from typing import Any, Callable

from .family import Family
from .gguf_target import GgufTarget


def _dims(size: str, tiny: dict[str, Any], small: dict[str, Any]) -> dict[str, Any]:
    return dict(tiny if size == "tiny" else small)


def text_hparams(writer: Any, c: dict[str, Any], rope: dict[str, Any] | None = None) -> None:
    """The keys ``TextModel.set_gguf_parameters`` writes for a config like ``c`` (``rope``: the
    rope parameters when they are not ``c``'s ``rope_scaling`` and ``rope_theta``)."""
    import gguf

    if rope is None:
        rope = {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta")}
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    if c.get("num_key_value_heads") is not None:
        writer.add_head_count_kv(c["num_key_value_heads"])
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if "beta_fast" in rope:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if "beta_slow" in rope:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif kind in ("longrope", "su"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    if c.get("rms_norm_eps") is not None:
        writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if c.get("layer_norm_eps") is not None:
        writer.add_layer_norm_eps(c["layer_norm_eps"])
    if c.get("head_dim") is not None:
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])


def llama_hparams(writer: Any, c: dict[str, Any], rope: dict[str, Any] | None = None) -> None:
    """``LlamaModel.set_gguf_parameters``: the text keys, the vocabulary size and the rotary dimensions."""
    text_hparams(writer, c, rope)
    writer.add_vocab_size(c["vocab_size"])
    writer.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


# --- ministral3 (GGUF mistral3): Ministral 3, and Mistral Small 3.x / Devstral as the converter now writes them


def _ministral3_config(size: str) -> dict[str, Any]:
    # Ministral-3-3B's shape: head_dim 128 for 3072 wide, GQA 4:1, tied embeddings, YaRN x16 with
    # Llama 4's attention temperature (queries scaled by 1 + beta log(1 + floor(pos / original))).
    # The tiny model's original context is 16 positions, so a short prompt crosses into the
    # scaled range.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, intermediate_size=192),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=128, intermediate_size=2304))
    original = 16 if size == "tiny" else 4096
    rope = {"rope_type": "yarn", "type": "yarn", "factor": 16.0, "original_max_position_embeddings": original,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1, "rope_theta": 1000000.0}
    return dict(dims, rope_parameters=rope, rms_norm_eps=1e-5, tie_word_embeddings=True)


def _ministral3_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    rope = c["rope_parameters"]
    llama_hparams(writer, c, rope)
    writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


FAMILIES: tuple[Family, ...] = (
    Family("ministral3", "Ministral3ForCausalLM", thinking=False, add_bos=True, norm_one=1.0),
)
CONFIGS: dict[str, Callable[[str], dict[str, Any]]] = {
    "ministral3": _ministral3_config,
}
GGUF_TARGETS: dict[str, GgufTarget] = {
    "ministral3": GgufTarget("mistral3", permute_qk=True, norm_shift=0.0, hparams=_ministral3_hparams),
}
