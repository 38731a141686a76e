"""The CPU decode runtime (model/cpu_decode.py) and its kernels in blas_shim.c.

- Each kernel against a float64 NumPy reference (RMS norm, RoPE in both layouts against
  ``mx.fast.rope``, SiLU gating with the polynomial ``2 ** x`` over extreme inputs, the decode
  attention for grouped heads at several lengths).
- Per supported family: the decoder's logits against MLX's step on a copy of the same cache,
  step after step across the cache's 256-position growth, within LOGITS_RTOL, with the same
  greedy token; a cache the decoder wrote continues in MLX to the same logits.
- The arrays others hold (a prompt-cache entry, a sibling's prefix) are never written.
- The models it does not take say why, and ``MLXCEL_CPU_DECODE=0`` turns it off.
- Through the engine: greedy tokens with the runtime equal those without it.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxcel_compat import backend
from mlxcel_compat.engine.request import TokenEvent
from mlxcel_compat.model import cpu_decode
from mlxcel_compat.model.loader import load_model
from tests.conftest import tiny_model
from tests.engine_harness import EngineHarness

LOGITS_RTOL = 1e-4  # of the largest logit: measured 1e-6 to 4e-6 (summation order, 2 ** x)
KERNEL_RTOL = 2e-6

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


def _kernels() -> cpu_decode._Kernels:
    return cpu_decode._Kernels(backend.matmul_shim().lib)


def _p(a: np.ndarray) -> int:
    return a.ctypes.data


def test_rms_norm_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for rows, n in [(1, 768), (12, 64), (3, 37)]:
        x = rng.standard_normal((rows, n)).astype(np.float32) * 3
        w = rng.standard_normal(n).astype(np.float32)
        out = np.empty_like(x)
        _kernels().rms_norm(_p(x), _p(w), _p(out), rows, n, 1e-5)
        x64 = x.astype(np.float64)
        ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
        assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max()


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_matches_mx_fast_rope(traditional: bool) -> None:
    """Rotating by the (cos, sin) the decoder takes from the RoPE module itself gives exactly
    what the module gives."""
    rope = nn.RoPE(64, traditional=traditional, base=500000.0)
    dec = cpu_decode.CpuDecoder.__new__(cpu_decode.CpuDecoder)
    dec.rope, dec.traditional, dec.head_dim, dec._angle_blocks = rope, traditional, 64, {}
    x = np.random.default_rng(1).standard_normal((1, 6, 1, 64)).astype(np.float32)
    for pos in (0, 5, 255, 256, 1000):
        cos, sin = dec._angle_row(pos)  # addresses
        ours = x.copy()
        _kernels().rope(_p(ours), 6, 64, cos, sin, traditional)
        theirs = np.array(rope(mx.array(x), offset=pos))
        assert np.abs(ours - theirs).max() <= 1e-6 * np.abs(theirs).max(), pos


def test_swiglu_matches_the_formula_over_extremes() -> None:
    rng = np.random.default_rng(2)
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 120.0, -120.0, 200.0, -200.0, 1e6, -1e6], np.float32)
    gate = np.concatenate([rng.standard_normal(4093).astype(np.float32) * 8, special])
    up = rng.standard_normal(gate.size).astype(np.float32)
    ours = gate.copy()
    _kernels().swiglu(_p(ours), _p(up), gate.size)
    g64 = gate.astype(np.float64)
    with np.errstate(over="ignore"):
        ref = g64 / (1.0 + np.exp(-g64)) * up
    assert np.isfinite(ours).all()
    # float32 rounding of -gate log2 e before the power: up to ~1.5e-6 relative at |gate| ~ 30;
    # below gate ~ -87 the power is clamped at 2 ** 126 (a result under 1e-36 |gate up| off zero).
    scale = np.maximum(np.abs(ref), np.abs(g64 * up) * 1e-30 + 1e-30)
    assert (np.abs(ours - ref) / scale).max() < 4e-6


@pytest.mark.parametrize("kv_heads,group,n,peak", [(4, 3, 1, 1), (4, 3, 300, 1), (2, 1, 17, 1), (1, 8, 1025, 1), (4, 3, 300, 60)])
def test_decode_attention_matches_a_reference(kv_heads: int, group: int, n: int, peak: float) -> None:
    """Scores, a softmax and the product by the values per KV head, the new key and value
    written at position n - 1 first; the rest of the cache is left as it was. ``peak`` scales
    the queries: at 60 most weights are below 2 ** -64 of the largest (set to zero)."""
    rng = np.random.default_rng(3)
    d, capacity, pos = 64, n + 40, n - 1
    keys = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
    values = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
    before_k, before_v = keys.copy(), values.copy()
    q = (rng.standard_normal(kv_heads * group * d) * 2 * peak).astype(np.float32)
    k_new = rng.standard_normal(kv_heads * d).astype(np.float32)
    v_new = rng.standard_normal(kv_heads * d).astype(np.float32)
    out = np.empty(kv_heads * group * d, np.float32)
    scale = d ** -0.5
    _kernels().attention(_p(q), _p(k_new), _p(v_new), _p(keys), _p(values), _p(out), kv_heads, group, d, pos,
                         capacity, scale * cpu_decode.LOG2E)
    assert np.array_equal(keys[:, pos], k_new.reshape(kv_heads, d)) and np.array_equal(values[:, pos], v_new.reshape(kv_heads, d))
    untouched = np.ones(capacity, bool)
    untouched[pos] = False
    assert np.array_equal(keys[:, untouched], before_k[:, untouched]) and np.array_equal(values[:, untouched], before_v[:, untouched])
    k64, v64 = keys[:, :n].astype(np.float64), values[:, :n].astype(np.float64)
    qs = q.reshape(kv_heads, group, d).astype(np.float64)
    s = np.einsum("hgd,htd->hgt", qs, k64) * scale
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    ref = np.einsum("hgt,htd->hgd", w / w.sum(axis=-1, keepdims=True), v64).reshape(-1)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def _prefill(model: nn.Module, n: int) -> list[KVCache]:
    cache = make_prompt_cache(model)
    ids = mx.array([[(7 * i + 3) % 500 + 10 for i in range(n)]])
    model(ids, cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _mlx_logits(model: nn.Module, token: int, cache: list[KVCache]) -> np.ndarray:
    out = model(mx.array([[token]]), cache=cache)[0, -1]
    mx.eval(out)
    return np.array(out)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral"])
def test_decoder_follows_mlx_step_for_step(family: str) -> None:
    """40 greedy steps from a 230-token prompt (the cache grows past 256 positions on the way):
    each step's logits within LOGITS_RTOL of MLX's on its own copy of the cache, the same
    token; then MLX continues the decoder's cache to the same logits as its own."""
    loaded = load_model(str(tiny_model(family)), [])
    model, decoder = loaded.model, loaded.decoder
    assert isinstance(decoder, cpu_decode.CpuDecoder)
    ours = _prefill(model, 230)
    theirs = copy.deepcopy(ours)
    owned = cpu_decode.OwnedCache()
    token = 11
    for step in range(40):
        assert decoder.can_run(ours, owned)
        got = decoder.step(token, ours, owned).copy()
        want = _mlx_logits(model, token, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max(), step
        assert int(got.argmax()) == int(want.argmax()), step
        token = int(want.argmax())
    assert ours[0].offset == theirs[0].offset == 270 and ours[0].keys.shape[2] >= 271
    for _ in range(3):  # MLX reads and extends the cache the decoder wrote
        got, want = _mlx_logits(model, token, ours), _mlx_logits(model, token, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
        token = int(want.argmax())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rows_stepped_together_are_bit_identical_to_rows_alone(family: str) -> None:
    """Three sequences at different positions (one past a 256-position block of angles), stepped
    together for 6 steps, give exactly the logits each gives stepped alone from a copy."""
    loaded = load_model(str(tiny_model(family)), [])
    model, decoder = loaded.model, loaded.decoder
    together = [_prefill(model, n) for n in (20, 250, 300)]
    alone = [copy.deepcopy(c) for c in together]
    owned_t = [cpu_decode.OwnedCache() for _ in together]
    owned_a = [cpu_decode.OwnedCache() for _ in alone]
    tokens = [11, 12, 13]
    for _ in range(6):
        rows = decoder.step_rows(tokens, together, owned_t).copy()
        for r, (cache, owned) in enumerate(zip(alone, owned_a)):
            assert np.array_equal(rows[r], decoder.step(tokens[r], cache, owned))
        tokens = [int(t) for t in rows.argmax(axis=1)]
    assert [c[0].offset for c in together] == [26, 256, 306]


def test_a_failed_step_advances_no_cache() -> None:
    loaded = load_model(str(tiny_model("llama")), [])
    caches = [_prefill(loaded.model, n) for n in (10, 12)]
    owned = [cpu_decode.OwnedCache() for _ in caches]
    with pytest.raises(ValueError):
        loaded.decoder.step_rows([5, 10**9], caches, owned)
    assert [c[0].offset for c in caches] == [10, 12]


def test_arrays_held_elsewhere_are_never_written() -> None:
    """A prompt-cache entry or a sibling holds the cache's arrays (here: views of them): the
    decoder copies each layer into its own buffer once and writes only there."""
    loaded = load_model(str(tiny_model("llama")), [])
    cache = _prefill(loaded.model, 64)
    held = [(c.keys, c.values, c.keys[..., :64, :]) for c in cache]
    saved = [tuple(np.array(a) for a in arrays) for arrays in held]
    owned = cpu_decode.OwnedCache()
    for token in (5, 6, 7):
        loaded.decoder.step(token, cache, owned)
    for c, arrays, copies in zip(cache, held, saved):
        assert c.keys is not arrays[0] and c.values is not arrays[1]
        for a, b in zip(arrays, copies):
            assert np.array_equal(np.array(a), b)
    first = [a for a, _ in owned.arrays]
    loaded.decoder.step(8, cache, owned)
    assert all(c.keys is a for c, a in zip(cache, first))
    cache[0].keys = cache[0].keys + 0  # replaced by someone else (MLX's own step): copied again
    assert loaded.decoder.can_run(cache, owned)
    replaced = cache[0].keys
    loaded.decoder.step(9, cache, owned)
    assert cache[0].keys is not replaced and cache[0].offset == 69


def test_a_token_outside_the_vocabulary_is_an_error_and_changes_nothing() -> None:
    loaded = load_model(str(tiny_model("llama")), [])
    cache = _prefill(loaded.model, 16)
    owned = cpu_decode.OwnedCache()
    for bad in (-1, loaded.decoder.embed.shape[0]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            loaded.decoder.step(bad, cache, owned)
    assert cache[0].offset == 16 and not owned.arrays


def test_caches_it_does_not_take() -> None:
    loaded = load_model(str(tiny_model("llama")), [])
    owned = cpu_decode.OwnedCache()
    assert not loaded.decoder.can_run([RotatingKVCache(max_size=64) for _ in loaded.model.layers], owned)
    batch = _prefill(loaded.model, 8)
    for c in batch:
        c.keys, c.values = mx.concatenate([c.keys] * 2), mx.concatenate([c.values] * 2)
    assert not loaded.decoder.can_run(batch, owned)


@pytest.mark.parametrize("family,reason", [
    ("gemma3_text", "model type 'gemma3_text'"), ("qwen3_next", "model type 'qwen3_next'"), ("lfm2", "model type 'lfm2'"),
])
def test_other_families_keep_mlx_and_say_why(family: str, reason: str) -> None:
    loaded = load_model(str(tiny_model(family)), [])
    assert loaded.decoder is None
    assert (cpu_decode.unsupported(loaded.model) or "").startswith(reason)


def test_quantized_weights_and_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(tiny_model("llama")), [])
    monkeypatch.setenv("MLXCEL_CPU_DECODE", "0")
    assert cpu_decode.build(loaded.model, backend.matmul_shim()) == "off (MLXCEL_CPU_DECODE=0)"
    monkeypatch.delenv("MLXCEL_CPU_DECODE")
    assert cpu_decode.build(loaded.model, None) == "the BLAS shim's kernels are not loaded"
    nn.quantize(loaded.model, group_size=32, bits=8)
    assert cpu_decode.unsupported(loaded.model) == "quantized weights"


def test_engine_batches_through_the_runtime_exactly_like_lone_runs() -> None:
    """Three requests admitted together decode in runtime passes of several rows, and each
    gives exactly the tokens it gives alone (rows are bit-identical to lone steps)."""
    import queue

    from tests.test_engine_batching import run_logged

    h = EngineHarness(tiny_model("qwen3"), n_parallel=4)
    try:
        prompts = [[(17 * i + 31 * r) % 900 + 20 for i in range(40 + 7 * r)] for r in range(3)]
        requests = [h.request(p, n_predict=24, ignore_eos=True, cache=False) for p in prompts]
        log, events = run_logged(h, requests, [queue.Queue() for _ in requests])
        assert any(rows > 1 and n == 1 for rows, n in log.shapes)
        for prompt, seen in zip(prompts, events):
            tokens = [e.token for e in seen if isinstance(e, TokenEvent)]
            assert len(tokens) == 24
            assert tokens == h.run(prompt, n_predict=24, ignore_eos=True, cache=False).tokens
    finally:
        h.close()


def test_a_row_the_runtime_cannot_take_turns_the_batch_back_into_a_merged_one() -> None:
    """Every cache of a model the runtime takes is a plain KVCache, so this is the fallback for
    what should not happen: a row whose layers are another cache class joins a runtime batch.
    The rows already in it move into one merged batch cache, and every row decodes on, in
    MLX's batched pass, like a lone run wherever that run's choice was decided."""
    from mlxcel_compat.engine.batch import DecodeBatch
    from mlxcel_compat.engine.factory import make_sequence
    from tests.engine_harness import Run
    from tests.test_engine_batching import agree_where_decided

    class OtherKV(KVCache):
        pass

    h = EngineHarness(tiny_model("llama"), n_parallel=4)
    try:
        prompts = [[(13 * i + 7 * r) % 900 + 20 for i in range(30 + 9 * r)] for r in range(2)]
        lone = [h.run(p, n_predict=8, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
        events: list = []

        def on_engine() -> dict:
            engine = h.engine
            seqs = [make_sequence(engine, h.request(p, n_predict=8, ignore_eos=True, cache=False), events.append, i)
                    for i, p in enumerate(prompts)]
            for seq in seqs:
                while not seq.prompt_ready:
                    seq.prefill_step()
            others = []
            for c in seqs[1].cache:
                other = OtherKV()
                other.keys, other.values, other.offset = c.keys, c.values, c.offset
                others.append(other)
            seqs[1].cache = others
            batch = DecodeBatch(engine.loaded.model, engine.loaded.decoder)
            batch.add(seqs[0])
            runtime_then = batch.decoder is not None and seqs[0].cache != []
            batch.add(seqs[1])
            merged = batch.decoder is None and batch.cache is not None and seqs[0].cache == []
            while len(batch):
                _, failed = batch.step()
                assert not failed
            return {"runtime_then": runtime_then, "merged": merged,
                    "tokens": {seq.request.task_id: list(seq.generated) for seq in seqs}, "ids": [s.request.task_id for s in seqs]}

        out = h.on_engine(on_engine)
        assert out["runtime_then"] and out["merged"]
        for task_id, alone in zip(out["ids"], lone):
            tokens = out["tokens"][task_id]
            assert len(tokens) == 8
            agree_where_decided(Run(tokens=tokens), alone)
    finally:
        h.close()


def test_engine_tokens_equal_with_and_without_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generation through the engine (prefill, the pipelined loop, the prompt cache)
    gives the same tokens with the runtime as with MLX's step, and a prompt-cache hit gives
    the same tokens as the cold run."""
    prompt = [(11 * i + 7) % 900 + 20 for i in range(300)]
    runs = {}
    for on in (True, False):
        monkeypatch.setenv("MLXCEL_CPU_DECODE", "1" if on else "0")
        h = EngineHarness(tiny_model("llama"))
        try:
            assert (h.engine.loaded.decoder is not None) == on
            cold = h.run(prompt, n_predict=48, ignore_eos=True)
            hit = h.run(prompt, n_predict=48, ignore_eos=True)
            assert hit.finish.n_cached == len(prompt) - 1
            assert hit.tokens == cold.tokens
            if on:  # every step of both runs: the last prompt token, then each token fed back
                assert h.engine.loaded.decoder.steps == 2 * 48
            runs[on] = cold.tokens
        finally:
            h.close()
    assert len(runs[True]) == 48 and runs[True] == runs[False]
