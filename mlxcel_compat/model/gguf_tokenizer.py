"""The tokenizer and chat templates a GGUF file describes, as an mlx-lm ``TokenizerWrapper``.

A GGUF has no ``tokenizer.json``: the vocabulary, merges, scores, token types, pre-tokenizer
name and special token ids are metadata (``tokenizer.ggml.*``). transformers' GGUF tokenizer
mapping (``convert_gguf_tokenizer``) builds a ``tokenizers`` object from exactly those fields
and does not import torch (transformers' GGUF *tensor* reader does, so it is not used). The
result is saved as an ordinary tokenizer directory and loaded with mlx-lm's own tokenizer
loader, so detokenizer choice, tool-call parsing and the chat template behave as they do for a
Hugging Face directory of the same model.

What llama.cpp derives from the metadata is derived the same way here:

- end-of-generation ids: EOS, EOT and EOM ids, plus any control or user-defined token whose
  text is one of llama.cpp's end-of-turn markers (``<|im_end|>``, ``<|eot_id|>``, ...);
- ``add_bos_token`` defaults to true for SentencePiece (``llama``) vocabularies;
- ``tokenizer.chat_template`` is the default template and ``tokenizer.chat_template.NAME``
  become named templates (``tool_use``, ...);
- FIM token ids (``tokenizer.ggml.fim_*_token_id``) are reported in ``SpecialTokens``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel_compat.model.gguf import GGUFModelFile

# llama.cpp (llama-vocab.cpp) treats tokens with these texts as end of generation.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
    "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})
CONTROL, USER_DEFINED = 3, 4
FIM_KEYS = ("pre", "suf", "mid", "pad", "rep", "sep")


@dataclass
class SpecialTokens:
    """Special token ids as the GGUF states them (None when absent)."""

    bos: int | None
    eos: int | None
    eot: int | None
    eom: int | None
    add_bos: bool
    add_eos: bool
    eog: list[int] = field(default_factory=list)
    fim: dict[str, int] = field(default_factory=dict)  # "pre", "suf", "mid", ... -> id


def _meta_int(file: GGUFModelFile, key: str) -> int | None:
    value = file.metadata.get(f"tokenizer.ggml.{key}")
    return int(value) if value is not None else None


def special_tokens(file: GGUFModelFile) -> SpecialTokens:
    md = file.metadata
    tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
    types: list[int] = md.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    model = md.get("tokenizer.ggml.model")
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    specials = SpecialTokens(
        bos=_meta_int(file, "bos_token_id"),
        eos=_meta_int(file, "eos_token_id"),
        eot=_meta_int(file, "eot_token_id"),
        eom=_meta_int(file, "eom_token_id"),
        add_bos=bool(add_bos) if add_bos is not None else model == "llama",
        add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)),
    )
    eog = {i for i in (specials.eos, specials.eot, specials.eom) if i is not None}
    eog.update(i for i, (text, kind) in enumerate(zip(tokens, types))
               if text in EOG_TEXTS and kind in (CONTROL, USER_DEFINED))
    specials.eog = sorted(eog)
    specials.fim = {k: v for k in FIM_KEYS if (v := _meta_int(file, f"fim_{k}_token_id")) is not None}
    if specials.bos is None:
        specials.add_bos = False
    return specials


def chat_templates(file: GGUFModelFile) -> str | dict[str, str] | None:
    """The default template, or a name -> template dict when named variants exist."""
    md = file.metadata
    default = md.get("tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = {key[len(prefix):]: value for key, value in md.items() if key.startswith(prefix)}
    if not named:
        return default
    if default is not None:
        named = {"default": default, **named}
    return named


def _tokenizer_dict(file: GGUFModelFile) -> dict[str, Any]:
    """The fields transformers' converter reads, under its names."""
    md = file.metadata
    renames = {
        "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
        "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
        "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
        "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
    }
    return {name: md[f"tokenizer.ggml.{key}"] for key, name in renames.items() if f"tokenizer.ggml.{key}" in md}


def _convert(architecture: str, tokenizer_dict: dict[str, Any]) -> Any:
    """The ``tokenizers.Tokenizer`` for this vocabulary (transformers' GGUF tokenizer mapping)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers < 5.x kept it in one module
        from transformers.integrations.ggml import convert_gguf_tokenizer  # type: ignore[no-redef]
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend


def load_tokenizer(file: GGUFModelFile) -> tuple[Any, SpecialTokens]:
    """An mlx-lm ``TokenizerWrapper`` for the GGUF's tokenizer, and its special tokens."""
    from mlx_lm.tokenizer_utils import load as load_wrapper
    from transformers import PreTrainedTokenizerFast

    tokenizer_dict = _tokenizer_dict(file)
    if "tokens" not in tokenizer_dict:
        raise ValueError(f"'{file.path}' has no tokenizer (tokenizer.ggml.tokens is missing)")
    specials = special_tokens(file)
    backend = _convert(file.architecture, tokenizer_dict)
    tokens = tokenizer_dict["tokens"]

    def text(token_id: int | None) -> str | None:
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=text(specials.bos),
        eos_token=text(specials.eos),
        unk_token=text(tokenizer_dict.get("unk_token_id")),
        pad_token=text(tokenizer_dict.get("pad_token_id")),
        add_bos_token=specials.add_bos,
        add_eos_token=specials.add_eos,
        clean_up_tokenization_spaces=False,
        chat_template=chat_templates(file),
    )
    with tempfile.TemporaryDirectory(prefix="mlxcel-gguf-tokenizer-") as tmp:
        hf.save_pretrained(tmp)
        wrapper = load_wrapper(Path(tmp), eos_token_ids=specials.eog)
    return wrapper, specials
