"""The metadata keys of a factory GGUF, as llama.cpp's converter writes them.

The architecture's hyperparameters and RoPE scaling from a ``config.json``, and the tokenizer
(``gpt2`` BPE, its pre-tokenizer's name, token types, special ids, the chat template) from a
model directory's tokenizer files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .gguf_tensors import GGUF_TARGETS

# llama.cpp's metadata keys for the FIM tokens (what convert_hf_to_gguf writes for Qwen2.5-Coder).
FIM_KEYS = {"<|fim_prefix|>": "fim_pre", "<|fim_suffix|>": "fim_suf", "<|fim_middle|>": "fim_mid",
            "<|fim_pad|>": "fim_pad", "<|repo_name|>": "fim_rep", "<|file_sep|>": "fim_sep"}


# Families whose converter class writes no ``{arch}.vocab_size`` (llama.cpp takes the count from
# the token list); found by scripts/check_gguf_architectures.py, which compares the keys.
NO_VOCAB_SIZE = ("qwen2", "qwen2_coder", "qwen3", "gemma3_text", "qwen3_moe", "qwen2_moe", "gpt_oss", "glm4_moe",
                 "olmoe", "ernie4_5_moe")
# Families whose converter writes no ``attention.key_length`` / ``value_length`` (llama.cpp takes
# hidden size / heads): Qwen2's and OLMoE's classes.
NO_HEAD_LENGTHS = ("qwen2", "qwen2_coder", "qwen2_moe", "olmoe")


def add_rope_scaling(writer: Any, config: dict[str, Any]) -> None:
    """``rope.scaling.*`` keys for a ``linear`` or ``yarn`` ``rope_scaling`` of ``config`` (Llama 3's
    is a tensor, ``gguf_tensors.llama3_rope_factors``); ``ValueError`` for other types."""
    import gguf

    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        if "beta_fast" in scaling:
            writer.add_rope_scaling_yarn_beta_fast(float(scaling["beta_fast"]))
        if "beta_slow" in scaling:
            writer.add_rope_scaling_yarn_beta_slow(float(scaling["beta_slow"]))
    elif kind not in (None, "default", "llama3"):  # llama3 is a tensor (gguf_tensors.converted_tensors)
        raise ValueError(f"the GGUF writer does not write rope_scaling type {kind!r}")


def add_hparams(writer: Any, family: str, config: dict[str, Any], weights: dict[str, Any] | None = None) -> None:
    """The architecture's hyperparameter keys, from ``config`` as the converter reads it for ``family``
    (and from ``weights``, for a family whose converter moves some into metadata)."""
    if (own := GGUF_TARGETS[family].all_hparams) is not None:
        own(writer, config, weights or {})
        return
    c = config
    add_rope_scaling(writer, c)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    # The converter counts a model's NextN (multi-token prediction) layers as blocks where it exports
    # them (glm4moe); only such families' factory configs carry num_nextn_predict_layers.
    writer.add_block_count(c["num_hidden_layers"] + c.get("num_nextn_predict_layers", 0))
    writer.add_head_count(c["num_attention_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    if family not in NO_VOCAB_SIZE:
        writer.add_vocab_size(c["vocab_size"])
    family_keys = GGUF_TARGETS[family].hparams
    if family in ("lfm2", "lfm2_moe"):
        writer.add_feed_forward_length(c.get("block_ff_dim", c["intermediate_size"]))
        writer.add_head_count_kv([c["num_key_value_heads"] if t == "full_attention" else 0
                                  for t in c["layer_types"]])
        writer.add_layer_norm_rms_eps(c["norm_eps"])
        writer.add_shortconv_l_cache(c["conv_L_cache"])
        if family_keys is not None:
            family_keys(writer, c)
        return
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if family not in NO_HEAD_LENGTHS:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family in ("llama", "mistral"):
        writer.add_rope_dimension_count(head_dim)
    if family == "gemma3_text":
        writer.add_sliding_window(c["sliding_window"])
        if c["sliding_window_pattern"] != 6:  # llama.cpp's default, all the converter's files rely on
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
        writer.add_rope_freq_base_swa(c["rope_local_base_freq"])
    if family_keys is not None:
        family_keys(writer, c)


def add_tokenizer(writer: Any, model_dir: Path, pre: str) -> None:
    """``model_dir``'s tokenizer as ``gpt2`` BPE with pre-tokenizer ``pre``: tokens, types (CONTROL for
    special added tokens, USER_DEFINED for the others), merges, FIM and special ids, BOS/EOS flags
    and the chat template."""
    from gguf import TokenType

    from . import tokenizer as tok

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    n_vocab = 1 + max(max(vocab.values()), *(a["id"] for a in tokenizer["added_tokens"]))
    tokens = [""] * n_vocab
    types = [int(TokenType.NORMAL)] * n_vocab
    for text, index in vocab.items():
        tokens[index] = text
    for added in tokenizer["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED)
        if added["content"] in FIM_KEYS:
            writer.add_uint32(f"tokenizer.ggml.{FIM_KEYS[added['content']]}_token_id", added["id"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if config.get("bos_token"):
        writer.add_bos_token_id(tok.token_id(config["bos_token"]))
    writer.add_eos_token_id(tok.token_id(config["eos_token"]))
    writer.add_pad_token_id(tok.token_id(config["pad_token"]))
    writer.add_add_bos_token(bool(config["add_bos_token"]))
    writer.add_add_eos_token(bool(config["add_eos_token"]))
    writer.add_chat_template(config["chat_template"])
