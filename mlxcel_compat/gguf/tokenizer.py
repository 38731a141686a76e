"""The tokenizer and chat templates a GGUF file describes, as a ``tokenizer.ServedTokenizer``.

A GGUF has no ``tokenizer.json``: the vocabulary, merges, scores, token types, pre-tokenizer
name and special token ids are metadata (``tokenizer.ggml.*``). transformers' GGUF tokenizer
mapping (``convert_gguf_tokenizer``) builds a ``tokenizers`` object from exactly those fields
and does not import torch (transformers' GGUF *tensor* reader does, so it is not used). The
result, wrapped in transformers' ``PreTrainedTokenizerFast`` with the file's special tokens and
chat templates, is saved as an ordinary tokenizer directory (``tokenizer.json``,
``tokenizer_config.json``, the template files) and loaded from it by ``tokenizer/served.py``
exactly as a Hugging Face directory of the same model is.

The conversion is the only step that needs transformers, and it runs in a child process
(``tokenizer_cache.py``: ``python -m mlxcel_compat.tokenizer.cache gguf FILE OUT``), so the serving process never
imports transformers (nor torch, which importing transformers imports where it is installed),
not even on a first start.

What llama.cpp derives from the metadata is derived the same way here:

- end-of-generation ids: EOS, EOT and EOM ids, plus any control or user-defined token whose
  text is one of llama.cpp's end-of-turn markers (``<|im_end|>``, ``<|eot_id|>``, ...);
- ``add_bos_token`` defaults to true for SentencePiece (``llama``) vocabularies;
- ``tokenizer.chat_template`` is the default template and ``tokenizer.chat_template.NAME``
  become named templates (``tool_use``, ...);
- FIM token ids (``tokenizer.ggml.fim_*_token_id``, else found by their text, ``tokenizer/fim.py``)
  are reported in ``SpecialTokens``; the FIM pad, repo and file-separator tokens end generation.

The converted directory is cached (``$XDG_CACHE_HOME/mlxcel_compat/gguf-tokenizers``, else
``~/.cache/...``), keyed by a hash of what the conversion reads (the architecture and every
``tokenizer.*`` metadata key, after ``--override-kv``), the converting modules' source and the
transformers/tokenizers versions (read from the installed distributions, not imported): a restart
of the same model, or another quantization of it (its Q4_K_M and Q8_0 files hold the same
vocabulary), then loads ``tokenizer.json`` straight into ``tokenizers``, with no child process. An unusable cache directory only means converting every time; a cached entry
that fails to load is rebuilt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel_compat.tokenizer.fim import FIM_TEXTS, find_fim_tokens, stated_ids
from mlxcel_compat.gguf.reader import GGUFModelFile, unpacked
from mlxcel_compat.runtime.backend import release_free_memory
from mlxcel_compat.tokenizer import cache as tokenizer_cache
from mlxcel_compat.tokenizer.served import ServedTokenizer

log = logging.getLogger(__name__)

# llama.cpp (llama-vocab.cpp) treats tokens with these texts as end of generation.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>",
    "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})
CONTROL, USER_DEFINED = 3, 4


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
    # One pass over the vocabulary, keeping only the texts looked for: no table of every token's
    # text (262K strings on Gemma 3) is built, even for a moment.
    fim_texts = {text for texts in FIM_TEXTS.values() for text in texts}
    first_ids: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if text in EOG_TEXTS and kind in (CONTROL, USER_DEFINED):
            eog.add(i)
        if text in fim_texts:
            first_ids.setdefault(text, i)
    fim = find_fim_tokens(first_ids, len(tokens), stated_ids(md))
    eog.update(fim.end_of_generation())
    specials.eog = sorted(eog)
    specials.fim = fim.as_dict()
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
    return {name: unpacked(md[f"tokenizer.ggml.{key}"]) for key, name in renames.items() if f"tokenizer.ggml.{key}" in md}


def _convert(architecture: str, tokenizer_dict: dict[str, Any]) -> Any:
    """The ``tokenizers.Tokenizer`` for this vocabulary (transformers' GGUF tokenizer mapping)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:  # transformers < 5.x kept it in one module
        from transformers.integrations.ggml import convert_gguf_tokenizer  # type: ignore[no-redef]
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    if tokenizer_dict.get("tokenizer_type") == "llama":
        _space_prefix_like_llama_cpp(backend, bool(tokenizer_dict.get("add_prefix_space", True)))
    if tokenizer_dict.get("tokenizer_type") == "gpt2":
        backend = _added_tokens_as_text(backend, tokenizer_dict)
    return backend


def _added_tokens_as_text(backend: Any, tokenizer_dict: dict[str, Any]) -> Any:
    """Byte-level BPE: match CONTROL and USER_DEFINED tokens by their text, as llama.cpp does.

    llama.cpp (``llama-vocab.cpp``) finds every control / user-defined token in the input by the
    exact text the file stores, before byte-level BPE runs, and llama.cpp's converter stores added
    tokens as their text (``"\\n\\n"``), not in the byte alphabet (``"ĊĊ"``). transformers' converter
    respells such a token in the byte alphabet and then leaves it out of the added tokens (it
    takes text outside the alphabet for a mislabel), so ``"\\n\\n"`` was encoded as two ``"\\n"``
    and, where the respelling equals an ordinary token's, that token lost its vocabulary entry.
    Here such tokens get their text back as their vocabulary entry and become added tokens
    (special when CONTROL) at their own ids; ordinary tokens keep theirs. ``tokenizers`` gives an
    added token the id its text has in the vocabulary, hence the edit of the serialized form.
    """
    import json

    from tokenizers import Tokenizer, pre_tokenizers

    tokens: list[str] = tokenizer_dict["tokens"]
    types: list[int] = tokenizer_dict.get("token_type") or []
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    as_text = {index: kind for index, (text, kind) in enumerate(zip(tokens, types))
               if kind in (CONTROL, USER_DEFINED) and not set(text) <= alphabet}
    if not as_text:
        return backend
    data = json.loads(backend.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for spelling in [spelling for spelling, index in vocab.items() if index in as_text]:
        del vocab[spelling]
    for index, text in enumerate(tokens):  # an ordinary token whose entry a respelling took
        if index not in as_text and text not in vocab and set(text) <= alphabet:
            vocab[text] = index
    taken = {added["id"] for added in data["added_tokens"]}
    for index, kind in as_text.items():
        vocab[tokens[index]] = index
        if index not in taken:
            data["added_tokens"].append({"id": index, "content": tokens[index], "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": kind == CONTROL})
    data["added_tokens"].sort(key=lambda added: added["id"])
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def _space_prefix_like_llama_cpp(backend: Any, add_space_prefix: bool) -> None:
    """SentencePiece vocabularies: put the "▁" prefix where llama.cpp puts it.

    transformers builds them with a ``Metaspace`` pre-tokenizer that prefixes only the start of
    the text and only when it does not already begin with a space. llama.cpp prefixes a space to
    every text fragment that starts the input or follows a special token, whatever it begins
    with, and not at all when ``tokenizer.ggml.add_space_prefix`` is false; so does the legacy
    Llama 2 ``tokenizer.json`` (a ``Prepend`` normalizer, applied to each piece of text between
    special tokens). Measured on a SentencePiece vocabulary: ``"<s>[INST]"``, ``"a</s>b"`` and
    ``"  two"`` tokenize differently without this. Builders with their own layout (Gemma, Phi-3:
    no ``Metaspace``) are left alone.
    """
    from tokenizers import decoders, normalizers, pre_tokenizers

    if not isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace):
        return
    space = "\u2581"
    steps = [normalizers.Prepend(space)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", space)])
    backend.pre_tokenizer = None
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])


def default_cache_dir() -> Path:
    """Where converted tokenizers are kept: ``$XDG_CACHE_HOME`` (else ``~/.cache``) ``/mlxcel_compat/gguf-tokenizers``."""
    return tokenizer_cache.cache_root() / "gguf-tokenizers"


def cache_key(file: GGUFModelFile) -> str:
    """Changes whenever the converted tokenizer could: the metadata the conversion reads (the
    architecture and every ``tokenizer.*`` key, ``--override-kv`` applied), the code converting
    it (this module and ``encoder_vocab``) and the libraries it uses. Not the rest of the header:
    the quantizations of one model share one entry."""
    import orjson
    from blake3 import blake3

    from mlxcel_compat.gguf import encoder_vocab

    digest = blake3(Path(__file__).read_bytes())
    digest.update(Path(encoder_vocab.__file__).read_bytes())
    digest.update(tokenizer_cache.library_versions().encode())
    read = {key: value for key, value in file.metadata.items() if key.startswith("tokenizer.")}
    digest.update(orjson.dumps([file.architecture, read], default=unpacked,  # the same text as lists give
                               option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY))
    return digest.hexdigest()[:32]


def hf_tokenizer(file: GGUFModelFile) -> Any:
    """The transformers tokenizer the GGUF metadata describes: the conversion itself, which
    :func:`convert` saves (imports transformers; the tests compare the served tokenizer with it)."""
    tokenizer_dict = _tokenizer_dict(file)
    specials = special_tokens(file)
    from transformers import PreTrainedTokenizerFast

    from mlxcel_compat.gguf import encoder_vocab

    if encoder_vocab.is_encoder_vocab(file.architecture, tokenizer_dict.get("tokenizer_type")):
        return encoder_vocab.hf_tokenizer(file.metadata)  # BERT-family vocabularies (WPM, UGM)
    backend = _convert(file.architecture, tokenizer_dict)
    tokens = tokenizer_dict["tokens"]

    def text(token_id: int | None) -> str | None:
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    return PreTrainedTokenizerFast(
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


def convert(file: GGUFModelFile, directory: Path) -> None:
    """Save the converted tokenizer of ``file`` into ``directory`` (imports transformers)."""
    hf_tokenizer(file).save_pretrained(directory)


def load_tokenizer(file: GGUFModelFile, cache_dir: Path | None = None) -> tuple[ServedTokenizer, SpecialTokens]:
    """The GGUF's tokenizer and its special tokens.

    Always loaded from a tokenizer directory: the cached one when this header was converted
    before, else a fresh conversion (in a child process: ``tokenizer_cache.py``) saved into the
    cache (or a temporary directory when the cache cannot be written).
    """
    if "tokenizer.ggml.tokens" not in file.metadata:
        raise ValueError(f"'{file.path}' has no tokenizer (tokenizer.ggml.tokens is missing)")
    specials = special_tokens(file)

    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()

    def convert(out: Path) -> None:
        log.info("converting the GGUF's tokenizer (%d tokens) with transformers' converter, in a child process, "
                 "once: later starts of this file (or another quantization of its model) read it from %s", len(file.metadata["tokenizer.ggml.tokens"]),
                 cache_dir)
        tokenizer_cache.convert_in_child("mlxcel_compat.gguf.tokenizer", Path(file.path), out,
                                         extra_args=(file.overrides_json,) if file.overrides_json else ())

    tokenizer = tokenizer_cache.load_converted(cache_key(file), cache_dir, convert, specials.eog)
    # Reading tokenizer.json leaves its parse's garbage in the C heap (~280 MiB for a 262K
    # vocabulary with 500K merges, for ~60 MiB kept): handed back now, before the weights come
    # in, the start's peak RSS is the larger of the two instead of their sum.
    release_free_memory()
    return tokenizer, specials


def main(argv: list[str] | None = None) -> int:
    """``python -m mlxcel_compat.gguf.tokenizer FILE.gguf OUT [OVERRIDES_JSON]``: the child process of
    :func:`load_tokenizer` (``tokenizer/cache.py: convert_in_child``), which imports transformers
    so the serving process does not. ``OVERRIDES_JSON``: the ``--override-kv`` items the server
    applied to the metadata (``gguf/overrides.py``), applied here the same way."""
    import sys

    from mlxcel_compat.gguf.overrides import overrides_from_json
    from mlxcel_compat.gguf.reader import open_gguf

    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m mlxcel_compat.gguf.tokenizer FILE.gguf OUT [OVERRIDES_JSON]", file=sys.stderr)
        return 2
    file = open_gguf(args[0])
    if len(args) == 3:
        file = with_overrides(file, overrides_from_json(args[2]))
    convert(file, Path(args[1]))
    return 0


def with_overrides(file: GGUFModelFile, overrides: Any) -> GGUFModelFile:
    """``file`` with ``--override-kv`` applied to its metadata (``gguf/overrides.py``), in place."""
    from mlxcel_compat.gguf.overrides import apply_kv_overrides, overrides_json

    overrides = tuple(overrides)
    if overrides:
        file.metadata = apply_kv_overrides(file.metadata, overrides)
        file.overrides_json = overrides_json(overrides)
    return file


if __name__ == "__main__":
    raise SystemExit(main())
