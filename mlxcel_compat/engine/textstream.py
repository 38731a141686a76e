"""Streaming detokenization with llama-server's stop-string and UTF-8 rules.

llama-server appends each token's piece (raw bytes) to the generated text and,
per token: holds everything back while the text ends inside a UTF-8 character;
otherwise stops at the earliest stop string (never sending it), holds the unsent
text while its end could be the start of a stop string, and sends it once that
is ruled out. mlx-lm's streaming detokenizers strip the first leading space and
delay lone spaces, which llama.cpp does not do, so pieces are decoded from a
per-token byte table built here instead.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

from mlxcel_compat.tokenizer.byte_level import byte_level_bytes
from mlxcel_compat.tokenizer.served import unwrap_tokenizer

_SPM_SPACE = "\u2581"


def _decoder_kind(decoder: Any) -> str:
    """Classify the tokenizer.json decoder: byte_level, spm or generic."""
    if not isinstance(decoder, dict):
        return "generic"
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "byte_level"
    if kind == "Metaspace":
        return "spm"
    if kind == "Sequence":
        parts = decoder.get("decoders") or []
        kinds = {part.get("type") for part in parts if isinstance(part, dict)}
        if "ByteLevel" in kinds:
            return "byte_level"
        if "ByteFallback" in kinds or "Metaspace" in kinds:
            return "spm"
        for part in parts:
            if not isinstance(part, dict) or part.get("type") != "Replace":
                continue
            if (part.get("pattern") or {}).get("String") == _SPM_SPACE:
                return "spm"
    return "generic"


class VocabBytes:
    """Raw bytes of every token, computed lazily and cached per tokenizer; the special ids.

    Only what a token needs is read, when it is needed: the decoder's own JSON (never the whole
    tokenizer's, whose merges are 500K pairs for a 262K vocabulary: a few hundred MiB of Python
    objects for a moment), and one token's string at a time (no table of every token's)."""

    def __init__(self, hf: Any) -> None:
        self._hf = hf
        self.size = len(hf)
        try:
            decoder = json.loads(hf.backend_tokenizer.decoder.__getstate__())
        except Exception:
            decoder = None
        self.kind = _decoder_kind(decoder)
        self.added: dict[int, str] = {}
        self.special_ids: set[int] = set(getattr(hf, "all_special_ids", []) or [])
        for token_id, added in (getattr(hf, "added_tokens_decoder", {}) or {}).items():
            self.added[int(token_id)] = str(added.content)
            if getattr(added, "special", False):
                self.special_ids.add(int(token_id))
        self._cache: dict[int, bytes] = {}

    def _token_string(self, token_id: int) -> str:
        return self._hf.convert_ids_to_tokens(token_id) or ""

    def raw(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        if token_id < 0 or token_id >= self.size:
            value = b""  # padded model vocab beyond the tokenizer
        elif token_id in self.added:
            value = self.added[token_id].encode("utf-8")
        elif self.kind == "byte_level":
            value = byte_level_bytes(self._token_string(token_id))
        elif self.kind == "spm":
            text = self._token_string(token_id)
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                value = bytes([int(text[3:5], 16)])
            else:
                value = text.replace(_SPM_SPACE, " ").encode("utf-8")
        else:
            value = self._hf.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._cache[token_id] = value
        return value


# What ``derived`` built, per (unwrapped) tokenizer and name: public so that a test can tell
# which thread built what.
derived_values: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()
_derived_lock = threading.Lock()
T = TypeVar("T")


def derived(tokenizer: Any, name: str, build: Callable[[Any], T]) -> T:
    """What ``build(hf)`` derives from a tokenizer's vocabulary (the byte table, the infill
    sampler's piece index), built once and kept as long as the tokenizer lives.

    Built outside the lock (a 150k vocabulary's piece index takes a second); if two threads
    build it at once, the first one stored is the one everybody gets.
    """
    hf = unwrap_tokenizer(tokenizer)
    with _derived_lock:
        value = derived_values.setdefault(hf, {}).get(name)
    if value is None:
        value = build(hf)
        with _derived_lock:
            value = derived_values[hf].setdefault(name, value)
    return value


def vocab_table(tokenizer: Any) -> VocabBytes:
    """The (shared, cached) byte table of a tokenizer's vocabulary."""
    return derived(tokenizer, "vocab bytes", VocabBytes)


def token_bytes(tokenizer: Any, token_id: int, *, special: bool = True) -> bytes:
    """The raw bytes of one token, as llama.cpp's ``token_to_piece``.

    Special (control) tokens render as their text when ``special`` is true and as
    nothing otherwise. llama.cpp's ``common_token_to_piece`` defaults to
    ``special=True`` (``/tokenize`` pieces); generated text and
    ``completion_probabilities`` use the server's ``--special`` flag (off by default).
    """
    vocab = vocab_table(tokenizer)
    token_id = int(token_id)
    if not special and token_id in vocab.special_ids:
        return b""
    return vocab.raw(token_id)


def all_token_bytes(tokenizer: Any, *, special: bool = True) -> list[bytes]:
    """Every token's bytes, as :func:`token_bytes` gives them, with the table looked up once
    (for what is derived from the whole vocabulary: DRY's byte search, infill's piece index)."""
    vocab = vocab_table(tokenizer)
    return [b"" if not special and t in vocab.special_ids else vocab.raw(t) for t in range(vocab.size)]


def complete_utf8_length(data: bytes) -> int:
    """Length of ``data`` without a trailing, incomplete UTF-8 character.

    Same rule as llama-server's ``validate_utf8``: only the last four bytes are
    checked for a lead byte whose sequence runs past the end.
    """
    size = len(data)
    for i in range(1, min(4, size) + 1):
        c = data[size - i]
        if (c & 0xE0) == 0xC0:
            needed = 2
        elif (c & 0xF0) == 0xE0:
            needed = 3
        elif (c & 0xF8) == 0xF0:
            needed = 4
        else:
            continue
        if i < needed:
            return size - i
    return size


def token_is_complete_utf8(tokenizer: Any, token_id: int) -> bool:
    """True when the token's own bytes do not end inside a UTF-8 character."""
    data = token_bytes(tokenizer, token_id, special=False)
    return complete_utf8_length(data) == len(data)


def token_piece(tokenizer: Any, token_id: int, *, special: bool = True) -> str:
    """A token's text for JSON: an incomplete trailing character is cut off (as
    llama-server does for ``completion_probabilities``), other invalid bytes
    become U+FFFD."""
    data = token_bytes(tokenizer, token_id, special=special)
    return data[: complete_utf8_length(data)].decode("utf-8", errors="replace")


def _find_partial_stop(text: str, word: str) -> int:
    """Start of the longest suffix of ``text`` that is a prefix of ``word``, or -1."""
    if not text or not word:
        return -1
    last = text[-1]
    for end in range(len(word), 0, -1):
        if word[end - 1] == last and text.endswith(word[:end]):
            return len(text) - end
    return -1


@dataclass
class StreamPiece:
    """What one token contributes to the stream.

    ``text`` may be sent now (possibly ""). ``stopped``: a stop string matched;
    ``stopping_word`` is it. ``incomplete``: the text now ends inside a UTF-8
    character; llama-server sends no event at all for such a token.
    """

    text: str
    stopped: bool = False
    stopping_word: str = ""
    incomplete: bool = False


class TextStream:
    """Turns generated token ids into sendable text, one token at a time.

    ``special`` renders special tokens as text (llama-server ``--special``); ``preserved`` renders
    just these (a request's ``preserved_tokens``, as llama-server does).
    ``eog_token_ids`` (default: the tokenizer's EOS ids) flush held text at once,
    since llama-server skips the partial-stop hold for an end-of-generation token.
    Work per token is proportional to the token and the held text, not the output.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        *,
        special: bool = False,
        eog_token_ids: Iterable[int] | None = None,
        preserved: Iterable[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self.stop = [word for word in stop if word]
        self.special = special
        self.preserved = {int(t) for t in preserved}
        if eog_token_ids is None:
            eog_token_ids = getattr(tokenizer, "eos_token_ids", None) or []
        self.eog_token_ids = {int(t) for t in eog_token_ids}
        self._pending = b""  # bytes of an unfinished UTF-8 character
        self._unsent = ""  # decoded text held back for a possible stop string
        self._emitted: list[str] = []
        self.stopped = False
        self.stopping_word = ""
        self.finished = False

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def text(self) -> str:
        """All text emitted so far (pieces returned by push and finish)."""
        return "".join(self._emitted)

    @property
    def held_text(self) -> str:
        """Text generated but not emitted yet (an undecodable tail shows as U+FFFD)."""
        return self._unsent + self._pending.decode("utf-8", errors="replace")

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text

    def _find_stop(self, text: str) -> tuple[int, str]:
        """Earliest full stop string in ``text``; ties go to the earlier-listed one."""
        best, best_word = -1, ""
        for word in self.stop:
            pos = text.find(word)
            if pos != -1 and (best == -1 or pos < best):
                best, best_word = pos, word
        return best, best_word

    def _has_partial_stop(self, text: str) -> bool:
        return any(_find_partial_stop(text, word) != -1 for word in self.stop)

    def push(self, token_id: int) -> StreamPiece:
        """Add one generated token; return the text that may be sent now."""
        if self.stopped or self.finished:
            return StreamPiece("", self.stopped, self.stopping_word)
        special = self.special or token_id in self.preserved
        data = self._pending + token_bytes(self._tokenizer, token_id, special=special)
        if complete_utf8_length(data) < len(data):
            self._pending = data
            return StreamPiece("", incomplete=True)
        self._pending = b""
        self._unsent += data.decode("utf-8", errors="replace")

        pos, word = self._find_stop(self._unsent)
        if pos != -1:
            text = self._emit(self._unsent[:pos])
            self._unsent = ""
            self.stopped = True
            self.stopping_word = word
            return StreamPiece(text, True, word)

        if int(token_id) not in self.eog_token_ids and self._has_partial_stop(self._unsent):
            return StreamPiece("")

        text = self._emit(self._unsent)
        self._unsent = ""
        return StreamPiece(text)

    def finish(self) -> str:
        """End of generation for a non-stop reason: return the held-back text.

        Note: llama-server includes this text in a non-streamed ``content`` but
        never sends it in streaming mode (its final event has ``content: ""``).
        """
        if self.finished or self.stopped:
            self.finished = True
            return ""
        self.finished = True
        text = self.held_text
        self._pending = b""
        self._unsent = ""
        return self._emit(text)
