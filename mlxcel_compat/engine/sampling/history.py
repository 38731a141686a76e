"""What the history samplers (penalties, DRY) keep of a request's tokens, updated incrementally
as the sequence grows: the penalty window's token counts and DRY's window of tokens."""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import mlx.core as mx

from mlxcel_compat.engine.sampling.params import SamplingParams


def _as_int(token: Any) -> int:
    return int(token.item()) if isinstance(token, mx.array) else int(token)


def _index_array(tokens: Sequence[Any]) -> mx.array:
    """Token ids (ints and/or lazy MLX scalars) as one int32 array, without syncing."""
    ints = [t for t in tokens if not isinstance(t, mx.array)]
    lazy = [t.reshape(1).astype(mx.int32) for t in tokens if isinstance(t, mx.array)]
    parts = ([mx.array(ints, dtype=mx.int32)] if ints else []) + lazy
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


class TokenHistory:
    """The history one request's penalties and DRY stages read.

    :meth:`update` takes the prompt plus the tokens generated so far; it must only grow between
    calls (elements may be ints or lazy MLX scalars, so the newest token need not be evaluated
    yet); a shorter one starts over. ``n_ctx`` is what ``-1`` means for ``repeat_last_n`` /
    ``dry_penalty_last_n`` (None: unbounded).
    """

    def __init__(self, params: SamplingParams, vocab_size: int, n_ctx: int | None, penalties: bool, dry: bool) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.n_ctx = n_ctx
        self.penalties = penalties  # the penalties stage runs: keep the counts
        self.dry = dry  # the DRY stage runs: keep its tokens
        self._n_seen = 0
        self.counts: mx.array | None = None  # occurrences per token in the penalty window
        self._window: deque[Any] = deque()
        self.dry_tokens: list[int] = []  # DRY's window, oldest first (a little more than it scans)

    def penalty_window_size(self) -> int | None:
        last_n = self.params.repeat_last_n
        return self.n_ctx if last_n < 0 else last_n

    def dry_window_size(self) -> int | None:
        last_n = self.params.dry_penalty_last_n
        size = self.n_ctx if last_n < 0 else last_n
        if size is not None and self.n_ctx is not None:
            size = min(size, self.n_ctx)
        return size

    def update(self, history: Sequence[Any] | None) -> None:
        if history is None or not (self.penalties or self.dry):
            return
        if len(history) < self._n_seen:
            # Not an append: start over from this history.
            self._n_seen = 0
            self.counts = None
            self._window.clear()
            self.dry_tokens = []
        new = [
            t
            for t in history[self._n_seen :]
            if isinstance(t, mx.array) or 0 <= int(t) < self.vocab_size
        ]
        self._n_seen = len(history)
        if not new:
            return
        if self.penalties:
            self._penalty_accept(new)
        if self.dry:
            self._dry_accept(new)

    def _penalty_accept(self, new: list[Any]) -> None:
        """Keep token counts over the last ``repeat_last_n`` tokens, incrementally."""
        cap = self.penalty_window_size()
        if self.counts is None:
            self.counts = mx.zeros((self.vocab_size,), dtype=mx.float32)
        if cap is not None and len(new) >= cap:
            self._window = deque(new[-cap:])
            self.counts = mx.zeros((self.vocab_size,), dtype=mx.float32)
            self.counts = self.counts.at[_index_array(list(self._window))].add(1.0)
            return
        self.counts = self.counts.at[_index_array(new)].add(1.0)
        if cap is None:
            return
        self._window.extend(new)
        evicted = []
        while len(self._window) > cap:
            evicted.append(self._window.popleft())
        if evicted:
            self.counts = self.counts.at[_index_array(evicted)].add(-1.0)

    def _dry_accept(self, new: list[Any]) -> None:
        self.dry_tokens.extend(_as_int(t) for t in new)
        cap = self.dry_window_size()
        if cap is not None and len(self.dry_tokens) > 2 * cap + 64:
            del self.dry_tokens[:-cap]
