"""The CPU decode runtime on mixture-of-experts layers (runtime/decode_moe.py, ``moe_layer`` in
runtime/native/decode_pass.c).

- Per family it takes (qwen3_moe: normalised top-k; qwen2_moe: not renormalised, a shared expert
  behind its sigmoid gate; olmoe: not renormalised, q/k norms over the whole projection; gpt_oss:
  top-k then softmax, biased MXFP4 experts, clamped SwiGLU, attention sinks, sliding-window rings
  alternating with full layers, q/k/v/o biases; granitemoe: top-k then softmax, its embedding,
  residual and logits multipliers), on the factory's GGUF (attention and expert stacks in ggml's blocks):
  teacher-forced steps within BLOCK_RTOL of MLX's step on the same model (whose experts run
  through ``BlockSwitchGLU``), the same greedy token wherever MLX's choice is decided, the cache
  as MLX's update leaves it; some steps bit-identical (the same ggml products on the same
  activations: a runtime that routed, weighted or multiplied differently would have none).
- Rows stepped together (pairs grouped by expert across the rows) are bit-identical to each row
  stepped alone; a prompt chunk on the runtime leaves the KV MLX's chunk leaves, and the next
  step agrees.
- The MoE layers it does not take keep MLX's step and say why.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from tests.conftest import tiny_model
from tests.runtime.step_checks import (assert_rows_together_equal_rows_alone, follow_mlx_teacher_forced, ids, mlx_logits,
                                       prefilled)

# As tests/runtime/test_cpu_decode.py's BLOCK_RTOL: both steps quantize activations to the
# blocks' vec_dot_type, so a ~1e-7 difference elsewhere can move one activation by a quantum.
BLOCK_RTOL = 0.06

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


def close(got: np.ndarray, want: np.ndarray, rtol: float = BLOCK_RTOL) -> bool:
    return bool(np.abs(got - want).max() <= rtol * np.abs(want).max())


@pytest.fixture(scope="module")
def moe_decoder() -> Callable[[str], tuple[nn.Module, cpu_decode.CpuDecoder]]:
    """The tiny GGUF's model of a spec and its decoder, every layer (but ERNIE's and GLM's first) an MoE layer on the runtime,
    each loaded once for the module (every test makes its own caches)."""
    loaded: dict[str, tuple[nn.Module, cpu_decode.CpuDecoder]] = {}

    def get(spec: str) -> tuple[nn.Module, cpu_decode.CpuDecoder]:
        if spec not in loaded:
            model = load_model(str(tiny_model(spec)), [])
            decoder = model.decoder
            assert isinstance(decoder, cpu_decode.CpuDecoder), cpu_decode.unsupported(model.model)
            moe = [layer.moe is not None for layer in decoder.layers]  # ERNIE 4.5's first layer is dense
            assert all(moe[spec.startswith(("ernie4_5_moe", "glm4_moe")):]) and all(
                layer.gate is None for layer in decoder.layers if layer.moe is not None)
            loaded[spec] = model.model, decoder
        return loaded[spec]

    return get


@pytest.mark.parametrize("spec", ["qwen3_moe:q8_0", "qwen2_moe:q8_0", "olmoe:q8_0", "gpt_oss:mxfp4", "granitemoe:q8_0",
                                  "ernie4_5_moe:q8_0", "glm4_moe:q8_0"])
def test_moe_models_follow_mlx_step_for_step(moe_decoder: Callable, spec: str) -> None:
    """12 teacher-forced steps from each of two prompts: within BLOCK_RTOL of MLX's step, the
    same token where MLX's top two are further apart than either side may move, the KV cache
    as MLX's; at least a few steps bit-identical."""
    model, decoder = moe_decoder(spec)
    family = spec.split(":")[0]
    shared, renormalised = {"qwen3_moe": (False, True), "qwen2_moe": (True, False), "olmoe": (False, False),
                            "gpt_oss": (False, False), "granitemoe": (False, False), "ernie4_5_moe": (True, True),
                            "glm4_moe": (True, True)}[family]
    moe_layers = [layer for layer in decoder.layers if layer.moe is not None]  # ERNIE's and GLM's first layers are dense
    assert all((layer.moe.shared_gate is not None) == shared and layer.moe.norm_topk == renormalised
               and (layer.moe.shared_scale is not None) == (family == "qwen2_moe")  # ERNIE's shared experts: ungated
               for layer in moe_layers)
    gpt_oss = family == "gpt_oss"  # its gating, biased experts, clamped SwiGLU, sinks and windows are taken
    topk_first = family in ("gpt_oss", "granitemoe")  # top-k of the logits, then a softmax over those
    assert decoder.residual_scale == pytest.approx(0.22 if family == "granitemoe" else 0.0)  # granite's multipliers
    assert all((layer.moe.gating == "topk_softmax") == topk_first and (layer.moe.down_bias is not None) == gpt_oss
               and (layer.moe.limit == 7.0 if gpt_oss else layer.moe.limit is None)
               and (layer.sinks is not None) == gpt_oss for layer in moe_layers)
    assert [layer.sliding for layer in decoder.layers] == ([True, False] * 2 if gpt_oss else [False] * len(decoder.layers))
    assert decoder.qk_norm_whole == spec.startswith("olmoe")  # olmoe's q/k norms span the projection
    exact = total = 0

    def after_step(ours: list, theirs: list) -> None:
        nonlocal steps
        assert decoder.steps == steps + 1
        steps = decoder.steps
        for a, b in zip(ours, theirs):
            assert a.offset == b.offset
            assert close(np.array(a.keys[..., :a.offset, :]), np.array(b.keys[..., :b.offset, :]))

    for n, seed in [(40, 0), (150, 1)]:
        steps = decoder.steps
        same = follow_mlx_teacher_forced(model, decoder, prefilled(model, n, seed), 12, BLOCK_RTOL, after_step).exact
        exact, total = exact + same, total + 12
    print(f"{spec}: {exact} of {total} steps bit-identical to MLX's")
    assert exact >= 3


@pytest.mark.parametrize("spec", ["qwen3_moe:q8_0", "qwen2_moe:q8_0", "gpt_oss:mxfp4", "granitemoe:q8_0",
                                  "ernie4_5_moe:q8_0", "glm4_moe:q8_0"])
def test_moe_rows_stepped_together_are_bit_identical_to_rows_alone(moe_decoder: Callable, spec: str) -> None:
    """Three sequences stepped together (their (row, expert) pairs grouped by expert in one
    product) give exactly the logits each gives alone, step after step."""
    model, decoder = moe_decoder(spec)
    together = [prefilled(model, n, seed) for n, seed in ((20, 0), (70, 1), (130, 2))]
    assert_rows_together_equal_rows_alone(decoder, together, 5)
    assert [c[0].offset for c in together] == [25, 75, 135]


@pytest.mark.parametrize("spec", ["qwen3_moe:q8_0", "granitemoe:q8_0", "ernie4_5_moe:q8_0", "glm4_moe:q8_0"])
def test_a_moe_prompt_chunk_on_the_runtime_leaves_mlx_s_kv(moe_decoder: Callable, spec: str) -> None:
    """A cold 70-token prompt fed by ``prefill`` (every row's experts grouped, as MLX's
    ``BlockSwitchGLU`` groups them; granitemoe's multipliers) leaves the keys and values MLX's
    chunk leaves, and the following step agrees with MLX's on its cache."""
    model, decoder = moe_decoder(spec)
    prompt = ids(70, seed=31)
    theirs = make_prompt_cache(model)
    model(mx.array([prompt]), cache=theirs)
    mx.eval([c.state for c in theirs])
    ours, owned = make_prompt_cache(model), decode_kv.OwnedCache()
    assert decoder.can_prefill(ours, owned)
    assert decoder.prefill(prompt, ours, owned, logits=False) is None
    for a, b in zip(ours, theirs):
        assert a.offset == b.offset == 70
        assert close(np.array(a.keys[..., :70, :]), np.array(b.keys[..., :70, :]))
        assert close(np.array(a.values[..., :70, :]), np.array(b.values[..., :70, :]))
    got, want = decoder.step(5, ours, owned).copy(), mlx_logits(model, 5, theirs)
    assert close(got, want)


def test_gpt_oss_prompt_chunks_leave_mlx_s_windows_and_kv(moe_decoder: Callable) -> None:
    """gpt-oss's prompt chunks on the runtime (sinks in every layer; its sliding layers' rings
    laid out as Gemma 3's are: ring_chunks.py, a ring of at most the window): a cold 70-token chunk
    (rows far past the window of 16, which a chunk attention without the window would let see
    everything), then chunks of 10, 30, 1 and 25 rows: after each, the logits within
    BLOCK_RTOL of MLX's chunk on its own cache and the same token, every layer's offset, each
    ring's slot index, buffer and keys and values as MLX's; then steps agree."""
    model, decoder = moe_decoder("gpt_oss:mxfp4")
    assert decoder.window == 16 and decoder.kv.rings == [0, 2] and decoder.kv.plain == [1, 3]
    for chunks in ([70], [10, 30, 1, 25]):
        prompt = ids(sum(chunks), seed=7)
        theirs, ours, owned = make_prompt_cache(model), make_prompt_cache(model), decode_kv.OwnedCache()
        fed = decoder.prefilled
        at = 0
        for n in chunks:
            part, at = prompt[at:at + n], at + n
            want = mlx_logits_of(model, part, theirs)
            assert decoder.can_prefill(ours, owned)
            got = decoder.prefill(part, ours, owned).copy()
            assert close(got, want) and int(got.argmax()) == int(want.argmax()), (chunks, n)
            for layer, a, b in zip(decoder.layers, ours, theirs):
                assert a.offset == b.offset == at
                if layer.sliding:  # a ring of min(offset, window) slots in order; MLX's newest ones
                    held = min(at, decoder.window)
                    if n > 1:
                        assert a.keys.shape[2] == held and a._idx == held, (chunks, n)
                    for x, y in zip(_newest(a, held), _newest(b, held)):
                        assert close(x, y)
                else:
                    assert close(np.array(a.keys[..., :at, :]), np.array(b.keys[..., :at, :]))
        assert decoder.prefilled == fed + sum(n for n in chunks if n > 1)  # a one-row chunk is a step
        token = 5
        for _ in range(4):
            got, want = decoder.step(token, ours, owned).copy(), mlx_logits(model, token, theirs)
            assert close(got, want)
            token = int(want.argmax())


def _newest(c: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A ring's newest ``n`` slots in the order of their positions (mlx-lm's ``_temporal_order``)."""
    keys, values = np.array(c.keys), np.array(c.values)
    cap, idx = keys.shape[2], c._idx
    order = (list(range(cap)) if idx == cap else list(range(idx, cap)) + list(range(idx))
             if idx < c.offset else list(range(idx)))
    return keys[:, :, order[-n:]], values[:, :, order[-n:]]


def mlx_logits_of(model: nn.Module, tokens: list[int], cache: list) -> np.ndarray:
    out = model(mx.array([tokens]), cache=cache)[0, -1]
    mx.eval(out)
    return np.array(out)


@pytest.mark.parametrize("spec,reason", [
    ("qwen3_moe", "weights are neither float32 nor in ggml's blocks"),
    ("deepseek_v3", "latent attention layers (deepseek_v3): weights are neither float32 nor in ggml's blocks"),
])
def test_moe_layers_it_does_not_take_keep_mlx_and_say_why(spec: str, reason: str) -> None:
    """The float32 directory runs on the runtime (its experts: test_cpu_decode_moe_f32.py); cast to
    bfloat16 (DeepSeek's beside its latent attention), its non-expert weights are not float32: MLX's
    step, with the reason."""
    loaded = load_model(str(tiny_model(spec)), [])
    assert loaded.decoder is not None
    loaded.model.set_dtype(mx.bfloat16)
    assert (cpu_decode.unsupported(loaded.model) or "").startswith(reason)


def _native(name: str, argtypes: list, restype: object = None) -> Callable:
    fn = getattr(backend.matmul_shim().lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def test_clamped_swiglu_is_mlx_lm_s_over_the_clamp() -> None:
    """gpt-oss's activation (``mlxcel_swiglu_oai``) is mlx-lm's ``swiglu_oai`` within float32
    rounding, on values well past the limit on both sides (the tiny model's rarely reach it):
    a kernel without the clamp, or clamping the gate from below, misses by far more."""
    from mlx_lm.models.activations import swiglu_oai

    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    kernel = _native("mlxcel_swiglu_oai", [p, p, i, f, f])
    rng = np.random.default_rng(3)
    gate = (rng.standard_normal(1003) * 9).astype(np.float32)  # an odd count: the scalar tail too
    up = (rng.standard_normal(1003) * 9).astype(np.float32)
    assert (gate > 7).any() and (gate < -7).any() and (up > 7).any() and (up < -7).any()
    want = np.array(swiglu_oai(mx.array(gate), mx.array(up)))
    ours = gate.copy()
    kernel(ours.ctypes.data, up.ctypes.data, ours.size, 1.702, 7.0)
    assert np.allclose(ours, want, rtol=2e-6, atol=1e-6), np.abs(ours - want).max()


@pytest.mark.parametrize("apart", [False, True])
def test_decode_attention_with_sinks_is_mlx_s(apart: bool) -> None:
    """``mlxcel_decode_attention_sinks``: each query head's sink logit one more term of its
    softmax's denominator, as ``mx.fast.scaled_dot_product_attention(..., sinks=)``; large sinks
    (most of the weight on them) and small ones; on a cache it writes and on one it may not."""
    p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    kernel = _native("mlxcel_decode_attention_sinks", [p, p, p, p, p, p, p, p, i, i, i, i, i, L, f, p, i, i], ctypes.c_int)
    rng = np.random.default_rng(5)
    hk, group, d, pos, cap = 2, 4, 16, 37, 48
    hq, scale = hk * group, d ** -0.5
    q = rng.standard_normal((hq, d)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((hk, d)).astype(np.float32) for _ in range(2))
    keys, values = (rng.standard_normal((hk, cap, d)).astype(np.float32) for _ in range(2))
    sinks = np.array([4.0, -3.0, 0.5, 9.0, 0.0, 2.0, -1.0, 6.0], np.float32)
    k_all, v_all = keys[:, :pos + 1].copy(), values[:, :pos + 1].copy()
    k_all[:, pos], v_all[:, pos] = k_new, v_new
    want = np.array(mx.fast.scaled_dot_product_attention(
        mx.array(q[None, :, None]), mx.array(k_all[None]), mx.array(v_all[None]), scale=scale, sinks=mx.array(sinks)))[0, :, 0]
    out = np.empty((hq, d), np.float32)
    k_out, v_out = np.empty((hk, d), np.float32), np.empty((hk, d), np.float32)
    sinks2 = (sinks * np.float32(cpu_decode.LOG2E)).astype(np.float32)
    status = kernel(q.ctypes.data, k_new.ctypes.data, v_new.ctypes.data, keys.ctypes.data, values.ctypes.data,
                    out.ctypes.data, k_out.ctypes.data if apart else None, v_out.ctypes.data if apart else None,
                    hk, group, d, pos, pos + 1, cap, scale * cpu_decode.LOG2E, sinks2.ctypes.data, 0, 0)
    assert status == 0
    assert np.allclose(out, want, rtol=1e-5, atol=1e-6), np.abs(out - want).max()
    without = np.array(mx.fast.scaled_dot_product_attention(
        mx.array(q[None, :, None]), mx.array(k_all[None]), mx.array(v_all[None]), scale=scale))[0, :, 0]
    assert np.abs(out - without).max() > 0.1  # the sinks took weight
    if apart:  # the cache untouched, the new key and value kept apart
        assert np.array_equal(k_out, k_new) and np.array_equal(v_out, v_new)
        assert not np.array_equal(keys[:, pos], k_new)
    else:
        assert np.array_equal(keys[:, pos], k_new) and np.array_equal(values[:, pos], v_new)
