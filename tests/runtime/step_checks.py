"""Checks and helpers shared by the CPU decode runtime's tests (dense, MoE, hybrid): a prompt of
ids, a cache prefilled by MLX, MLX's logits for one step, a recurrent model's caches against
MLX's, tiny models and their decoders loaded once a module."""

from __future__ import annotations

import copy
from typing import Any, Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from mlxcel_compat.runtime import cpu_decode, decode_kv


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


def assert_tail_rows_equal_single_steps(model: nn.Module, decoder: Any, reps: int = 6) -> None:
    """A prompt's short rest fed as the rows of one pass on a recurrent hybrid (``step_tokens``,
    ``can_feed_tail``) equals single steps bit for bit: every row's logits, the recurrent states
    and the KV; ``last_only`` computes the last row's logits alone, the same bits. The rows share
    one state, which the recurrence must take in order: ``reps`` runs, since a race between them
    shows only sometimes. Speculative drafts stay off hybrids (``can_step_tokens``): rejected rows
    cannot leave a recurrent state again."""
    tokens = ids(16, seed=41)  # EXACT_ROWS: one pass
    stepped, owned = prefilled(model, 30), decode_kv.OwnedCache()
    assert decoder.can_feed_tail(stepped, owned) and not decoder.can_step_tokens(stepped, owned)
    want = np.stack([decoder.step(t, stepped, owned).copy() for t in tokens])
    for rep in range(reps):
        last_only = rep % 2 == 1
        cache = prefilled(model, 30)
        got = decoder.step_tokens(tokens, cache, decode_kv.OwnedCache(), last_only=last_only)
        assert np.array_equal(got, want[-1:] if last_only else want), rep
        assert decoder.offset(cache) == decoder.offset(stepped) == 46
        for i in decoder.delta_layers:
            assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(cache[i].cache, stepped[i].cache)), rep


def ids(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 3 + 13 * seed) % 500 + 10 for i in range(n)]


def prefilled(model: nn.Module, n: int, seed: int = 0) -> list:
    cache = make_prompt_cache(model)
    model(mx.array([ids(n, seed)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def mlx_logits(model: nn.Module, token: int | list[int], cache: list) -> np.ndarray:
    """MLX's last-row logits after feeding ``token`` (one, or a chunk of them) into ``cache``."""
    out = model(mx.array([[token] if isinstance(token, int) else list(token)]), cache=cache)[0, -1]
    mx.eval(out)
    return np.array(out)


def attention_lib() -> Any:
    """The shim's library with the attention kernels' argument types set (the kernels' tests call
    them directly: test_cpu_decode_kv16.py, test_cpu_decode_kvq.py)."""
    import ctypes

    from mlxcel_compat.runtime import backend

    lib = backend.matmul_shim().lib
    p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.mlxcel_decode_attention_at.argtypes = [p, p, p, p, p, p, i, i, i, i, i, L, f, i, i]
    lib.mlxcel_decode_attention_apart.argtypes = [p, p, p, p, p, p, p, p, i, i, i, i, L, f, i, i]
    lib.mlxcel_chunk_attention.argtypes = [p, p, p, p, p, p, i, i, i, i, i, L, f, i, i]
    lib.mlxcel_chunk_attention_apart.argtypes = [p, p, p, p, p, p, p, p, i, i, i, i, i, L, f, i, i]
    for fn in (lib.mlxcel_decode_attention_at, lib.mlxcel_decode_attention_apart, lib.mlxcel_chunk_attention,
               lib.mlxcel_chunk_attention_apart):
        fn.restype = ctypes.c_int
    return lib


def address(a: np.ndarray) -> int:
    """An array's data address, as the kernels take it."""
    return a.ctypes.data


def attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """softmax(scale q K^T) V per KV head group, float64: q (Hk, g, d), keys/values (Hk, n, d)."""
    s = np.einsum("hgd,htd->hgt", q, keys) * scale
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hgt,htd->hgd", w / w.sum(axis=-1, keepdims=True), values)


def close(got: np.ndarray, want: np.ndarray, rtol: float) -> bool:
    """``got`` within ``rtol`` of ``want``'s largest magnitude."""
    return bool(np.abs(got - want).max() <= rtol * np.abs(want).max())


def assert_same_cache(ours: list, theirs: list, rtol: float) -> None:
    """The decoder's cache as MLX's update leaves it: the same layers (a KV-sharing layer has
    none), each at the same offset; a ring the same buffer shape, ``_idx`` and ``max_size`` and
    each slot holding the same key and value (within ``rtol`` of the largest: they come from
    slightly different activations); a growing cache the same first ``offset`` positions."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert type(a) is type(b) and a.offset == b.offset, i
        if isinstance(b, RotatingKVCache):
            assert a.keys.shape == b.keys.shape and a._idx == b._idx and a.max_size == b.max_size, (i, a._idx, b._idx)
            pairs = [(a.keys, b.keys), (a.values, b.values)]
        else:
            n = b.offset
            pairs = [(a.keys[..., :n, :], b.keys[..., :n, :]), (a.values[..., :n, :], b.values[..., :n, :])]
        for x, y in pairs:
            assert close(np.array(x), np.array(y), rtol), i


def follow_mlx(model: nn.Module, decoder: Any, ours: list, steps: int, rtol: float,
               after_step: Callable[[list, list], None] | None = None) -> tuple[list, int]:
    """``steps`` greedy steps of ``decoder`` on ``ours`` beside MLX's step on a copy of it: each
    step's logits within ``rtol`` of MLX's largest and the same token; ``after_step(ours, theirs)``
    checks the caches after each step. Returns MLX's cache and the next token."""
    theirs = copy.deepcopy(ours)
    owned = decode_kv.OwnedCache()
    token = 11
    for step in range(steps):
        assert decoder.can_run(ours, owned)
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, token, theirs)
        assert close(got, want, rtol), step
        assert int(got.argmax()) == int(want.argmax()), step
        if after_step is not None:
            after_step(ours, theirs)
        token = int(want.argmax())
    return theirs, token


class Followed(NamedTuple):
    theirs: list  # MLX's cache after the steps
    exact: int  # steps bit-identical to MLX's
    decided: int  # steps whose greedy token was checked (MLX's top two far enough apart)


def each_step_on_the_runtime(decoder: Any, then: Callable[[list, list], None] | None = None
                              ) -> Callable[[list, list], None]:
    """An ``after_step`` for :func:`follow_mlx_teacher_forced`: each step went through the runtime
    (``decoder.steps`` one more than after the step before), then ``then(ours, theirs)``."""
    seen = [decoder.steps]

    def after_step(ours: list, theirs: list) -> None:
        assert decoder.steps == seen[0] + 1
        seen[0] = decoder.steps
        if then is not None:
            then(ours, theirs)

    return after_step


def follow_mlx_teacher_forced(model: nn.Module, decoder: Any, ours: list, steps: int, rtol: float,
                              after_step: Callable[[list, list], None] | None = None) -> Followed:
    """``steps`` teacher-forced steps of ``decoder`` on ``ours`` beside MLX's step on a copy of it
    (both fed MLX's greedy token), float32 weights or ggml's blocks: each step's logits within
    ``rtol`` of MLX's largest, the same token wherever MLX's top two are further apart than the
    tolerance lets either side move; ``after_step(ours, theirs)`` checks the caches after each
    step."""
    theirs = copy.deepcopy(ours)
    owned = decode_kv.OwnedCache()
    token, exact, decided = 11, 0, 0
    for step in range(steps):
        assert decoder.can_run(ours, owned)
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, token, theirs)
        top = np.abs(want).max()
        assert close(got, want, rtol), (step, np.abs(got - want).max() / top)
        first, second = np.sort(want)[-2:][::-1]
        if first - second > 2 * rtol * top:
            decided += 1
            assert int(got.argmax()) == int(want.argmax()), step
        if after_step is not None:
            after_step(ours, theirs)
        exact += bool(np.array_equal(got, want))
        token = int(want.argmax())
    return Followed(theirs, exact, decided)


def assert_mlx_continues(model: nn.Module, ours: list, theirs: list, token: int, rtol: float, steps: int = 3) -> None:
    """MLX reads and extends the cache the decoder wrote (``ours``) to the logits it computes on
    its own (``theirs``)."""
    for _ in range(steps):
        got, want = mlx_logits(model, token, ours), mlx_logits(model, token, theirs)
        assert close(got, want, rtol)
        token = int(want.argmax())


def assert_recurrent_caches_close(decoder: Any, ours: list, theirs: list, rtol: float) -> None:
    """Every recurrent layer's state arrays (``decoder.delta_layers``: a delta-net's conv and delta
    states, a Mamba-2 mixer's conv and SSM states) and every attention layer's keys and values,
    within ``rtol`` of the largest value."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if i in decoder.delta_layers:
            for got, want in zip(a.cache, b.cache):
                assert got.shape == want.shape and close(np.array(got), np.array(want), rtol), i
        else:
            assert a.offset == b.offset
            n = a.offset
            assert close(np.array(a.keys[..., :n, :]), np.array(b.keys[..., :n, :]), rtol), i
            assert close(np.array(a.values[..., :n, :]), np.array(b.values[..., :n, :]), rtol), i


def served_decoders(load: Callable[[str], Any]) -> Callable[[str], tuple[nn.Module, Any]]:
    """A getter of the served model of a spec (``load``: the tests' ``tiny_model``, a path) and its
    CPU decoder, every layer on the runtime, each loaded once (for a module-scoped fixture)."""
    from mlxcel_compat.model.loader import load_model

    loaded: dict[str, tuple[nn.Module, Any]] = {}

    def get(spec: str) -> tuple[nn.Module, Any]:
        if spec not in loaded:
            model = load_model(str(load(spec)), [])
            decoder = model.decoder
            assert isinstance(decoder, cpu_decode.CpuDecoder), cpu_decode.unsupported(model.model)
            loaded[spec] = model.model, decoder
        return loaded[spec]

    return get


def cold_chunk_beside_mlx(model: nn.Module, decoder: Any, prompt: list[int]) -> tuple[list, list, Any]:
    """``prompt`` fed cold as one prompt chunk by the runtime (``prefill``, no head) and by MLX:
    (the runtime's cache, MLX's cache, the runtime's OwnedCache). Asserts the runtime takes the
    chunk (and not as step rows) and counts its rows; the caller compares the caches."""
    theirs = make_prompt_cache(model)
    model(mx.array([prompt]), cache=theirs)
    mx.eval([c.state for c in theirs])
    ours, owned = make_prompt_cache(model), decode_kv.OwnedCache()
    assert decoder.can_prefill(ours, owned) and not decoder.can_step_tokens(ours, owned)
    prefilled_before = decoder.prefilled
    assert decoder.prefill(prompt, ours, owned, logits=False) is None
    assert decoder.prefilled == prefilled_before + len(prompt)
    return ours, theirs, owned


def chunks_together_and_alone(model: nn.Module, decoder: Any, prompts: list[list[int]]) -> list[tuple[list, list]]:
    """Each prompt's cache after its chunk prefilled beside the others in one pass
    (``prefill_rows``) and after it prefilled alone (``prefill``), as pairs; asserts each
    together-cache's offset. The caller compares the pairs (they should be equal)."""
    together = [make_prompt_cache(model) for _ in prompts]
    decoder.prefill_rows(prompts, together, [decode_kv.OwnedCache() for _ in prompts])
    pairs = []
    for prompt, ours in zip(prompts, together):
        alone = make_prompt_cache(model)
        decoder.prefill(prompt, alone, decode_kv.OwnedCache(), logits=False)
        assert decoder.offset(ours) == len(prompt)
        pairs.append((ours, alone))
    return pairs
