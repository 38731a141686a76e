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
    rms_eps = next((c[k] for k in ("rms_norm_eps", "norm_eps") if c.get(k) is not None), None)
    if rms_eps is not None:
        writer.add_layer_norm_rms_eps(rms_eps)
    norm_eps = next((c[k] for k in ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon") if c.get(k) is not None),
                    None)
    if norm_eps is not None:
        writer.add_layer_norm_eps(norm_eps)
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
    # Ministral3Model adds the YaRN multiplier and the temperature for a ministral3 text config
    # (always YaRN); a Mistral Small 3.x one (mistral's, no YaRN) gets llama's keys only.
    rope = c["rope_parameters"]
    llama_hparams(writer, c, rope)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


# --- phi3: Phi-3.5-mini, Phi-4, Phi-4-mini


def _phi3_config(size: str) -> dict[str, Any]:
    # Phi-4-mini's shape: fused qkv_proj and gate_up_proj, GQA 3:1, three quarters of each head
    # rotated, LongRoPE (per-frequency long and short factors), tied embeddings.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=192),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      intermediate_size=2048))
    rotated = int(0.75 * dims["hidden_size"]) // dims["num_attention_heads"]
    n = rotated // 2
    scaling = {"type": "longrope", "long_factor": [1.0 + 0.5 * i for i in range(n)],
               "short_factor": [1.0 + 0.125 * i for i in range(n)]}
    return dict(dims, partial_rotary_factor=0.75, rope_scaling=scaling, rope_theta=10000.0,
                original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True)


def _phi3_rotated(c: dict[str, Any]) -> int:
    return int(c.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // c["num_attention_heads"]


def _phi3_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    # Phi3MiniModel.set_gguf_parameters and generate_extra_tensors: no head_dim or vocab size keys.
    import math

    writer.add_context_length(c["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_dimension_count(_phi3_rotated(c))
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_sliding_window(c.get("sliding_window") or 0)
    if (c.get("rope_scaling") or {}).get("long_factor"):
        scale = c["max_position_embeddings"] / c["original_max_position_embeddings"]
        original = c["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _phi3_rope_factors(c: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    scaling = c.get("rope_scaling") or {}
    if not scaling.get("long_factor"):
        return {}
    return {"rope_factors_long.weight": np.array(scaling["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(scaling["short_factor"], dtype=np.float32)}


# --- gemma2: Gemma 2


def _gemma2_config(size: str) -> dict[str, Any]:
    # Gemma-2-2B's shape: head_dim 256 for 2304 wide (heads x head_dim != hidden), GQA 2:1,
    # sandwich norms stored as w (gain 1 + w), GELU-tanh gating, tied embeddings, every other layer
    # sliding. The tiny model's soft caps are small (the real 50 and 30 barely touch its small
    # scores), so the file's values are load-bearing in the tests.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, intermediate_size=192, attn_logit_softcapping=2.0,
                            final_logit_softcapping=1.5),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=128, intermediate_size=2304, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0))
    return dict(dims, query_pre_attn_scalar=dims["head_dim"], sliding_window=4096, rms_norm_eps=1e-6,
                rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def _gemma2_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    # Gemma2Model.set_gguf_parameters writes its own short list: no RoPE base, no vocabulary size.
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(c["final_logit_softcapping"])
    writer.add_sliding_window(c["sliding_window"])


# --- smollm3: SmolLM3


def _smollm3_config(size: str) -> dict[str, Any]:
    # SmolLM3-3B's shape: llama with every fourth layer's RoPE left out (NoPE), GQA 4:1, tied
    # embeddings.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=192),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      intermediate_size=2048))
    n = dims["num_hidden_layers"]
    return dict(dims, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(n)], no_rope_layer_interval=4,
                rope_theta=5000000.0, rms_norm_eps=1e-6, attention_bias=False, mlp_bias=False,
                tie_word_embeddings=True)


def _smollm3_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    llama_hparams(writer, c)


# --- olmo2 (GGUF olmo2): OLMo 2; olmo3 (GGUF olmo2 with sliding windows): Olmo 3


def _olmo2_config(size: str) -> dict[str, Any]:
    # OLMo-2-0325-32B's shape: norms after the attention and the MLP (not before), RMS norms over
    # all the heads' queries and keys, GQA, untied embeddings.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=192),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      intermediate_size=2048))
    return dict(dims, rope_theta=500000.0, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False)


def _olmo3_config(size: str) -> dict[str, Any]:
    # Olmo-3-7B's shape: OLMo 2's layer, three sliding-window layers to one global. The tiny
    # window is small so a test prompt runs past it.
    config = _olmo2_config(size)
    n = config["num_hidden_layers"] = 4 if size == "tiny" else 12
    config.update(sliding_window=16 if size == "tiny" else 4096,
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)])
    return config


def _olmo2_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    text_hparams(writer, c)
    if "sliding_window" in c:  # transformers gives Olmo 3's sliding layers a RoPE base of their own
        writer.add_rope_freq_base_swa(c["rope_theta"])
        writer.add_sliding_window(c["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])


# --- granite: Granite 3.x (dense)


def _granite_config(size: str) -> dict[str, Any]:
    # granite-3.3-2b's shape: llama with four multipliers (embedding, residual branches, attention
    # scale, logits divisor), GQA 4:1, tied embeddings. The tiny logits divisor is 2 (the real 8
    # would flatten the tiny model's logits).
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=192, logits_scaling=2.0, attention_multiplier=0.125),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      intermediate_size=2048, logits_scaling=8.0, attention_multiplier=0.015625))
    return dict(dims, embedding_multiplier=12.0, residual_multiplier=0.22, rope_theta=10000000.0,
                rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False, tie_word_embeddings=True)


def _granite_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    llama_hparams(writer, c)
    writer.add_attention_scale(c["attention_multiplier"])
    writer.add_embedding_scale(c["embedding_multiplier"])
    writer.add_residual_scale(c["residual_multiplier"])
    writer.add_logit_scale(c["logits_scaling"])


# --- glm4: GLM-4-0414


def _glm4_config(size: str) -> dict[str, Any]:
    # GLM-4-9B-0414's shape: fused gate_up_proj, biases on the Q/K/V projections, half of each head
    # rotated (interleaved RoPE), four norms a layer (sandwich), GQA, untied head.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=192),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=2,
                      head_dim=64, intermediate_size=2048))
    return dict(dims, partial_rotary_factor=0.5, attention_bias=True, rope_theta=10000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=False)


def _glm4_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    text_hparams(writer, c)
    writer.add_rope_dimension_count(int(c["head_dim"] * c["partial_rotary_factor"]))


# --- exaone4: EXAONE 4.0


def _exaone4_config(size: str) -> dict[str, Any]:
    # EXAONE-4.0-1.2B's shape: norms after the attention and the MLP, per-head Q/K norms, GQA 4:1,
    # Llama 3 RoPE scaling, tied embeddings, every layer global (llama.cpp takes the 32B's
    # sliding windows only at its 64 layers).
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=192),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      head_dim=64, intermediate_size=2048))
    scaling = {"rope_type": "llama3", "factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}
    return dict(dims, rope_scaling=scaling, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
                sliding_window_pattern=None, layer_types=["full_attention"] * dims["num_hidden_layers"],
                tie_word_embeddings=True)


def _exaone4_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    text_hparams(writer, c)
    writer.add_vocab_size(c["vocab_size"])
    if c.get("sliding_window") is not None:  # the 32B's layout
        writer.add_sliding_window(c["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])


# --- cohere2: Command R7B, Command A


def _cohere2_config(size: str) -> dict[str, Any]:
    # c4ai-command-r7b's shape: one LayerNorm (no bias) feeding attention and MLP in parallel,
    # interleaved RoPE only in the sliding-window layers (three of every four), a logit scale,
    # tied embeddings. The tiny window is small so a test prompt runs past it.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=192, sliding_window=16),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      head_dim=64, intermediate_size=2048, sliding_window=4096))
    return dict(dims, sliding_window_pattern=4, logit_scale=0.25, layer_norm_eps=1e-5, rope_theta=50000.0,
                rotary_pct=1.0, attention_bias=False, tie_word_embeddings=True)


def _cohere2_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    import gguf

    text_hparams(writer, c)
    writer.add_logit_scale(c["logit_scale"])
    writer.add_sliding_window(c["sliding_window"])
    writer.add_vocab_size(c["vocab_size"])
    writer.add_rope_dimension_count(int(c["rotary_pct"] * (c["hidden_size"] // c["num_attention_heads"])))
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)


# --- starcoder2: StarCoder2


def _starcoder2_config(size: str) -> dict[str, Any]:
    # starcoder2-3b's shape: LayerNorms with biases, biases on every projection, a plain GELU MLP
    # (c_fc, c_proj), GQA, tied embeddings.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=2,
                      intermediate_size=3072))
    return dict(dims, norm_epsilon=1e-5, rope_theta=999999.4, use_bias=True, hidden_act="gelu_pytorch_tanh",
                sliding_window=4096, tie_word_embeddings=True)


def _text_only_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    text_hparams(writer, c)


# --- seed_oss: Seed-OSS


def _seed_oss_config(size: str) -> dict[str, Any]:
    # Seed-OSS-36B's shape: biases on the Q/K/V projections, head_dim 128 for 5120 wide (heads x
    # head_dim != hidden), GQA 10:1 (2:1 here), untied head.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, intermediate_size=192),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=128, intermediate_size=2048))
    return dict(dims, attention_bias=True, attention_out_bias=False, mlp_bias=False, rope_theta=10000000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


# --- ernie4_5: ERNIE 4.5 (dense)


def _ernie4_5_config(size: str) -> dict[str, Any]:
    # ERNIE-4.5-0.3B's shape: llama's layer with interleaved RoPE, head_dim 128 for 1024 wide
    # (heads x head_dim != hidden), GQA 8:1 (2:1 here), tied embeddings.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, intermediate_size=192),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=128, intermediate_size=2048))
    return dict(dims, use_bias=False, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


# --- apertus: Apertus


XIELU = ("alpha_n", "alpha_p", "beta", "eps")


def _apertus_config(size: str) -> dict[str, Any]:
    # Apertus-8B's shape: an ungated MLP with the xIELU activation (four constants a layer), per-head
    # Q/K norms, GQA 4:1, Llama 3 RoPE scaling, untied head.
    dims = _dims(size, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256),
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      intermediate_size=3072))
    scaling = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}
    return dict(dims, hidden_act="xielu", post_norm=False, qk_norm=True, mlp_bias=False, attention_bias=False,
                rope_scaling=scaling, rope_theta=12000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _apertus_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    # ApertusModel.modify_tensors moves each layer's xIELU constants into per-layer metadata arrays.
    llama_hparams(writer, c)
    for key in XIELU:
        values = [float(weights[f"model.layers.{i}.mlp.act_fn.{key}"].item()) for i in range(c["num_hidden_layers"])]
        getattr(writer, f"add_xielu_{key}")(values)


# --- exaone: EXAONE 3.5, served by no row (the generic path: gguf/generic_path.py)


def _exaone_config(size: str) -> dict[str, Any]:
    # EXAONE-3.5-2.4B's shape under its own names (transformer.h.N.attn.attention.*, ln_1, c_fc_0):
    # llama's layer, GQA 4:1, Llama 3 RoPE scaling, tied embeddings.
    dims = _dims(size, dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=192),
                 dict(hidden_size=768, num_layers=12, num_attention_heads=12, num_key_value_heads=4,
                      intermediate_size=2048))
    scaling = {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}
    # (num_hidden_layers too, which transformers' ExaoneConfig maps num_layers to, for the writer)
    return dict(dims, num_hidden_layers=dims["num_layers"], rope_scaling=scaling, rope_theta=1000000.0,
                layer_norm_epsilon=1e-5, activation_function="silu", tie_word_embeddings=True)


def _exaone_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any]) -> None:
    # ExaoneModel.set_gguf_parameters: the text keys (transformers' config names the layer count
    # num_hidden_layers and the epsilon rms_norm_eps) and the rotary dimensions.
    text_hparams(writer, dict(c, rms_norm_eps=c["layer_norm_epsilon"], layer_norm_epsilon=None))
    writer.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])

FAMILIES: tuple[Family, ...] = (
    Family("ministral3", "Ministral3ForCausalLM", thinking=False, add_bos=True, norm_one=1.0),
    Family("phi3", "Phi3ForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
    Family("gemma2", "Gemma2ForCausalLM", thinking=False, add_bos=True, norm_one=0.0),
    Family("smollm3", "SmolLM3ForCausalLM", thinking=True, add_bos=False, norm_one=1.0),
    Family("olmo2", "Olmo2ForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
    Family("olmo3", "Olmo3ForCausalLM", thinking=True, add_bos=False, norm_one=1.0),
    Family("granite", "GraniteForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
    Family("glm4", "Glm4ForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
    Family("exaone4", "Exaone4ForCausalLM", thinking=True, add_bos=False, norm_one=1.0),
    Family("cohere2", "Cohere2ForCausalLM", thinking=False, add_bos=True, norm_one=1.0),
    Family("starcoder2", "Starcoder2ForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
    Family("seed_oss", "SeedOssForCausalLM", thinking=True, add_bos=True, norm_one=1.0),
    Family("ernie4_5", "Ernie4_5ForCausalLM", thinking=False, add_bos=True, norm_one=1.0),
    Family("apertus", "ApertusForCausalLM", thinking=False, add_bos=True, norm_one=1.0),
    Family("exaone", "ExaoneForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
)
CONFIGS: dict[str, Callable[[str], dict[str, Any]]] = {
    "ministral3": _ministral3_config,
    "phi3": _phi3_config,
    "gemma2": _gemma2_config,
    "smollm3": _smollm3_config,
    "olmo2": _olmo2_config,
    "olmo3": _olmo3_config,
    "granite": _granite_config,
    "glm4": _glm4_config,
    "exaone4": _exaone4_config,
    "cohere2": _cohere2_config,
    "starcoder2": _starcoder2_config,
    "seed_oss": _seed_oss_config,
    "ernie4_5": _ernie4_5_config,
    "apertus": _apertus_config,
    "exaone": _exaone_config,
}
GGUF_TARGETS: dict[str, GgufTarget] = {
    "ministral3": GgufTarget("mistral3", permute_qk=True, norm_shift=0.0, all_hparams=_ministral3_hparams),
    "phi3": GgufTarget("phi3", permute_qk=False, norm_shift=0.0, all_hparams=_phi3_hparams,
                       extra_tensors=_phi3_rope_factors),
    "gemma2": GgufTarget("gemma2", permute_qk=False, norm_shift=1.0, all_hparams=_gemma2_hparams),
    "smollm3": GgufTarget("smollm3", permute_qk=True, norm_shift=0.0, all_hparams=_smollm3_hparams),
    "olmo2": GgufTarget("olmo2", permute_qk=False, norm_shift=0.0, all_hparams=_olmo2_hparams),
    "olmo3": GgufTarget("olmo2", permute_qk=False, norm_shift=0.0, all_hparams=_olmo2_hparams),
    "granite": GgufTarget("granite", permute_qk=True, norm_shift=0.0, all_hparams=_granite_hparams),
    "glm4": GgufTarget("glm4", permute_qk=False, norm_shift=0.0, all_hparams=_glm4_hparams),
    "exaone4": GgufTarget("exaone4", permute_qk=False, norm_shift=0.0, all_hparams=_exaone4_hparams),
    "cohere2": GgufTarget("cohere2", permute_qk=False, norm_shift=0.0, all_hparams=_cohere2_hparams),
    "starcoder2": GgufTarget("starcoder2", permute_qk=False, norm_shift=0.0, all_hparams=_text_only_hparams),
    "seed_oss": GgufTarget("seed_oss", permute_qk=False, norm_shift=0.0, all_hparams=_text_only_hparams),
    "ernie4_5": GgufTarget("ernie4_5", permute_qk=False, norm_shift=0.0, all_hparams=_text_only_hparams),
    "apertus": GgufTarget("apertus", permute_qk=False, norm_shift=0.0, all_hparams=_apertus_hparams,
                          dropped=tuple(f".act_fn.{key}" for key in XIELU)),
    "exaone": GgufTarget("exaone", permute_qk=False, norm_shift=0.0, all_hparams=_exaone_hparams),
}
