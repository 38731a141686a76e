"""Speculative decoding: cheap guesses of the next tokens, checked by the model in one pass.

Why: a decode step reads every weight to produce one token; feeding the model n guessed tokens
costs about the same pass (``CpuDecoder.step_tokens`` takes them as the rows of one batch), and
every guess the model agrees with is a token won. The kinds of guess, as llama-server names them
(``--spec-type``; several may be given, tried in llama-server's order: ngram-simple,
ngram-mod, ngram-cache, then the draft model):

- ``ngram-simple``: the last ``size_n`` tokens (the token about to be fed included) are looked
  up in the sequence so far; the ``size_m`` tokens that followed their latest earlier occurrence
  are the draft. Free, and it pays off where answers repeat their context: an agent editing a
  file, a RAG answer quoting its sources.
- ``ngram-mod``: llama.cpp's hashed n-gram table, shared by every sequence of the server (what
  ``--spec-default`` turns on): each ``n_match``-gram seen maps to the token that followed it, and
  a draft chains lookups from the last ``n_match`` tokens, at least ``n_min`` long, at most
  ``n_max``. It remembers what earlier requests generated too.
- ``ngram-cache``: lookup decoding (engine/ngram_cache.py): counts of which tokens followed each
  1- to 4-gram of the sequence (and of the ``-lcs``/``-lcd`` files), a draft of up to 8 tokens
  each from the longest recent n-gram whose followers are clear. It drafts after a 2- or
  3-token overlap with earlier text, where ``ngram-simple`` waits for ``size_n`` tokens.
- ``draft-simple``: a small model with the same vocabulary (``-md``) proposes up to ``n_max``
  tokens greedily, stopping early when its top probability falls below ``p_min``.

Verification (``SpeculativeSequence.speculate_step``, engine/speculative_sequence.py) samples
the target at every drafted position with the request's own sampler chain, in order, and keeps
each draft token the sample equals; the first sample that differs is kept instead and ends the
round. Drafts are deterministic (a draft model's top token, an n-gram's continuation or most
frequent follower), so this *is* the standard rejection rule for a one-point draft distribution:
a draft token is accepted with the target's probability of it, and a rejection leaves the
target's distribution without it. The output is distributed exactly as plain decoding's, one
sample per emitted token (a seeded request draws the same random numbers), and greedy output is
plain decoding's token for token where the verify pass computes the same logits (the CPU decode
runtime: bit-identical rows).

Everything here but :class:`DraftModel` is pure Python; the draft model's passes run on the
engine thread like the target's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from mlxcel_compat.engine import ngram_cache

log = logging.getLogger(__name__)

# llama-server b11312's --spec-type names (common/speculative.cpp), and the ones served here.
LLAMA_SERVER_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark",
                      "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
SERVED_TYPES = ("none", "draft-simple", "ngram-simple", "ngram-mod", "ngram-cache")
DRAFT_CATCH_UP_CHUNK = 512  # tokens a draft model prefills per pass when it catches up
# n-gram draft tokens verified per round, at most: with the pending token, one pass of the CPU
# decode runtime (``EXACT_ROWS`` rows). A longer draft costs a second pass for its tail, which
# the next round verifies as cheaply once the first part is accepted.
NGRAM_CAP_MAX = 15
NGRAM_CAP_MIN = 2


class SpecError(ValueError):
    """A speculative-decoding setting that cannot be served (reported at start-up)."""


@dataclass(frozen=True)
class SpecConfig:
    """The speculative settings (llama-server's defaults, b11312 ``common.h``)."""

    types: tuple[str, ...] = ("none",)
    draft_model: str | None = None  # -md FILE/DIR
    draft_n_max: int = 3
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    ngram_size_n: int = 12  # --spec-ngram-simple-size-n: the looked-up n-gram
    ngram_size_m: int = 48  # --spec-ngram-simple-size-m: the draft after it
    mod_n_match: int = 24  # --spec-ngram-mod-n-match: the n-gram hashed into the table
    mod_n_min: int = 48  # --spec-ngram-mod-n-min: shorter chains are no draft
    mod_n_max: int = 64  # --spec-ngram-mod-n-max
    lookup_cache_static: str | None = None  # -lcs FNAME (ngram-cache)
    lookup_cache_dynamic: str | None = None  # -lcd FNAME (ngram-cache)

    @classmethod
    def from_settings(cls, s: Any) -> "SpecConfig":
        """From the settings table (``--spec-*``); raises SpecError for a combination that
        cannot be served."""
        types = parse_types(s.spec_type)
        mod = dict(mod_n_match=int(s.spec_ngram_mod_n_match), mod_n_min=int(s.spec_ngram_mod_n_min),
                   mod_n_max=int(s.spec_ngram_mod_n_max))
        if s.spec_default:  # llama-server's --spec-default: ngram-mod with these sizes
            types = tuple(t for t in types if t != "none") + ("ngram-mod",)
            mod = dict(mod_n_match=24, mod_n_min=48, mod_n_max=64)
        return resolve(types, s.spec_draft_model, draft_n_max=int(s.spec_draft_n_max),
                       draft_n_min=int(s.spec_draft_n_min), draft_p_min=float(s.spec_draft_p_min),
                       ngram_size_n=int(s.spec_ngram_simple_size_n), ngram_size_m=int(s.spec_ngram_simple_size_m),
                       lookup_cache_static=s.lookup_cache_static or None,
                       lookup_cache_dynamic=s.lookup_cache_dynamic or None, **mod)

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(t for t in self.types if t != "none")

    @property
    def enabled(self) -> bool:
        return bool(self.active)

    @property
    def uses_draft_model(self) -> bool:
        return "draft-simple" in self.active

    @property
    def type_names(self) -> str:
        """What ``/props`` shows as ``speculative.types`` (llama-server joins the names)."""
        return ",".join(self.types) if self.types else "none"


def parse_types(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``--spec-type a,b``: the names as llama-server parses them; unknown names are an error,
    names llama-server knows but this server does not serve say so."""
    if value is None or value == "":
        return ("none",)
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    for name in names:
        if name not in LLAMA_SERVER_TYPES:
            raise SpecError(f"unknown speculative decoding type '{name}' (one of: {', '.join(LLAMA_SERVER_TYPES)})")
        if name not in SERVED_TYPES:
            raise SpecError(f"speculative decoding type '{name}' is not supported by this server "
                            f"(supported: {', '.join(SERVED_TYPES)})")
    return tuple(dict.fromkeys(names)) or ("none",)


def resolve(types: tuple[str, ...], draft_model: str | None, **numbers: Any) -> SpecConfig:
    """The config the engine runs. A draft model given without a type drafts with it
    (``draft-simple``): llama-server b11312 would load it and never use it, which no one wants."""
    if draft_model and not any(t.startswith("draft-") for t in types):
        types = tuple(t for t in types if t != "none") + ("draft-simple",)
    if "draft-simple" in types and not draft_model:
        raise SpecError("speculative decoding type 'draft-simple' needs a draft model (-md FILE)")
    config = SpecConfig(types=types, draft_model=draft_model or None, **numbers)
    if config.draft_n_max < 0 or config.draft_n_min < 0:
        raise SpecError("--spec-draft-n-max and --spec-draft-n-min must be >= 0")
    if not 1 <= config.ngram_size_n <= 1024 or not 1 <= config.ngram_size_m <= 1024:
        raise SpecError("ngram size N and M must be between 1 and 1024 inclusive")
    if not 1 <= config.mod_n_match <= 1024 or not 0 <= config.mod_n_min <= 1024 or not 0 <= config.mod_n_max <= 1024:
        raise SpecError("ngram-mod n-match must be between 1 and 1024, n-min and n-max between 0 and 1024")
    return config


def ngram_simple_draft(tokens: list[int] | np.ndarray, sampled: int, size_n: int, size_m: int) -> list[int]:
    """llama.cpp's ``ngram-simple`` draft: ``tokens`` is the sequence the model holds, ``sampled``
    the token about to be fed. The pattern is the last ``size_n - 1`` tokens plus ``sampled``; the
    latest earlier position where it occurs (never position 0, never the current one) gives the
    draft: what followed it, at most ``size_m`` tokens and at least ``size_n`` (else none)."""
    arr = np.asarray(tokens, dtype=np.int64)
    cur = len(arr)
    if cur <= size_n + size_m + 1:
        return []
    pattern = np.append(arr[cur - size_n + 1:], sampled)
    last_start = cur - size_n - 1  # the search runs from here down to 1
    windows = np.lib.stride_tricks.sliding_window_view(arr[: last_start + size_n], size_n)
    hits = np.flatnonzero((windows == pattern).all(axis=1))
    hits = hits[hits >= 1]
    if hits.size == 0:
        return []
    match = int(hits[-1])
    n_copy = min(size_m, cur - (match + size_n))
    if n_copy < size_n:
        return []
    return arr[match + size_n: match + size_n + n_copy].tolist()


def verify_draft(draft: list[int], sample_at: Callable[[int], tuple[int, Any]],
                 accept: Callable[[int, Any], bool]) -> tuple[int, Any]:
    """The acceptance rule. ``sample_at(i)`` draws the model's token at draft position ``i``
    (with everything accepted before it as history) and returns ``(value, sampled)``; a draft
    token equal to the draw is kept (``accept(value, sampled)`` emits it and says whether
    generation goes on). Returns ``(tokens kept, the sampled value that ends the round)``: the
    first draw that differs, or the draw after a fully kept draft, or None if generation ended.
    One draw per emitted token, exactly as plain decoding draws."""
    for i in range(len(draft) + 1):
        value, sampled = sample_at(i)
        if i == len(draft) or value != draft[i]:
            return i, sampled
        if not accept(value, sampled):
            return i + 1, None
    raise AssertionError("unreachable")


class NgramModTable:
    """llama.cpp's ``common_ngram_mod``: a fixed table of ``size`` slots; an ``n``-gram hashes to
    one slot (a 64-bit multiply-add over its tokens, modulo the size) holding the token that last
    followed it. Collisions overwrite, as in llama.cpp; a wrong guess only costs a rejected draft.
    NumPy holds the table (4 bytes a slot) and hashes a prompt's n-grams in one pass."""

    EMPTY = -1
    MULTIPLIER = np.uint64(6364136223846793005)

    def __init__(self, n: int, size: int = 4 * 1024 * 1024) -> None:
        self.n = n
        self.entries = np.full(size, self.EMPTY, dtype=np.int32)
        self.used = 0

    def _slots(self, windows: np.ndarray) -> np.ndarray:
        h = np.zeros(windows.shape[0], dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i in range(self.n):
                h = h * self.MULTIPLIER + windows[:, i].astype(np.uint64)
        return (h % np.uint64(self.entries.size)).astype(np.int64)

    def add(self, tokens: np.ndarray, first: int, last: int) -> None:
        """Record the n-grams starting at ``first`` .. ``last - 1`` and the token after each."""
        if last <= first:
            return
        windows = np.lib.stride_tricks.sliding_window_view(tokens[first: last + self.n], self.n)[: last - first]
        slots = self._slots(windows)
        self.used += int(np.count_nonzero(self.entries[np.unique(slots)] == self.EMPTY))
        self.entries[slots] = tokens[first + self.n: last + self.n]  # a repeated slot keeps one of them: any is a guess

    def get(self, window: list[int]) -> int:
        return int(self.entries[self._slots(np.asarray([window], dtype=np.int64))[0]])

    def reset(self) -> None:
        self.entries.fill(self.EMPTY)
        self.used = 0


@dataclass
class NgramModState:
    """One sequence's place in the shared table (llama.cpp's ``seq_info``)."""

    i_last: int = 0  # n-grams before this position of the sequence are in the table
    n_draft_last: int = 0
    n_low: int = 0  # verification rounds in a row that accepted under a quarter of the draft
    begun: bool = False


NGRAM_MOD_RESET_OCCUPANCY = 0.25  # a table fuller than this is cleared when a sequence begins
NGRAM_MOD_LOW_ROUNDS = 5  # low-acceptance rounds in a row that clear the table


def ngram_mod_draft(table: NgramModTable, state: NgramModState, tokens: list[int], sampled: int,
                    n_min: int, n_max: int) -> list[int]:
    """llama.cpp's ``ngram-mod`` draft for a sequence holding ``tokens`` with ``sampled`` next."""
    n, cur = table.n, len(tokens)
    if cur < n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    if not state.begun:  # llama-server's begin(): the prompt's n-grams, then the occupancy check
        state.begun = True
        table.add(arr, 0, cur - n)
        state.i_last = cur - n
        if table.used > NGRAM_MOD_RESET_OCCUPANCY * table.entries.size:
            table.reset()
    elif state.i_last + 32 < cur:  # new n-grams go in by chunks
        table.add(arr, state.i_last, cur - n)
        state.i_last = cur - n
    window = tokens[cur - n + 1:] + [sampled]
    draft: list[int] = []
    for i in range(n_max):
        token = table.get(window)
        if token == table.EMPTY:
            if i < n_min:
                return []
            break
        draft.append(token)
        window = window[1:] + [token]
    state.n_draft_last = len(draft)
    return draft


def ngram_mod_verified(table: NgramModTable, state: NgramModState, n_accepted: int) -> None:
    """llama.cpp's accept(): a streak of drafts mostly rejected clears the table."""
    if state.n_draft_last <= 0:
        return
    if n_accepted / state.n_draft_last < 0.25:
        state.n_low += 1
        if state.n_low >= NGRAM_MOD_LOW_ROUNDS:
            table.reset()
            state.n_low = 0
            state.i_last = 0
    else:
        state.n_low = 0


@dataclass
class DraftState:
    """One sequence's draft-model KV cache and the tokens it holds, in order."""

    cache: list[Any]
    tokens: list[int] = field(default_factory=list)
    owned: Any = None  # runtime.decode_kv.OwnedCache of the draft's CPU decode runtime


class DraftModel:
    """The draft model (``-md``): its weights, its CPU decode runtime, and drafting.

    A sequence's draft cache follows the target's: before drafting it is cut back to the tokens
    both hold and fed the rest (a prompt-cache hit hands it the draft tensors stored with the
    target's, ``engine/prefix_cache.py``, so a hit warms both)."""

    def __init__(self, loaded: Any) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.decoder = loaded.decoder
        self.n_layers = len(self.new_state().cache)
        self.n_fed = 0  # tokens run through the draft model so far (tests and benchmarks read it)

    def new_state(self) -> DraftState:
        from mlx_lm.models.cache import make_prompt_cache

        from mlxcel_compat.runtime.decode_kv import OwnedCache

        return DraftState(cache=make_prompt_cache(self.model), owned=OwnedCache())

    def sync(self, state: DraftState, tokens: list[int]) -> Any:
        """Make ``state`` hold exactly ``tokens``; return the logits after the last one (an
        ``mx.array`` or NumPy row), or None if ``tokens`` is empty. At least the last token is
        fed again if the state already holds all of them (its logits are not kept)."""
        import mlx.core as mx
        from mlx_lm.models.cache import trim_prompt_cache

        if not tokens:
            return None
        common = 0
        limit = min(len(state.tokens), len(tokens) - 1)
        while common < limit and state.tokens[common] == tokens[common]:
            common += 1
        if len(state.tokens) > common:
            trim_prompt_cache(state.cache, len(state.tokens) - common)
            del state.tokens[common:]
        from mlxcel_compat.runtime.cpu_decode import EXACT_ROWS

        rest = tokens[common:]
        dec = self.decoder
        # More than one exact pass of the CPU runtime's rows (a prompt): MLX's prefill, by chunks.
        while len(rest) > EXACT_ROWS or (rest and (dec is None or not dec.can_step_tokens(state.cache, state.owned))):
            chunk = rest[:DRAFT_CATCH_UP_CHUNK] if len(rest) > EXACT_ROWS else rest
            logits = self.model(mx.array(chunk)[None], cache=state.cache)[0, -1]
            mx.eval(logits)
            state.tokens += chunk
            self.n_fed += len(chunk)
            rest = rest[len(chunk):]
            if not rest:
                return logits
        logits = dec.step_tokens(rest, state.cache, state.owned, last_only=True)[0]
        state.tokens += rest
        self.n_fed += len(rest)
        return logits

    def propose(self, state: DraftState, context: list[int], n_max: int, p_min: float) -> list[int]:
        """Up to ``n_max`` greedy draft tokens after ``context`` (the target's tokens and the one
        about to be fed), stopping before a token whose draft probability is below ``p_min``."""
        import mlx.core as mx

        draft: list[int] = []
        logits = self.sync(state, context)
        while logits is not None and len(draft) < n_max:
            row = np.asarray(logits, dtype=np.float32) if not isinstance(logits, mx.array) else np.array(logits.astype(mx.float32))
            token = int(np.argmax(row))
            if p_min > 0.0:
                shifted = np.exp(row - row[token])
                if 1.0 / float(shifted.sum()) < p_min:
                    break
            draft.append(token)
            if len(draft) == n_max:
                break
            logits = self._feed_one(state, token)
        return draft

    def _feed_one(self, state: DraftState, token: int) -> Any:
        import mlx.core as mx

        dec = self.decoder
        state.tokens.append(token)
        self.n_fed += 1
        if dec is not None and dec.can_run(state.cache, state.owned):
            return dec.step(token, state.cache, state.owned).copy()
        logits = self.model(mx.array([[token]]), cache=state.cache)[0, -1]
        mx.eval(logits)
        return logits


class Speculator:
    """One sequence's drafting: the n-gram lookup first, then the draft model (if any).

    An n-gram draft is cut to a length that follows what the model accepted lately: verifying a
    token costs a fraction of a step (~0.25 of one with float32 weights, ~0.5 with ggml blocks,
    whose products are computed row by row), so a long draft that the model leaves at once would
    make decoding slower than plain. The cap starts at ``NGRAM_CAP_MAX``, falls to about twice
    the last accepted run when a draft is cut short and doubles again while drafts are accepted
    whole. What is
    verified changes, never what is generated."""

    def __init__(self, config: SpecConfig, draft: DraftModel | None, table: NgramModTable | None = None,
                 lookup_files: ngram_cache.LookupFiles | None = None) -> None:
        self.config = config
        self.draft = draft if config.uses_draft_model else None
        self.state: DraftState | None = None  # the draft model's, made on first use or adopted
        self.table = table if "ngram-mod" in config.active else None  # shared by the server's sequences
        self.mod_state = NgramModState()
        # ngram-cache: this sequence's own counts, and the -lcs/-lcd caches every sequence reads
        self.lookup = ngram_cache.LookupState() if "ngram-cache" in config.active else None
        self.lookup_files = lookup_files
        self.ngram_cap = NGRAM_CAP_MAX
        self._last = ""  # which kind made the last draft

    def verified(self, n_draft: int, n_accepted: int) -> None:
        """The outcome of the last draft: how many of its tokens the model accepted."""
        if self._last == "ngram-mod" and self.table is not None:
            ngram_mod_verified(self.table, self.mod_state, n_accepted)
        if not self._last.startswith("ngram"):
            return
        if n_accepted == n_draft:
            self.ngram_cap = min(2 * self.ngram_cap, NGRAM_CAP_MAX)
        else:
            self.ngram_cap = max(NGRAM_CAP_MIN, 2 * (n_accepted + 1))

    @property
    def n_min(self) -> int:
        return self.config.draft_n_min if self.draft is not None else 0

    def propose(self, tokens: list[int], sampled: int, n_max: int) -> list[int]:
        """Draft tokens to follow ``tokens`` + ``sampled``: at most ``n_max``, or none."""
        if n_max <= 0:
            return []
        c = self.config
        self._last = ""
        if "ngram-simple" in c.active:
            found = ngram_simple_draft(tokens, sampled, c.ngram_size_n, c.ngram_size_m)
            if found:
                self._last = "ngram-simple"
                return found[:min(n_max, self.ngram_cap)]
        if self.table is not None:
            found = ngram_mod_draft(self.table, self.mod_state, list(tokens), sampled, c.mod_n_min, c.mod_n_max)
            if found:
                self._last = "ngram-mod"
                return found[:min(n_max, self.ngram_cap)]
        if self.lookup is not None:
            found = ngram_cache.draft(self.lookup, self.lookup_files, tokens, sampled,
                                      min(n_max, self.ngram_cap, ngram_cache.N_DRAFT))
            if found:
                self._last = "ngram-cache"
                return found
        if self.draft is not None:
            if self.state is None:
                self.state = self.draft.new_state()
            found = self.draft.propose(self.state, list(tokens) + [sampled], min(n_max, c.draft_n_max), c.draft_p_min)
            return found if len(found) >= c.draft_n_min else []
        return []


def check_vocabularies(target_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Refuse a draft whose vocabulary differs from the target's, as llama-server does
    (``common_speculative_are_compatible``): the same size within a few tokens, the same
    special tokens, and the same token text for the ids both have."""
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if abs(len(t_vocab) - len(d_vocab)) > 128:
        raise SpecError(f"draft model vocab must closely match target model to use speculation but "
                        f"target vocab size {len(t_vocab)} does not match draft vocab size {len(d_vocab)}")
    t_ids = {i: s for s, i in t_vocab.items()}
    for token, i in d_vocab.items():
        if i in t_ids and t_ids[i] != token:
            raise SpecError(f"draft model vocab must match target model to use speculation but "
                            f"token {i} content differs - target '{t_ids[i]}', draft '{token}'")
    for name in ("bos_token_id", "eos_token_id"):
        t, d = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if t != d:
            raise SpecError(f"draft model special tokens must match target model to use speculation: {name} {t} != {d}")
