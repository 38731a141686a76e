"""Turn llama-server's ``prompt`` shapes into token lists, refusing what cannot fit first.

One prompt is a string, an array of token ids, or a mixed array of ids and strings. Several
prompts are an array with no bare integer at the top level. BOS is added only when the model adds
one and the prompt is a string or starts with a string (llama-server's rule).

Before a string is tokenized, its length is checked against the context with a proven bound
(:class:`PromptBound`): no token of the vocabulary covers more than ``chars_per_token``
characters, so a text of ``c`` characters needs at least ``ceil(c / chars_per_token)`` tokens. A
text whose bound already reaches the context is refused without tokenizing it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from mlxcel_compat.server.errors import ContextExceeded, InvalidRequest

# Normalizers that never shorten the text; composing Unicode normalizers shorten it by at most this
# factor (a precomposed character decomposes into at most 4 code points, Hangul syllables into 3).
_LENGTH_KEEPING_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "NFKD", "Replace"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_COMPOSITION_FACTOR = 4
# Pre-tokenizers that keep every character (whitespace-splitting ones drop the whitespace).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


@dataclass(frozen=True)
class PromptBound:
    """What the prompt checks need: the context and the proven characters-per-token bound."""

    n_ctx: int
    chars_per_token: int | None  # None: no proof for this tokenizer, every text is tokenized

    def min_tokens(self, n_chars: int) -> int:
        """A lower bound on the tokens of a text of ``n_chars`` characters (0 without a bound)."""
        return math.ceil(n_chars / self.chars_per_token) if self.chars_per_token else 0

    def check(self, n_chars: int, n_tokens: int = 0) -> None:
        """Refuse a prompt of ``n_chars`` characters (plus ``n_tokens`` given as ids) that cannot fit."""
        at_least = n_tokens + self.min_tokens(n_chars)
        if at_least >= self.n_ctx:
            raise ContextExceeded(at_least, self.n_ctx, at_least=True)


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters one token can stand for, or None when no such bound can be proven.

    Read from the fast tokenizer's definition: the longest vocabulary entry (byte-level entries
    are one character per byte, and a character is at least one byte; byte-fallback entries
    like ``<0x0A>`` are longer than the byte they stand for), multiplied by the factor a composing
    normalizer (NFC/NFKC) can shorten text by. There is no bound when characters can vanish or
    merge before the model sees them: a normalizer that strips or rewrites, a pre-tokenizer that
    drops whitespace, or unknown characters fused into one ``<unk>`` token.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)  # the served tokenizer or an HF fast one
    if backend is None:  # mlx-lm's TokenizerWrapper holds one
        backend = getattr(getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None)
    if backend is None:
        return None
    # The parts are read one by one: the whole definition's JSON (backend.to_str()) holds every
    # merge, a few hundred MiB of Python objects for a moment with a 262K vocabulary.
    model = backend.model
    if type(model).__name__ != "BPE" or model.fuse_unk:
        return None
    factor = _normalizer_factor(_part_spec(backend.normalizer))
    if factor is None or not _keeps_characters(_part_spec(backend.pre_tokenizer)):
        return None
    longest = max((len(backend.id_to_token(i) or "") for i in range(backend.get_vocab_size(with_added_tokens=True))),
                  default=0)
    return longest * factor if longest else None


def _part_spec(part: Any) -> dict[str, Any] | None:
    """A tokenizer part's (normalizer, pre-tokenizer) JSON definition, as tokenizer.json has it."""
    return None if part is None else json.loads(part.__getstate__())


def _normalizer_factor(spec: dict[str, Any] | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in spec.get("normalizers", []):
            f = _normalizer_factor(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        # A literal replacement that is never shorter keeps the length; regexes are not judged.
        return 1 if "String" in pattern and len(content) >= len(pattern["String"]) else None
    if kind in _LENGTH_KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _COMPOSITION_FACTOR
    return None


def _keeps_characters(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(inner) for inner in spec.get("pretokenizers", []))
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tokenize_text(tokenizer: Any, text: str, add_special: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def tokenize_one(tokenizer: Any, prompt: Any, vocab_size: int, bound: PromptBound | None = None) -> list[int]:
    if isinstance(prompt, dict):
        if "multimodal_data" in prompt:
            # llama-server's words and status on a model without a projector (its completion
            # handler turns every tokenizing error into a 400).
            raise InvalidRequest("Multimodal data provided, but model does not support multimodal requests.")
        prompt = prompt.get("prompt_string")
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt_string must be a string")
    if isinstance(prompt, str):
        if bound is not None:
            bound.check(len(prompt))
        return tokenize_text(tokenizer, prompt, True)
    if isinstance(prompt, list):
        # Checked with C-speed built-ins: a token-id array may hold hundreds of thousands of ids.
        kinds = set(map(type, prompt))
        if not kinds <= {int, str}:  # bool is not a token id
            raise InvalidRequest("\"prompt\" must be a string, an array of token ids or a mixed array of strings and token ids")
        if str not in kinds:
            tokens = list(prompt)
            if bound is not None:
                bound.check(0, len(tokens))
        else:
            texts = [piece for piece in prompt if isinstance(piece, str)]
            if bound is not None:
                bound.check(sum(map(len, texts)), len(prompt) - len(texts))
            tokens = []
            for i, piece in enumerate(prompt):
                if isinstance(piece, str):
                    tokens.extend(tokenize_text(tokenizer, piece, i == 0))
                else:
                    tokens.append(piece)
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
            raise InvalidRequest("Prompt contains invalid tokens")
        return tokens
    raise InvalidRequest("\"prompt\" must be a string, an array of token ids or a mixed array of strings and token ids")


def tokenize_prompts(
    tokenizer: Any, prompt: Any, vocab_size: int, bound: PromptBound | None = None, max_prompts: int | None = None
) -> tuple[list[list[int]], bool]:
    """Return the token lists and whether the request held several prompts (``--max-prompts`` at most)."""
    if prompt is None:
        raise InvalidRequest("\"prompt\" is required")
    kinds = set(map(type, prompt)) if isinstance(prompt, list) else set()
    if kinds and int not in kinds:
        if kinds == {str} or kinds & {list, dict}:
            if max_prompts is not None and len(prompt) > max_prompts:
                raise InvalidRequest(f"Field 'prompt': at most {max_prompts} prompts are allowed in one request (--max-prompts), but got {len(prompt)}")
            return [tokenize_one(tokenizer, p, vocab_size, bound) for p in prompt], len(prompt) > 1
    return [tokenize_one(tokenizer, prompt, vocab_size, bound)], False
