"""Constrained decoding: grammars compiled by llguidance, one matcher per sequence, token masks.

A request's constraint (GBNF, Lark, a JSON schema or a tool-call grammar, all carried as Lark text)
is compiled once per distinct text by :class:`GrammarCompiler` and cached; each sequence gets its
own copy of the compiled matcher (:class:`GrammarState`), fed every token the sequence generates.
Before a token is drawn, the sequence's mask (one bit per vocabulary entry) removes every token the
grammar cannot take next; the end-of-generation tokens are allowed only where the grammar accepts.
The sampler chain applies the mask right after the logit bias (``engine/sampling/chain.py``), which is
llama.cpp's "grammar first" order.

Lazy grammars (llama-server's ``grammar_lazy``) leave the text free until a trigger appears: a token,
a word, a pattern found anywhere, or a pattern matching the whole text so far. The grammar then
starts at the trigger (the first non-empty capture group of a pattern) and constrains from there.

Masks are computed on the engine thread right after the forward pass that needs them has been
queued with ``mx.async_eval``: llguidance releases the GIL, so the mask is ready (tens of
microseconds) long before the model's logits are, and adds no serial time to a step. Nothing here imports MLX; the HTTP side uses the
same compiler to answer an invalid grammar with a 400 before anything runs.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from mlxcel_compat.engine.textstream import token_bytes, vocab_table
from mlxcel_compat.tokenizer.served import unwrap_tokenizer

if TYPE_CHECKING:
    import llguidance

# llama.cpp's common_grammar_trigger_type values (the wire format of grammar_triggers).
TRIGGER_TOKEN = 0
TRIGGER_WORD = 1
TRIGGER_PATTERN = 2
TRIGGER_PATTERN_FULL = 3
TRIGGER_TYPES = (TRIGGER_TOKEN, TRIGGER_WORD, TRIGGER_PATTERN, TRIGGER_PATTERN_FULL)

# Whitespace a JSON-schema grammar allows between tokens: llama.cpp's json_schema_to_grammar
# "space" rule (nothing, one space, or a newline and up to 20 spaces/tabs of indentation). A
# bound matters: llguidance's default (any run of whitespace) lets a model pad forever.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"
COMPILED_CACHE_SIZE = 64
# llguidance's "slices": groups of tokens whose mask is set in one step when the lexer accepts any
# string of the slice's characters (inside a JSON string, say), instead of walking their trie.
# Its default groups JSON-string tokens at lengths 1-10, 11-30 and longer, so inside a string
# with fewer than 10 characters left (``maxLength``) every token is walked; smaller steps let
# the short tokens still be set at once: the p99 mask time on a 150k vocabulary fell ~8 %
# (scripts/bench_structured.py, docs/benchmarks/structured-output.md).
_JSON_CHAR = r'[^"\\\x00-\x1F\x7F]'
MASK_SLICES = [r"[\x20\x0A\x0D\x09]+", *(f"{_JSON_CHAR}{{1,{n}}}" for n in (2, 4, 6, 8, 10, 30)), f"{_JSON_CHAR}+"]


class GrammarError(ValueError):
    """The grammar (or schema) cannot be compiled; the message is llguidance's."""


@dataclass(frozen=True)
class GrammarTrigger:
    """One ``grammar_triggers`` entry; ``token`` is set for token triggers."""

    type: int
    value: str
    token: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "value": self.value}
        if self.type == TRIGGER_TOKEN:
            out["token"] = self.token
        return out


@dataclass(frozen=True)
class Constraint:
    """What a sequence's output must match; plain values, crosses from the HTTP side to the engine."""

    lark: str  # the grammar as llguidance Lark (GBNF and JSON schemas are converted); the cache key
    lazy: bool = False  # free text until a trigger appears
    triggers: tuple[GrammarTrigger, ...] = ()
    preserved_tokens: tuple[int, ...] = ()  # special tokens rendered as text in the output
    preserved_words: tuple[str, ...] = ()  # the request's preserved_tokens, as given (shown in settings)


# ---------------------------------------------------------------------- grammar texts


def lark_from_gbnf(text: str) -> str:
    """llama.cpp GBNF (or Lark, recognised by ``%llguidance`` or a ``start:`` rule) as Lark."""
    try:
        from llguidance.gbnf_to_lark import any_to_lark  # imported when first used: ~6 MiB of every server

        return any_to_lark(text)
    except Exception as exc:  # the converter raises plain Exceptions with a useful message
        raise GrammarError(str(exc)) from None


def json_rule(schema: Any) -> str:
    """A Lark rule body (``%json {...}``) for a JSON schema, with llama.cpp's bounded whitespace.

    ``true`` and an empty schema mean any JSON object, as llama-server treats them.
    """
    if schema is True or schema == {}:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    options = dict(schema.get("x-guidance") or {})
    options.setdefault("whitespace_pattern", JSON_WHITESPACE)
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def lark_from_json_schema(schema: Any) -> str:
    return "%llguidance {}\nstart: " + json_rule(schema) + "\n"


def lark_string(text: str) -> str:
    """A Lark string literal for ``text`` (JSON escapes, which llguidance's Lark reads)."""
    return json.dumps(text, ensure_ascii=False)


def lark_literal(text: str, special_tokens: dict[str, int] | None = None) -> str:
    """``text`` as a Lark expression; the special tokens in it (text -> id, longest first) as
    llguidance's ``<[id]>``. An empty text is the empty string literal."""
    if not special_tokens or not text:
        return lark_string(text)
    pattern = re.compile("|".join(re.escape(t) for t in special_tokens))
    parts, at = [], 0
    for match in pattern.finditer(text):
        if match.start() > at:
            parts.append(lark_string(text[at:match.start()]))
        parts.append(f"<[{special_tokens[match.group()]}]>")
        at = match.end()
    if at < len(text):
        parts.append(lark_string(text[at:]))
    return " ".join(parts) or lark_string("")


def compile_trigger_pattern(trigger: GrammarTrigger) -> re.Pattern[str] | None:
    """The regex a word or pattern trigger is searched with (None for token triggers).

    Word and pattern triggers match anywhere in the text generated so far; a full pattern must
    match all of it (llama.cpp anchors it with ``^...$``). Raises ``re.error`` for a bad pattern.
    """
    if trigger.type == TRIGGER_TOKEN:
        return None
    if trigger.type == TRIGGER_WORD:
        return re.compile(re.escape(trigger.value))
    if trigger.type == TRIGGER_PATTERN:
        return re.compile(trigger.value)
    pattern = trigger.value
    if not pattern.startswith("^"):
        pattern = "^" + pattern
    if not pattern.endswith("$"):
        pattern = pattern + "$"
    return re.compile(pattern)


# ---------------------------------------------------------------------- per model


class _VocabView:
    """What llguidance's TokenizerWrapper reads: every token's bytes and the special ids.

    Added tokens that are not special (``<think>``, ``<tool_call>`` in Qwen-style vocabularies)
    are plain text here, so a grammar literal ``"<tool_call>"`` can be produced by that one token,
    as in llama.cpp; special (control) tokens are reachable only through llguidance's token syntax.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eog_ids: Sequence[int]) -> None:
        hf = unwrap_tokenizer(tokenizer)
        table = vocab_table(tokenizer)
        self._hf = hf
        self.eos_token_id = int(eog_ids[0]) if eog_ids else int(getattr(hf, "eos_token_id", 0) or 0)
        self.bos_token_id = getattr(hf, "bos_token_id", None)
        self.tokens = [table.raw(i) for i in range(vocab_size)]
        self.special_token_ids = sorted(t for t in table.special_ids if 0 <= t < vocab_size)

    def __call__(self, text: Any) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._hf.encode(text, add_special_tokens=False))


class GrammarCompiler:
    """The model's llguidance tokenizer and its compiled grammars, cached by text.

    Shared by the HTTP side (compile to validate: a bad grammar is a 400) and the engine thread
    (a fresh matcher per sequence). The tokenizer takes about a second on a 150k vocabulary, so it
    is built once, in the background from :meth:`start` (or on first use).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eog_ids: Sequence[int], cache_size: int = COMPILED_CACHE_SIZE) -> None:
        self._source = tokenizer
        self.vocab_size = int(vocab_size)
        self.eog_ids = sorted(int(t) for t in eog_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._build_error: BaseException | None = None
        self._built = threading.Event()
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher | GrammarError] = collections.OrderedDict()
        self._special_texts: dict[str, int] | None = None
        self.n_compiled = 0  # grammars compiled (cache misses)
        self.n_reused = 0  # cache hits

    def start(self) -> None:
        """Build the tokenizer on a background thread (it needs no MLX)."""
        threading.Thread(target=self._build, name="mlxcel-grammar-tokenizer", daemon=True).start()

    def _build(self) -> None:
        with self._lock:
            if self._built.is_set():
                return
            try:
                import llguidance  # imported when first used: ~6 MiB of every server

                wrapper = llguidance.TokenizerWrapper(_VocabView(self._source, self.vocab_size, self.eog_ids))
                self._ll_tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=self.eog_ids or None,
                                                            slices=MASK_SLICES)
            except BaseException as exc:  # reported to every request that needs it
                self._build_error = exc
            finally:
                self._built.set()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if not self._built.is_set():
            self._build()
        self._built.wait()
        if self._ll_tokenizer is None:
            raise GrammarError(f"constrained decoding is unavailable for this tokenizer: {self._build_error}")
        return self._ll_tokenizer

    def special_tokens(self) -> dict[str, int]:
        """The text of each special (control) token and its id, longest first.

        llguidance reaches a special token only through its token syntax (``<[id]>``): a grammar
        literal holding ``<|tool_call_begin|>`` as text would be spelled byte by byte, which the
        model was never trained to write and which tokenizes back to the one special token.
        """
        if self._special_texts is None:
            table = vocab_table(self._source)
            found = {table.added[i]: i for i in table.special_ids if i in table.added and 0 <= i < self.vocab_size}
            self._special_texts = dict(sorted(found.items(), key=lambda item: -len(item[0])))
        return self._special_texts

    def lark_literal(self, text: str) -> str:
        """``text`` as a Lark expression: quoted strings, with the special tokens in it as ``<[id]>``."""
        return lark_literal(text, self.special_tokens())

    def lark_marker(self, text: str) -> str:
        """A marker (``[TOOL_CALLS]``, ``<tool_call>\n<function=``) as the tokens the tokenizer
        makes of it, ``<[a]> <[b]> ...``.

        llguidance lets a model write a literal in any tokenization; a random or uncertain model
        then writes ``[TOOL_CALLS]`` as ``[``, ``TO``, ``OL``, ... while the same text, rendered
        back as history, tokenizes to other tokens, and the prompt cache stops reusing there.
        Forcing the tokenizer's own tokens keeps a generated marker equal to its re-rendering. A
        text whose tokens do not decode back to it exactly (a SentencePiece prefix space) stays text.
        Whitespace around the marker stays text: it joins with what comes before or after it into
        other tokens than its own (``\n\n`` before a word is two ``\n`` tokens in GPT-2's rules).
        """
        core = text.strip()
        if not core:
            return lark_string(text)
        start = text.index(core)
        lead, tail = text[:start], text[start + len(core):]
        if lead.endswith(" "):  # a space before a word or a bracket is part of its token
            lead, core = lead[:-1], " " + core
        ids = self._encode(core)
        if ids and b"".join(vocab_table(self._source).raw(i) for i in ids) == core.encode("utf-8"):
            tokens = " ".join(f"<[{i}]>" for i in ids)
        else:
            tokens = self.lark_literal(core)
        return " ".join(x for x in (lark_string(lead) if lead else "", tokens, lark_string(tail) if tail else "") if x)

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in unwrap_tokenizer(self._source).encode(text, add_special_tokens=False)]

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def compile(self, lark: str) -> llguidance.LLMatcher:
        """The compiled matcher for ``lark`` (a template: copy it, never feed it).

        Raises:
            GrammarError: with llguidance's message; errors are cached like grammars.
        """
        with self._lock:
            hit = self._compiled.get(lark)
            if hit is not None:
                self._compiled.move_to_end(lark)
                self.n_reused += 1
        if hit is None:
            hit = self._compile(lark)
            with self._lock:
                self.n_compiled += 1
                self._compiled[lark] = hit
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def _compile(self, lark: str) -> llguidance.LLMatcher | GrammarError:
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return GrammarError(_clean_error(matcher.get_error()))
        return matcher

    def new_state(self, constraint: Constraint, tokenizer: Any) -> "GrammarState":
        """A sequence's own matcher for ``constraint`` (compiled now if it fell out of the cache)."""
        return GrammarState(self.compile(constraint.lark).deep_copy(), constraint, self, tokenizer)


def _clean_error(message: str) -> str:
    """llguidance's reason without the echo of our generated Lark text (and its positions)."""
    message = message.split("\n   1 | ")[0].strip()
    message = re.sub(r"^(?:at )?\d+\(\d+\): ", "", message)
    return message.removeprefix("failed to compile JSON schema: ").strip() or "invalid grammar"


# ---------------------------------------------------------------------- per sequence


class GrammarState:
    """One sequence's matcher: fed each generated token, asked for the next token's mask."""

    def __init__(self, matcher: llguidance.LLMatcher, constraint: Constraint, compiler: GrammarCompiler, tokenizer: Any) -> None:
        self.matcher = matcher
        self.compiler = compiler
        self._tokenizer = tokenizer
        self.awaiting_trigger = constraint.lazy
        self._trigger_tokens = {t.token for t in constraint.triggers if t.type == TRIGGER_TOKEN}
        self._patterns = [p for p in (compile_trigger_pattern(t) for t in constraint.triggers) if p is not None]
        self._buffer = b""  # text generated while waiting for a trigger
        self.error: str | None = None

    @property
    def active(self) -> bool:
        """True once the grammar constrains (always, unless lazy and not triggered yet)."""
        return not self.awaiting_trigger and self.error is None

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and admits nothing more: generation should end here."""
        return self.active and self.matcher.is_stopped() and not self.matcher.is_error()

    def accept(self, token: int) -> None:
        """Feed one generated token (the trigger check, while the grammar is lazy and waiting)."""
        if self.error is not None:
            return
        if not self.awaiting_trigger:
            self._consume([token])
            return
        if token in self._trigger_tokens:
            self.awaiting_trigger = False
            self._buffer = b""
            self._consume([token])
            return
        self._buffer += token_bytes(self._tokenizer, token)
        start = self._find_trigger()
        if start is not None:
            self.awaiting_trigger = False
            text, self._buffer = self._buffer[start:], b""
            # The trigger may start inside a token: the grammar is fed the text from there on,
            # tokenized afresh (llguidance accepts any tokenization of its text).
            self._consume(self.compiler.tokenizer.tokenize_bytes(text))

    def _find_trigger(self) -> int | None:
        """Byte offset where the grammar starts, if a pattern now matches (llama.cpp's rule: the
        first non-empty capture group, else the whole match)."""
        text = self._buffer.decode("utf-8", errors="surrogateescape")
        for pattern in self._patterns:
            match = pattern.search(text)
            if match is None:
                continue
            start = next((match.start(i) for i in range(1, (match.re.groups or 0) + 1) if match.group(i)), match.start())
            return len(text[:start].encode("utf-8", errors="surrogateescape"))
        return None

    def _consume(self, tokens: list[int]) -> None:
        if tokens and not self.matcher.consume_tokens(tokens):
            self.error = self.matcher.get_error() or "the grammar rejected a token"

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the next token's mask (one bit per token, llguidance's layout) into ``row``."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)


def compute_masks(states: Sequence[GrammarState], vocab_size: int) -> np.ndarray:
    """Boolean masks (len(states), vocab_size) of the tokens each grammar allows next.

    Computed one after the other on the calling (engine) thread: each takes tens of microseconds
    and releases the GIL, and the forward pass they overlap already keeps the cores busy, so
    llguidance's thread pool only adds hand-offs (measured: scripts/bench_structured.py).
    """
    bits = np.full((len(states), (vocab_size + 31) // 32), -1, dtype=np.int32)
    for row, state in zip(bits, states):
        state.fill_mask(row)
        if state.matcher.is_error() and state.error is None:
            state.error = state.matcher.get_error()
    return unpack_masks(bits, vocab_size)


def unpack_masks(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """llguidance's packed int32 bitmask (bit i of word w is token 32*w+i) as booleans."""
    flat = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=-1, bitorder="little")
    return flat[:, :vocab_size].astype(bool)

