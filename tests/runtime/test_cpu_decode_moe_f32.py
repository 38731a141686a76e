"""The CPU decode runtime on float expert stacks (a model directory's mlx-lm ``SwitchLinear``
weights: ``decode_moe.stack_kind`` "float", ``native/expert_f32.c``'s grouped product).

- Every MoE family's factory directory runs on the runtime (Gemma 4's MoE in its own pass; the
  routing, gating, shared experts, biases and clamped SwiGLU the block stacks' own code) and
  follows MLX's step for 40 greedy steps: each step's logits within LOGITS_RTOL of the largest,
  the same token, the cache (KV and recurrent state) as MLX's step leaves it.
- Rows stepped together (pairs grouped by expert across the rows) are bit-identical to each row
  stepped alone.
- A cold prompt chunk on the runtime leaves the KV and state MLX's prefill leaves.
- The grouped product alone is NumPy's per-expert product, and refuses an expert id outside the stack.
- Stacks in bfloat16 or float16 are widened to float32 once at load and follow MLX's step.
- What is still refused says why: a directory cast to bfloat16 (its other weights are not
  float32), experts MLX quantized (``QuantizedSwitchLinear``).
"""

from __future__ import annotations

import copy
import ctypes
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_gemma4, decode_kv, decode_moe
from tests.conftest import SLOW, slow_but, tiny_model
from tests.runtime.step_checks import assert_rows_together_equal_rows_alone, follow_mlx, ids, mlx_logits, prefilled

LOGITS_RTOL = 1e-4  # of the largest logit, as test_cpu_decode.py: measured 4e-7 to 7e-6 (summation order)

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")

# Each MoE family's directory; by default the two whose expert paths differ most (softmax then top k
# with a gated shared expert; gpt-oss's top k then softmax with expert biases, clamped SwiGLU and
# sliding rings), the rest --slow (scripts/test.sh --slow): ~4 s each on a busy 2-core machine.
FAMILIES = slow_but(["qwen2_moe", "gpt_oss", "glm4_moe", "qwen3_next", "qwen3_moe", "olmoe", "granitemoe",
                     "ernie4_5_moe", "lfm2_moe", "deepseek_v2", "deepseek_v3", "qwen3_5_moe", "granitemoehybrid",
                     "gemma4_text_moe"],
                    ["qwen2_moe", "gpt_oss"])


@pytest.fixture(scope="module")
def directory() -> Callable[[str], tuple[nn.Module, cpu_decode.CpuDecoder]]:
    """A family's tiny directory and its decoder, loaded once for the module."""
    loaded: dict[str, tuple[nn.Module, cpu_decode.CpuDecoder]] = {}

    def get(family: str) -> tuple[nn.Module, cpu_decode.CpuDecoder]:
        if family not in loaded:
            model = load_model(str(tiny_model(family)), [])
            assert model.decoder is not None, cpu_decode.unsupported(model.model)
            if isinstance(model.decoder, decode_gemma4.Gemma4Decoder):  # its own pass: gate and up fused
                experts = [layer.experts for layer in model.decoder.layers if layer.experts is not None]
                assert experts and all(e.gate_up is None and e.float_gate_up.dtype == np.float32 for e in experts)
            else:
                moe = [layer.moe for layer in model.decoder.layers if layer.moe is not None]
                assert moe and all(m.gate is None and m.float_gate is not None and m.float_gate.dtype == np.float32
                                   for m in moe)
            loaded[family] = model.model, model.decoder
        return loaded[family]

    return get


def assert_same_state(ours: list, theirs: list, rtol: float) -> None:
    """Every layer's cache (keys and values, or a recurrent layer's state) as MLX's leaves it,
    within ``rtol`` of the largest value."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert type(a) is type(b) and getattr(a, "offset", None) == getattr(b, "offset", None), i
        if isinstance(b, RotatingKVCache):  # a sliding layer's ring: the same slots
            assert a._idx == b._idx, i
            pairs = [(a.keys, b.keys), (a.values, b.values)]
        elif hasattr(b, "keys"):  # a growing cache: the first offset positions (the buffers may differ)
            pairs = [(a.keys[..., :a.offset, :], b.keys[..., :b.offset, :]),
                     (a.values[..., :a.offset, :], b.values[..., :b.offset, :])]
        else:  # a recurrent layer's state (conv, delta-net, Mamba-2)
            assert len(a.cache) == len(b.cache), i
            pairs = list(zip(a.cache, b.cache))
        for x, y in pairs:
            if y is None:
                assert x is None, i
                continue
            x, y = np.array(x), np.array(y)
            assert x.shape == y.shape, (i, x.shape, y.shape)
            assert np.abs(x - y).max() <= rtol * max(np.abs(y).max(), 1e-30), i


@pytest.mark.parametrize("family", FAMILIES)
def test_directory_follows_mlx_step_for_step(directory: Callable, family: str) -> None:
    """40 greedy steps from a 30-token prompt: logits within LOGITS_RTOL of MLX's step on its own
    copy of the cache, the same token, the cache as MLX's step leaves it."""
    model, decoder = directory(family)
    ours = prefilled(model, 30)
    theirs, _ = follow_mlx(model, decoder, ours, 40, LOGITS_RTOL)
    assert_same_state(ours, theirs, LOGITS_RTOL)


@pytest.mark.parametrize("family", slow_but(["qwen2_moe", "gpt_oss", "qwen3_next"], ["qwen2_moe"]))
def test_rows_stepped_together_are_bit_identical_to_rows_alone(directory: Callable, family: str) -> None:
    """Three sequences at different positions stepped together for 6 steps (their pairs grouped by
    expert across the rows) give exactly each row's logits stepped alone."""
    model, decoder = directory(family)
    together = [prefilled(model, n, seed=n) for n in (5, 20, 33)]
    assert_rows_together_equal_rows_alone(decoder, together, 6)


@pytest.mark.parametrize("family", slow_but(["qwen2_moe", "glm4_moe", "qwen3_next"], ["qwen2_moe"]))
def test_a_cold_prompt_chunk_leaves_mlx_s_cache(directory: Callable, family: str) -> None:
    """``prefill(..., logits=False)`` on an empty cache (each expert's rows one float32 GEMM over
    the pairs that chose it) leaves the KV and state MLX's prefill leaves, and the next step's
    logits are MLX's."""
    model, decoder = directory(family)
    prompt = ids(70, seed=31)
    theirs = make_prompt_cache(model)
    model(mx.array([prompt]), cache=theirs)
    mx.eval([c.state for c in theirs])
    ours, owned = make_prompt_cache(model), decode_kv.OwnedCache()
    assert decoder.can_prefill(ours, owned)
    assert decoder.prefill(prompt, ours, owned, logits=False) is None
    assert_same_state(ours, theirs, LOGITS_RTOL)
    got, want = decoder.step(5, ours, owned).copy(), mlx_logits(model, 5, copy.deepcopy(theirs))
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()


def test_the_grouped_float32_product_is_each_expert_s_product() -> None:
    """``mlxcel_expert_matmul_f32`` on pairs grouped by expert (gathered through ``source``, and
    read in place without it) is NumPy's product of each pair's row with its expert's matrix; an
    expert id outside the stack is refused (-1), nothing written."""
    p, i, l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    fn = backend.matmul_shim().lib.mlxcel_expert_matmul_f32
    fn.argtypes, fn.restype = [i, p, i, i, i, i, p, p, p, p, l, p, l], i
    rng = np.random.default_rng(5)
    n_expert, rows, k, n_x = 6, 24, 40, 7
    stacks = [rng.standard_normal((n_expert, rows, k)).astype(np.float32) for _ in range(2)]
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    experts = np.array([1, 4, 5], np.int32)
    start = np.array([0, 3, 4, 9], np.int32)  # 9 pairs: 3, 1 and 5 rows (small-M kernel and its tail)
    source = np.array([0, 2, 6, 3, 1, 2, 3, 4, 5], np.int32)
    ws = (p * 2)(*(s.ctypes.data for s in stacks))
    for src in (source, None):
        pairs = x[source]  # each pair's row
        xs = x if src is not None else pairs
        outs = [np.full((9, rows), np.nan, np.float32) for _ in stacks]
        cs = (p * 2)(*(o.ctypes.data for o in outs))
        assert fn(2, ws, n_expert, rows, k, 3, experts.ctypes.data, start.ctypes.data,
                  None if src is None else src.ctypes.data, np.ascontiguousarray(xs).ctypes.data, k, cs, rows) == 0
        for stack, out in zip(stacks, outs):
            want = np.concatenate([pairs[start[g]:start[g + 1]] @ stack[e].T for g, e in enumerate(experts)])
            assert np.allclose(out, want, rtol=1e-5, atol=1e-5)
    bad = np.array([1, 6, 5], np.int32)
    out = np.full((9, rows), np.nan, np.float32)
    cs = (p * 1)(out.ctypes.data)
    assert fn(1, ws, n_expert, rows, k, 3, bad.ctypes.data, start.ctypes.data, source.ctypes.data, x.ctypes.data,
              k, cs, rows) == -1
    assert np.isnan(out).all()


def test_what_is_still_refused_keeps_mlx_and_says_why() -> None:
    """A directory cast to bfloat16: its experts would be widened, but its attention and router
    are not float32; experts MLX quantized (``QuantizedSwitchLinear``) are neither float nor
    ggml's blocks."""
    loaded = load_model(str(tiny_model("qwen2_moe")), [])
    model = loaded.model
    mlp = model.model.layers[0].mlp
    assert decode_moe.stack_kind(mlp.switch_mlp) == "float" and decode_moe.unsupported(mlp) is None
    model.set_dtype(mx.bfloat16)
    assert decode_moe.stack_kind(mlp.switch_mlp) == "float" and decode_moe.unsupported(mlp) is None
    assert cpu_decode.unsupported(model) == "weights are neither float32 nor in ggml's blocks"
    switch = mlp.switch_mlp
    switch.gate_proj = switch.gate_proj.to_quantized(group_size=32, bits=8)
    assert decode_moe.stack_kind(switch) is None
    assert decode_moe.unsupported(mlp).startswith(
        "experts neither in ggml's blocks (the GGUF loader's stacks) nor float")


@pytest.mark.parametrize("dtype", [mx.bfloat16, pytest.param(mx.float16, marks=SLOW)])
def test_16_bit_expert_stacks_are_widened_once_and_follow_mlx(dtype: mx.Dtype) -> None:
    """Experts held in bfloat16 or float16 (the rest float32): the runtime widens each stack to a
    float32 array of its own at load, as MLX's ``gather_mm`` promotes them on every call, and
    follows MLX's step for 10 greedy steps within LOGITS_RTOL."""
    model = load_model(str(tiny_model("qwen2_moe")), []).model
    for layer in model.model.layers:
        layer.mlp.switch_mlp.set_dtype(dtype)
    decoder = cpu_decode.build(model, backend.matmul_shim())
    assert isinstance(decoder, cpu_decode.CpuDecoder), decoder
    moe, switch = decoder.layers[0].moe, model.model.layers[0].mlp.switch_mlp
    assert moe.float_gate.dtype == np.float32 and moe.float_gate.shape == switch.gate_proj.weight.shape
    assert np.array_equal(moe.float_down, np.array(switch.down_proj.weight.astype(mx.float32)))
    ours = prefilled(model, 30)
    theirs, owned, token = copy.deepcopy(ours), decode_kv.OwnedCache(), 11
    for step in range(10):
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, token, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max(), step
        assert int(got.argmax()) == int(want.argmax()), step
        token = int(want.argmax())
