"""Checks shared by the CPU decode runtime's tests (dense and MoE)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from mlxcel_compat.runtime import decode_kv


def assert_rows_together_equal_rows_alone(decoder: Any, together: list[Any], steps: int) -> None:
    """Sequences stepped together (``step_rows``: one pass over the weights for every row) give
    exactly the logits each gives stepped alone (``step`` on a copy of its cache), step after
    step, each fed its own greedy token. ``together`` is advanced by ``steps`` positions."""
    alone = [copy.deepcopy(c) for c in together]
    owned_t = [decode_kv.OwnedCache() for _ in together]
    owned_a = [decode_kv.OwnedCache() for _ in alone]
    tokens = [11 + i for i in range(len(together))]
    for _ in range(steps):
        rows = decoder.step_rows(tokens, together, owned_t).copy()
        for r, (cache, owned) in enumerate(zip(alone, owned_a)):
            assert np.array_equal(rows[r], decoder.step(tokens[r], cache, owned))
        tokens = [int(t) for t in rows.argmax(axis=1)]
