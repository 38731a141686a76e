"""The tokenizers of BERT-family GGUFs, rebuilt as ``tokenizers`` objects (pure Python).

transformers' GGUF tokenizer mapping knows decoder vocabularies only. llama.cpp writes an
encoder's vocabulary in one of two forms, both read here as its tokenizer reads them:

- ``tokenizer.ggml.model = bert`` (WPM, llama-vocab.cpp): the WordPiece vocabulary in "phantom
  space" form: a word-start piece is spelled ``▁word``, a continuation piece bare (the
  checkpoint's ``##piece``), special tokens as they are. Text is lowercased and its accents
  stripped unless ``tokenizer.ggml.normalizer.lowercase`` / ``strip_accents`` say otherwise,
  split on whitespace and punctuation; the input gets ``[CLS] ... [SEP]`` (BOS, then SEP).
- ``tokenizer.ggml.model = t5`` (UGM) on architecture ``bert``: XLM-R's SentencePiece Unigram
  vocabulary with scores, its precompiled normalizer, ``▁`` word prefixes; BOS and EOS added
  by the file's ``add_bos_token`` / ``add_eos_token``.

A pair (a cross-encoder's query and document) is laid out as the checkpoint's own tokenizer
lays it out: ``[CLS] a [SEP] b [SEP]`` with token types 0 then 1, or ``<s> a </s></s> b </s>``.
"""

from __future__ import annotations

from typing import Any

CONTROL = 3
ENCODER_VOCABS = ("bert", "t5")


def is_encoder_vocab(architecture: str, tokenizer_type: str | None) -> bool:
    return architecture in ("bert", "nomic-bert", "xlm-roberta") and tokenizer_type in ENCODER_VOCABS


def _token(tokens: list[str], index: Any) -> str | None:
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None


def wordpiece_backend(md: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """A WPM vocabulary as a ``tokenizers.Tokenizer``, and its special tokens by role."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    kinds: list[int] = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab: dict[str, int] = {}
    for i, (text, kind) in enumerate(zip(tokens, kinds)):
        if kind == CONTROL:
            word = text
        elif text.startswith("\u2581"):
            word = text[1:]
        else:
            word = "##" + text
        vocab.setdefault(word, i)
    roles = {
        "cls_token": _token(tokens, md.get("tokenizer.ggml.bos_token_id", 101)),  # llama.cpp: the BOS is the CLS
        "sep_token": _token(tokens, md.get("tokenizer.ggml.seperator_token_id", 102)),
        "unk_token": _token(tokens, md.get("tokenizer.ggml.unknown_token_id", 100)),
        "pad_token": _token(tokens, md.get("tokenizer.ggml.padding_token_id", 0)),
        "mask_token": _token(tokens, md.get("tokenizer.ggml.mask_token_id", 103)),
    }
    lowercase = bool(md.get("tokenizer.ggml.normalizer.lowercase", True))
    strip = bool(md.get("tokenizer.ggml.normalizer.strip_accents", lowercase))
    tk = Tokenizer(models.WordPiece(vocab, unk_token=roles["unk_token"] or "[UNK]", max_input_chars_per_word=100))
    tk.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=strip,
                                               lowercase=lowercase)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds) if k == CONTROL])
    cls, sep = roles["cls_token"], roles["sep_token"]
    if cls is not None and sep is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    return tk, {k: v for k, v in roles.items() if v is not None}


def unigram_backend(md: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """An XLM-R (UGM) vocabulary as a ``tokenizers.Tokenizer``, and its special tokens by role."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    scores: list[float] = list(md.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    kinds: list[int] = list(md.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    unk = int(md.get("tokenizer.ggml.unknown_token_id", 3))
    tk = Tokenizer(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores)], unk_id=unk))
    steps: list[Any] = []
    charsmap = md.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        steps.append(normalizers.Precompiled(bytes(charsmap)))
    if md.get("tokenizer.ggml.remove_extra_whitespaces", True):
        # SentencePiece's remove_extra_whitespaces: no leading or trailing blanks, no runs of them
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    tk.normalizer = normalizers.Sequence(steps)
    prepend = "always" if md.get("tokenizer.ggml.add_space_prefix", True) else "never"
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend)
    tk.decoder = decoders.Metaspace(prepend_scheme=prepend)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds) if k == CONTROL])
    bos = _token(tokens, md.get("tokenizer.ggml.bos_token_id", 0))
    eos = _token(tokens, md.get("tokenizer.ggml.eos_token_id", 2))
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", True)) and eos is not None
    head, tail = (f"{bos} " if add_bos else ""), (f" {eos}" if add_eos else "")
    specials = [(t, tokens.index(t)) for t in (bos, eos) if t is not None]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{head}$A{tail}", pair=f"{head}$A{tail}{tail} $B{tail}", special_tokens=specials)
    roles = {"bos_token": bos, "eos_token": eos, "cls_token": bos, "sep_token": eos, "unk_token": _token(tokens, unk),
             "pad_token": _token(tokens, md.get("tokenizer.ggml.padding_token_id", 1)),
             "mask_token": _token(tokens, md.get("tokenizer.ggml.mask_token_id"))}
    return tk, {k: v for k, v in roles.items() if v is not None}


def hf_tokenizer(md: dict[str, Any]) -> Any:
    """The transformers tokenizer of an encoder GGUF (for mlx-lm's tokenizer loader to save and load)."""
    from transformers import PreTrainedTokenizerFast

    kind = md.get("tokenizer.ggml.model")
    backend, roles = wordpiece_backend(md) if kind == "bert" else unigram_backend(md)
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if kind == "bert" else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   model_input_names=inputs, **roles)
