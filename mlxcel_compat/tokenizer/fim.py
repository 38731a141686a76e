"""The fill-in-the-middle (FIM) special tokens of a vocabulary, found as llama.cpp finds them.

llama.cpp (``llama-vocab.cpp``) takes each FIM token from the GGUF metadata
(``tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id``, and the older ``prefix``/``suffix``/
``middle`` keys), and when a key is absent it looks the token up by its text: ``<|fim_prefix|>``
(Qwen), ``<fim_prefix>`` (Granite), ``<｜fim▁begin｜>`` (DeepSeek), ``<PRE>`` / ``▁<PRE>``
(CodeLlama) and so on. A Hugging Face directory has no such metadata, so its tokens are found by
the text lookup alone, which is what llama.cpp does with the GGUF converted from it.

The pad, repo and file-separator tokens also end generation there (they are added to the
end-of-generation set whatever the metadata says): a code model that starts another file stops.

Pure Python: read by the loader and by the HTTP side (``/infill``), never touching MLX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# llama-vocab.cpp's lists, in its order (the first key found in the vocabulary wins there too,
# but it walks a hash map, so with two candidates in one vocabulary the lowest id is taken here).
FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# The GGUF keys before the fim_* names (llama.cpp still reads them).
_OLD_KEYS = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
_NAMES = {"pre": "prefix", "suf": "suffix", "mid": "middle"}


@dataclass(frozen=True)
class FimTokens:
    """The FIM token ids of a model (None: the vocabulary has no such token)."""

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    def missing(self) -> str:
        """llama-server's reason for refusing ``/infill`` ("prefix token is missing. ..."), or ""."""
        return "".join(f"{_NAMES[k]} token is missing. " for k in ("pre", "suf", "mid") if getattr(self, k) is None)

    def end_of_generation(self) -> list[int]:
        """The ids llama.cpp adds to the end-of-generation set: pad, repo and file separator."""
        return sorted({t for t in (self.pad, self.rep, self.sep) if t is not None})

    def as_dict(self) -> dict[str, int]:
        return {k: v for k in FIM_TEXTS if (v := getattr(self, k)) is not None}


def stated_ids(metadata: Mapping[str, object]) -> dict[str, int]:
    """The FIM ids a GGUF's metadata states. llama.cpp reads the fim_* keys and then the
    deprecated prefix/suffix/middle ones into the same ids, so a deprecated key that is present wins."""
    out: dict[str, int] = {}
    for key in FIM_TEXTS:
        for name in (f"fim_{key}", _OLD_KEYS.get(key)):
            value = metadata.get(f"tokenizer.ggml.{name}_token_id") if name else None
            if value is not None:
                out[key] = int(value)  # type: ignore[call-overload]
    return out


def find_fim_tokens(vocab: Mapping[str, int], n_vocab: int, stated: Mapping[str, int] | None = None) -> FimTokens:
    """Each FIM token: the stated id when it is inside the vocabulary, else the lowest id whose
    text is one of llama.cpp's names for it."""
    found: dict[str, int | None] = {}
    for key, texts in FIM_TEXTS.items():
        value = (stated or {}).get(key)
        if value is not None and not 0 <= value < n_vocab:
            value = None  # llama.cpp: "bad special token", the text lookup decides
        if value is None:
            ids = [vocab[t] for t in texts if t in vocab and 0 <= vocab[t] < n_vocab]
            value = min(ids) if ids else None
        found[key] = value
    return FimTokens(**found)


def model_fim_tokens(tokenizer: Any, n_vocab: int, gguf_specials: Any = None) -> FimTokens:
    """A loaded model's FIM tokens: a GGUF's as its metadata and token list gave them
    (``gguf_tokenizer.special_tokens``), a directory's found in its tokenizer's vocabulary."""
    if gguf_specials is not None:
        return FimTokens(**gguf_specials.fim)
    from mlxcel_compat.tokenizer.served import unwrap_tokenizer

    return find_fim_tokens(unwrap_tokenizer(tokenizer).get_vocab(), n_vocab)
