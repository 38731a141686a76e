"""Prompt chunks of a model with sliding-window layers (gemma3) through the CPU decode runtime
(``runtime/ring_chunks.py``, ``mlxcel_chunk_attention_window``):

- the windowed chunk attention kernel against a float64 reference, windows shorter and longer
  than the chunk;
- gemma3's prompts split into chunks every way that matters (inside the window, across it,
  longer than it, after decode steps wrapped the ring) leave every layer's cache as MLX's
  chunks leave it (rings included: the same buffer, ``_idx`` and slots), and steps then follow
  MLX's; a chunk with logits gives MLX's last row's logits; arrays held elsewhere (a prompt-cache
  entry's) are never written;
- the engine prefills gemma3's prompts through the runtime.
"""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from tests.conftest import tiny_model

LOGITS_RTOL = 1e-4  # of the largest logit, as tests/runtime/test_cpu_decode.py's


def _ids(n: int, seed: int = 0) -> list[int]:
    return [(11 * i + 5 + 17 * seed) % 480 + 12 for i in range(n)]


@pytest.fixture(scope="module")
def gemma() -> tuple:
    loaded = load_model(str(tiny_model("gemma3_text")), [])
    assert loaded.decoder is not None and loaded.decoder.kv.rings and loaded.decoder.window == 64
    return loaded.model, loaded.decoder


def exaone4_with_windows(directory: Path) -> Path:
    """The tiny EXAONE 4 with the 32B's layout (three local layers with RoPE, then one global
    without any, ``sliding_window_pattern`` "LLLG"), a window of 8."""
    from mlxcel_compat.testing.families import model_config
    from mlxcel_compat.testing.model_directory import write_model_directory
    from mlxcel_compat.testing.weights import seeded_weights

    config = model_config("exaone4", "tiny")
    config.update(num_hidden_layers=4, sliding_window=8, sliding_window_pattern="LLLG")
    directory.mkdir(parents=True, exist_ok=True)
    write_model_directory(directory, "exaone4", "tiny", seeded_weights("exaone4", "tiny", config), config)
    return directory


@pytest.fixture(scope="module", params=["gemma3_text", "olmo3", "exaone4"])
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A model with sliding-window layers on the runtime: Gemma 3's (``is_sliding``, a window of 64),
    OLMo 3's (named by ``layer_types``, three sliding layers to one global, a window of 16) and
    EXAONE 4's (``is_local``; its global layers without RoPE, a window of 8)."""
    path = (exaone4_with_windows(tmp_path_factory.mktemp("exaone4")) if request.param == "exaone4"
            else tiny_model(request.param))
    loaded = load_model(str(path), [])
    assert loaded.decoder is not None and loaded.decoder.kv.rings
    return loaded.model, loaded.decoder


def _mlx_chunks(model: object, ids: list[int], splits: list[int], cache: list | None = None) -> list:
    cache = make_prompt_cache(model) if cache is None else cache
    start = 0
    for n in splits:
        model(mx.array([ids[start:start + n]]), cache=cache)
        mx.eval([c.state for c in cache])
        start += n
    return cache


def _newest(c: RotatingKVCache, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A ring's newest ``n`` slots in the order of their positions (mlx-lm's ``_temporal_order``)."""
    keys, values = np.array(c.keys), np.array(c.values)
    cap, idx = keys.shape[2], c._idx
    order = (list(range(cap)) if idx == cap else list(range(idx, cap)) + list(range(idx))
             if idx < c.offset else list(range(idx)))
    return keys[:, :, order[-n:]], values[:, :, order[-n:]]


def _assert_same_cache(ours: list, theirs: list) -> None:
    """Every layer at the same offset; a ring of ``min(offset, window)`` slots, ``_idx`` after
    them (MLX's chunk leaves up to ``window - 1 + rows``: the same positions once its next step
    trims it) whose newest ``min(offset, window)`` slots in order hold MLX's keys and values, a growing cache the
    same first ``offset`` positions (within LOGITS_RTOL of the largest)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert type(a) is type(b) and a.offset == b.offset, i
        if isinstance(b, RotatingKVCache):
            n = min(a.offset, a.max_size)
            assert a.keys.shape[2] == n and a._idx == n, (i, a.keys.shape, a._idx)
            pairs = list(zip(_newest(a, n), _newest(b, n)))
        else:
            pairs = [(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :]),
                     (a.values[..., :a.offset, :], b.values[..., :b.offset, :])]
        for x, y in pairs:
            x, y = np.array(x), np.array(y)
            assert np.abs(x - y).max() <= LOGITS_RTOL * np.abs(y).max(), i


def _step_logits(model: object, token: int, cache: list) -> np.ndarray:
    out = model(mx.array([[token]]), cache=cache)[0, -1]
    mx.eval(out)
    return np.array(out)


@pytest.mark.parametrize("pos,rows,window", [(0, 40, 16), (100, 33, 64), (255, 256, 128), (20, 200, 48), (0, 17, 100)])
def test_windowed_chunk_attention_matches_a_reference(pos: int, rows: int, window: int) -> None:
    """Row r of the chunk attends slots [pos + r + 1 - window, pos + r] only (and nothing before
    slot 0): against float64 NumPy, with gemma3's shape (one KV head, four query heads) and a
    group of one; chunks longer than the window, and a window longer than everything seen."""
    lib = backend.matmul_shim().lib
    fn = lib.mlxcel_chunk_attention_window
    p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    fn.argtypes, fn.restype = [p, p, p, p, p, p, i, i, i, i, i, L, f, i, i, i, p], ctypes.c_int  # float32 KV, no sinks
    rng = np.random.default_rng(pos + rows)
    for kv_heads, group in ((1, 4), (2, 1)):
        d, capacity = 64, pos + rows
        keys = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
        values = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
        q = (rng.standard_normal((rows, kv_heads * group * d)) * 2).astype(np.float32)
        k_new = rng.standard_normal((rows, kv_heads * d)).astype(np.float32)
        v_new = rng.standard_normal((rows, kv_heads * d)).astype(np.float32)
        out = np.empty((rows, kv_heads * group * d), np.float32)
        scale = d ** -0.5
        data = [a.ctypes.data for a in (q, k_new, v_new, keys, values, out)]
        assert fn(*data, rows, kv_heads, group, d, pos, capacity, scale * cpu_decode.LOG2E, 0, 0, window, None) == 0
        assert np.array_equal(keys[:, pos:], k_new.reshape(rows, kv_heads, d).transpose(1, 0, 2))
        n = pos + rows
        s = np.einsum("rhgd,htd->rhgt", q.reshape(rows, kv_heads, group, d).astype(np.float64),
                      keys.astype(np.float64)) * scale
        at = (pos + np.arange(rows))[:, None]
        hidden = (np.arange(n)[None, :] > at) | (np.arange(n)[None, :] <= at - window)
        s = np.where(hidden[:, None, None, :], -np.inf, s)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        ref = np.einsum("rhgt,htd->rhgd", w / w.sum(axis=-1, keepdims=True), values.astype(np.float64)).reshape(rows, -1)
        assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
        assert fn(*data, rows, kv_heads, group, d, pos + 1, capacity, scale, 0, 0, window, None) == -1  # past the capacity


@pytest.mark.parametrize("splits", [[70], [40, 30], [64, 64, 10], [200], [30, 100, 7, 90]])
def test_cold_chunks_leave_mlx_s_cache_and_steps_follow(windowed: tuple, splits: list[int]) -> None:
    """A cold prompt fed by ``prefill(..., logits=False)`` in chunks (the tiny Gemma's window is
    64, OLMo 3's 16, EXAONE 4's 8: chunks inside it, across it and longer than it) leaves each layer as MLX's chunks do,
    then 20 steps (the rings wrap) each within LOGITS_RTOL of MLX's, then one more chunk on the
    decoder's own wrapped rings (the next turn of a conversation) gives MLX's logits and cache, and
    leaves the rings it held before (a snapshot may hold them) unwritten."""
    model, decoder = windowed
    ids = _ids(sum(splits), seed=len(splits))
    theirs = _mlx_chunks(model, ids, splits)
    ours, owned = make_prompt_cache(model), decode_kv.OwnedCache()
    fed, start = decoder.prefilled, 0
    for n in splits:
        assert decoder.can_prefill(ours, owned)
        assert decoder.prefill(ids[start:start + n], ours, owned, logits=False) is None
        start += n
    assert decoder.prefilled == fed + sum(splits) and owned.holds(ours)
    _assert_same_cache(ours, theirs)
    for t in range(20):
        got, want = decoder.step(3 + t, ours, owned).copy(), _step_logits(model, 3 + t, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max(), t
    more = _ids(37, seed=9)
    held = [(ours[i].keys, np.array(ours[i].keys)) for i in decoder.kv.rings]  # as a snapshot would hold them
    got = decoder.prefill(more, ours, owned).copy()
    want = np.array(model(mx.array([more]), cache=theirs)[0, -1])
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    _assert_same_cache(ours, theirs)
    assert all(np.array_equal(np.array(a), saved) for a, saved in held)  # a new ring: the old one unwritten


@pytest.mark.parametrize("prompt,steps,rest", [(50, 30, 40), (100, 3, 90), (20, 0, 25)])
def test_a_chunk_after_steps_on_shared_arrays_matches_mlx_and_writes_nothing_shared(
        gemma: tuple, prompt: int, steps: int, rest: int) -> None:
    """A chunk with logits (a hit's rest, ``forward_logits``) on a cache whose rings decode steps
    wrapped, its arrays held elsewhere (a prompt-cache entry's): MLX's last row's logits and
    MLX's cache, the shared arrays unwritten, and the next steps follow MLX's."""
    model, decoder = gemma
    shared = _mlx_chunks(model, _ids(prompt, seed=1), [prompt])
    for t in range(steps):
        _step_logits(model, 20 + t, shared)
    before = [(np.array(c.keys), np.array(c.values)) for c in shared]
    hit, theirs = [copy.copy(c) for c in shared], copy.deepcopy(shared)
    ids = _ids(rest, seed=2)
    owned = decode_kv.OwnedCache()
    assert decoder.can_prefill(hit, owned)
    got = decoder.prefill(ids, hit, owned).copy()
    want = np.array(model(mx.array([ids]), cache=theirs)[0, -1])
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    _assert_same_cache(hit, theirs)
    for c, (keys, values) in zip(shared, before):
        assert np.array_equal(np.array(c.keys), keys) and np.array_equal(np.array(c.values), values)
    token = int(want.argmax())
    for _ in range(3):
        got, want = decoder.step(token, hit, owned).copy(), _step_logits(model, token, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
        token = int(want.argmax())


def test_rings_it_does_not_take(gemma: tuple) -> None:
    """A ring of another size, one with a kept prefix, layers at different offsets or a plain
    cache where a ring belongs: MLX's chunk instead (``can_prefill`` False)."""
    from mlx_lm.models.cache import KVCache

    model, decoder = gemma
    ring = decoder.kv.rings[0]
    for spoil in ("size", "keep", "offset", "type"):
        cache = _mlx_chunks(model, _ids(30), [30])
        if spoil == "size":
            cache[ring].max_size = 128
        elif spoil == "keep":
            cache[ring].keep = 4
        elif spoil == "offset":
            cache[decoder.kv.plain[0]].offset += 1
        else:
            cache[ring] = KVCache()
        assert not decoder.can_prefill(cache, decode_kv.OwnedCache()), spoil
