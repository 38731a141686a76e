"""The factory's model families: what each (family, size) pair is.

Each pair maps to one mlx-lm architecture and one config (``model_config``); :class:`Family`
holds what differs between families besides the config numbers (the chat template's reasoning,
BOS, the norm weights' meaning of 1, FIM tokens). The weights are ``weights.py``'s, the
directories ``model_directory.py``'s.
"""

from __future__ import annotations

from typing import Any

from . import families_dense, families_hybrid, families_moe, hf_layouts
from . import tokenizer as tok
from .family import Family

SIZES: tuple[str, ...] = ("tiny", "small")
MAX_POSITION_EMBEDDINGS = 32768

# Every family's end-of-generation ids (config.json and generation_config.json): <|im_end|>, <|endoftext|>.
EOS_IDS = [tok.token_id(tok.IM_END), tok.token_id(tok.ENDOFTEXT)]


# Family name -> its spec, in the order the command line lists them.
FAMILY_SPECS: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", thinking=False, add_bos=True, norm_one=1.0),
        Family("qwen3", "Qwen3ForCausalLM", thinking=True, add_bos=False, norm_one=1.0),
        Family("gemma3_text", "Gemma3ForCausalLM", thinking=False, add_bos=False, norm_one=0.0),
        Family("qwen3_next", "Qwen3NextForCausalLM", thinking=True, add_bos=False, norm_one=1.0),
        Family("qwen2", "Qwen2ForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
        Family("mistral", "MistralForCausalLM", thinking=False, add_bos=True, norm_one=1.0),
        Family("lfm2", "Lfm2ForCausalLM", thinking=False, add_bos=False, norm_one=1.0, hf_layout=hf_layouts.lfm2),
        # Qwen2.5-Coder's shape: qwen2 with the FIM tokens (<|fim_prefix|>, ..., <|file_sep|>) added.
        Family("qwen2_coder", "Qwen2ForCausalLM", thinking=False, add_bos=False, norm_one=1.0, model_type="qwen2", fim=True),
    )
}

# The families every family-wide test runs on; the FIM ones are served by /infill's tests.
FIM_FAMILIES: tuple[str, ...] = tuple(name for name, f in FAMILY_SPECS.items() if f.fim)
FAMILIES: tuple[str, ...] = tuple(name for name in FAMILY_SPECS if name not in FIM_FAMILIES)
# The architectures served from GGUF beyond the families above (dense, MoE, hybrid), one family
# each: tested by tests/gguf/test_architectures_*.py, not by every family-wide test.
ARCHITECTURE_FAMILIES: tuple[str, ...] = tuple(
    f.name for f in (*families_dense.FAMILIES, *families_moe.FAMILIES, *families_hybrid.FAMILIES))
FAMILY_SPECS.update({f.name: f for f in (*families_dense.FAMILIES, *families_moe.FAMILIES,
                                        *families_hybrid.FAMILIES)})


def _llama_config(size: str) -> dict[str, Any]:
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=192)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, intermediate_size=2048)
    return dict(dims, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                attention_bias=False, mlp_bias=False, hidden_act="silu")


def _qwen3_config(size: str) -> dict[str, Any]:
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=192)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, intermediate_size=2304)
    return dict(dims, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                attention_bias=False, hidden_act="silu")


def _gemma3_text_config(size: str) -> dict[str, Any]:
    # The tiny sliding window is small so tests can make the RotatingKVCache wrap.
    if size == "tiny":
        # Every other layer global, so four layers hold both kinds; the real models' period of 6
        # (which llama.cpp assumes when a file names none) is the small size's.
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=192,
                    sliding_window=64, sliding_window_pattern=2)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, intermediate_size=2304,
                    sliding_window=512, sliding_window_pattern=6)
    pattern = dims["sliding_window_pattern"]
    layer_types = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(dims["num_hidden_layers"])
    ]
    return dict(dims, layer_types=layer_types, query_pre_attn_scalar=dims["head_dim"],
                rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")


def _qwen3_next_config(size: str) -> dict[str, Any]:
    # Qwen3-Next-80B-A3B's structure: 3 gated delta-net layers to 1 attention layer, and every
    # layer's MLP a mixture of experts (softmax router, top-k renormalised) with a gated shared
    # expert, as llama.cpp's qwen3next requires.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=192,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, intermediate_size=2048,
                    linear_num_key_heads=4, linear_num_value_heads=8,
                    linear_key_head_dim=64, linear_value_head_dim=64,
                    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                    shared_expert_intermediate_size=128)
    return dict(dims, full_attention_interval=4, linear_conv_kernel_dim=4,
                partial_rotary_factor=0.25, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                rms_norm_eps=1e-6, rope_theta=10000000.0, tie_word_embeddings=False,
                attention_bias=False, hidden_act="silu")


def _qwen2_config(size: str) -> dict[str, Any]:
    # Qwen2 has biases on the q/k/v projections and head_dim = hidden / heads.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=192)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, intermediate_size=2304)
    return dict(dims, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                hidden_act="silu")


def _mistral_config(size: str) -> dict[str, Any]:
    # Llama's shape, Mistral-Nemo style: head_dim is not hidden / heads, so GGUF files carry key_length.
    config = _llama_config(size)
    if size == "tiny":
        config.update(head_dim=32)
    else:
        config.update(num_attention_heads=8, head_dim=128)
    config.update(rope_theta=1000000.0, sliding_window=None)
    return config


def _lfm2_config(size: str) -> dict[str, Any]:
    # A hybrid: short-convolution layers (ArraysCache) with a few attention layers (KVCache).
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, block_ff_dim=192)
        attention = (2,)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, block_ff_dim=2304)
        attention = (2, 5, 8, 10)
    layer_types = ["full_attention" if i in attention else "conv"
                   for i in range(dims["num_hidden_layers"])]
    return dict(dims, layer_types=layer_types, block_dim=dims["hidden_size"],
                intermediate_size=dims["block_ff_dim"], block_auto_adjust_ff_dim=False,
                block_multiple_of=256, block_ffn_dim_multiplier=1.0, conv_L_cache=3,
                conv_bias=False, norm_eps=1e-5, rope_theta=1000000.0, tie_embedding=True)


_CONFIGS = {
    "llama": _llama_config,
    "qwen3": _qwen3_config,
    "gemma3_text": _gemma3_text_config,
    "qwen3_next": _qwen3_next_config,
    "qwen2": _qwen2_config,
    "mistral": _mistral_config,
    "lfm2": _lfm2_config,
}
_CONFIGS.update(families_dense.CONFIGS)
_CONFIGS.update(families_moe.CONFIGS)
_CONFIGS.update(families_hybrid.CONFIGS)


def family_spec(family: str, size: str) -> Family:
    """The :class:`Family` of a (family, size) pair; ``ValueError`` naming the choices for an
    unknown family or size (every entry point checks its pair here first)."""
    if family not in FAMILY_SPECS:
        raise ValueError(f"unknown model family {family!r}; choose one of: {', '.join(FAMILY_SPECS)}")
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of: {', '.join(SIZES)}")
    return FAMILY_SPECS[family]


def model_config(family: str, size: str) -> dict[str, Any]:
    """The ``config.json`` content for a pair (keys sorted when written)."""
    spec = family_spec(family, size)
    config = _CONFIGS.get(spec.name, _CONFIGS[spec.kind])(size)  # a family's own config, else its model type's
    config.update(
        model_type=spec.kind,
        architectures=[spec.architecture],
        vocab_size=tok.VOCAB_SIZE + (len(tok.FIM_TOKENS) if spec.fim else 0),
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=tok.token_id(tok.BEGIN_OF_TEXT) if spec.add_bos else None,
        eos_token_id=EOS_IDS,
        pad_token_id=tok.token_id(tok.ENDOFTEXT),
        torch_dtype="float32",
    )
    return config
