"""How a sequence's prompt is split into prefill passes: aligned chunks (``next_chunk``), and the
prompt's tail fed in the pass that samples the first token (``prompt_tail``).

Chunks are aligned on absolute multiples of the chunk size (``--batch-size``): a sequence that
adopted a cached prefix splits the rest of its prompt exactly where a cold run would, which
makes an aligned hit reproduce the cold run bit for bit.
"""

from __future__ import annotations

from typing import Callable

from mlxcel_compat.runtime.cpu_decode import EXACT_ROWS


def next_chunk(prompt: list[int], start: int, chunk_size: int, boundary: int | None) -> list[int]:
    """The prompt tokens of the next prefill chunk: up to the next multiple of the chunk size,
    the snapshot boundary or the last prompt token (exclusive), whichever comes first."""
    last = len(prompt) - 1
    limit = boundary if boundary is not None and start < boundary <= last else last
    if start % chunk_size and limit - start <= chunk_size:
        # An unaligned start (a hit that adopted a prefix off the chunk grid) is not bit-exact
        # with the cold run whatever the split, so the rest goes in one pass when it fits in
        # one chunk, not in two split at the grid (each pass costs a read of every weight).
        return prompt[start:limit]
    return prompt[start : min(limit, (start // chunk_size + 1) * chunk_size)]


def prompt_tail(prompt: list[int], start: int, chunk_size: int, boundary: int | None, pins: list[tuple[int, float]],
                rows_fit: Callable[[], bool], rest_chunk: bool) -> list[int] | None:
    """The rest of the prompt (from ``start``), its last token included, when one pass feeds it
    and its last row samples the first token, instead of a prefill chunk and then a step of its
    own (two reads of every weight where one does); None otherwise. Two kinds:

    - **Decode rows**: a rest of 2 to ``EXACT_ROWS`` tokens as the rows of one decode step
      (``CpuDecoder.step_tokens``, the head on the last row only). The rule depends only on how
      many prompt tokens are left, so a cold run takes the same path from the same chunk boundary
      and an aligned hit stays bit-exact (each row is computed exactly as a single step at its
      position; a hybrid's recurrent layers take the rows in order on the sequence's state).
      Only on caches the runtime steps (``rows_fit``: ``CpuDecoder.can_feed_tail``; an empty
      one, a ring or MLX's batch cache keep the chunks).
    - **A hit's rest in one chunk**: after a hit off the chunk grid, the rest goes in one pass
      when it fits in a chunk (:func:`next_chunk`), and that pass takes the last token along,
      its logits from the last row only: ``CpuDecoder.prefill`` where the runtime takes the
      cache (more than ``EXACT_ROWS`` tokens; fewer go as decode rows, above), else MLX's
      chunk (``forward.last_row_logits``). No cold run and no
      aligned hit starts off the grid, so neither changes: their last token stays a decode
      step, and a full hit's first token still equals the cold run's bit for bit. (A hit
      off the grid is not bit-exact with the cold run whatever the split.) On the families
      the CPU decode runtime takes, whose output head is known.

    Decode rows whatever the weights: a rest that short (at most ``EXACT_ROWS``, fewer than the
    runtime's ``PROMPT_ROWS_MIN``) would otherwise be a prefill chunk whose products take the
    same decode rows' kernels, then a step of its own; the cold run takes the same path from the
    same boundary. A hit's rest in one chunk with float32 weights only (``rest_chunk``,
    ``factory.rows_match_chunks``): with weights in ggml's blocks a step and a chunk's last row
    can round an activation to different 8-bit steps, so the first token's log-probabilities
    could move by ~1e-2 against the cold run's step.

    Not when the tail would pass a snapshot boundary or a cache breakpoint (``pins``: those are
    taken between prefill chunks).
    """
    n = len(prompt)
    if n - start < 2:
        return None
    if boundary is not None and start < boundary < n:
        return None
    if any(start < position < n for position, _ in pins):
        return None
    if n - start <= EXACT_ROWS and rows_fit():
        return prompt[start:]
    if rest_chunk and start % chunk_size and n - start <= chunk_size:
        return prompt[start:]
    return None
