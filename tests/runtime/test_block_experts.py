"""Stacked experts kept in ggml's blocks (runtime/block_experts.py, ``mlxcel_expert_matmul``).

For every type the CPU serves from its blocks:

- the grouped product of the chosen experts equals, bit for bit, each expert's matrix taken
  alone as a block weight and multiplied by the decode path (``BlockWeight.matmul``, vec_dot);
- a row's result does not depend on which other rows share its group or the call (a token's
  expert outputs are the same whatever else is in the chunk or the batch);
- the layer that replaces mlx-lm's ``SwitchLinear`` gives ``mx.gather_mm``'s shapes for the
  calls ``SwitchGLU`` makes (unsorted, with the leading broadcast, and sorted), and its values
  within the 8-bit-activation bound of float32 math on the dequantized stack, biases included;
- bad expert ids are an error, not a crash.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx_lm.models.switch_layers import SwitchGLU

from mlxcel_compat.runtime import block_experts
from mlxcel_compat.runtime.block_experts import BlockSwitchLinear, ExpertStack, gather_product
from mlxcel_compat.runtime.block_weight import BlockWeight, library, split_rows
from tests.runtime.test_block_weight import TYPES, activation_error, raw_weight, reference

LIB = library()
pytestmark = pytest.mark.skipif(isinstance(LIB, str) or not block_experts.available(),
                                reason=f"no block kernels here: {LIB}")

N_EXPERT, ROWS, K = 6, 40, 512


def stack_of(qtype: T, seed: int = 0) -> tuple[ExpertStack, np.ndarray]:
    raw = raw_weight(qtype, N_EXPERT * ROWS, K, seed=seed)
    return ExpertStack(BlockWeight(raw, qtype, N_EXPERT * ROWS, K, LIB), N_EXPERT), raw


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_grouped_product_is_each_experts_decode_product(qtype: T) -> None:
    stack, raw = stack_of(qtype)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, K)).astype(np.float32)
    chosen = rng.integers(0, N_EXPERT, (7, 3))
    got = gather_product(stack, x[:, None, None, :], chosen)  # SwitchGLU's first call: (7, 3, 1, ROWS)
    assert got.shape == (7, 3, 1, ROWS)
    for t in range(7):
        for j in range(3):
            e = chosen[t, j]
            alone = BlockWeight(np.ascontiguousarray(raw[e * ROWS:(e + 1) * ROWS]), qtype, ROWS, K, LIB)
            np.testing.assert_array_equal(got[t, j, 0], alone.matmul(x[t:t + 1], tiles=False)[0])
    # Each token by itself: the same rows, bit for bit.
    for t in range(7):
        np.testing.assert_array_equal(gather_product(stack, x[t:t + 1, None, None, :], chosen[t:t + 1])[0], got[t])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4, T.IQ4_XS], ids=lambda t: t.name)
def test_values_within_the_activation_bound_of_float32_math(qtype: T) -> None:
    stack, raw = stack_of(qtype, seed=3)
    weights = reference(qtype, raw).reshape(N_EXPERT, ROWS, K)
    np.testing.assert_array_equal(stack.dequantize(), weights)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, K)).astype(np.float32)
    chosen = rng.integers(0, N_EXPERT, (9, 2))
    got = gather_product(stack, x[:, None, None, :], chosen)[:, :, 0]
    want = np.einsum("tk,tjrk->tjr", x, weights[chosen])
    bound = np.einsum("tk,tjrk->tjr", activation_error(qtype, x), np.abs(weights[chosen]))
    assert np.all(np.abs(got - want) <= bound * 1.01 + 1e-3)


@pytest.mark.skipif(isinstance(LIB, str) or int(T.MXFP4) not in LIB.split_kinds, reason="no split MXFP4 kernel here")
def test_split_mxfp4_stack_is_each_experts_split_product() -> None:
    """gpt-oss's MXFP4 stacks as the loader keeps them (rows split: exponents ahead of codes, the
    lane kernel of mxfp4_rows.c): the grouped product equals each expert's matrix split alone
    and multiplied by the decode path, bit for bit, each token alone too; the split stack
    expands to the file's values."""
    raw = raw_weight(T.MXFP4, N_EXPERT * ROWS, K, seed=12)
    weight = BlockWeight(raw.copy(), T.MXFP4, N_EXPERT * ROWS, K, LIB)
    assert split_rows(weight)
    stack = ExpertStack(weight, N_EXPERT)
    np.testing.assert_array_equal(stack.dequantize(), reference(T.MXFP4, raw).reshape(N_EXPERT, ROWS, K))
    rng = np.random.default_rng(13)
    x = rng.standard_normal((7, K)).astype(np.float32)
    chosen = rng.integers(0, N_EXPERT, (7, 4))
    got = gather_product(stack, x[:, None, None, :], chosen)
    for e in range(N_EXPERT):
        alone = BlockWeight(np.ascontiguousarray(raw[e * ROWS:(e + 1) * ROWS]), T.MXFP4, ROWS, K, LIB)
        assert split_rows(alone)
        for t, j in zip(*np.nonzero(chosen == e)):
            np.testing.assert_array_equal(got[t, j, 0], alone.matmul(x[t:t + 1], tiles=False)[0])
    for t in range(7):
        np.testing.assert_array_equal(gather_product(stack, x[t:t + 1, None, None, :], chosen[t:t + 1])[0], got[t])


def test_the_layer_takes_switch_glus_calls_with_biases() -> None:
    """A ``SwitchGLU`` whose three projections are block stacks (with gpt-oss-style biases)
    against the same module over the dequantized stacks: the unsorted path (few tokens) and the
    sorted one (``indices.size >= 64``), shapes equal and values within 8-bit activations."""
    hidden = 128
    stacks = [ExpertStack(BlockWeight(raw_weight(T.Q8_0, N_EXPERT * hidden, K, seed=s), T.Q8_0, N_EXPERT * hidden,
                                      K, LIB), N_EXPERT) for s in (5, 6)]
    down_raw = raw_weight(T.Q8_0, N_EXPERT * K, hidden, seed=7)
    stacks.append(ExpertStack(BlockWeight(down_raw, T.Q8_0, N_EXPERT * K, hidden, LIB), N_EXPERT))
    rng = np.random.default_rng(8)
    float_glu = SwitchGLU(K, hidden, N_EXPERT, bias=True)
    block_glu = SwitchGLU(K, hidden, N_EXPERT, bias=True)
    for name, stack in zip(("gate_proj", "up_proj", "down_proj"), stacks):
        bias = mx.array(rng.standard_normal((N_EXPERT, stack.rows)).astype(np.float32))
        getattr(float_glu, name).weight = mx.array(stack.dequantize())
        getattr(float_glu, name).bias = bias
        block_experts.install(block_glu, name, stack)
        layer = getattr(block_glu, name)
        assert isinstance(layer, BlockSwitchLinear) and "bias" in layer  # the old layer's bias kept
        layer.bias = bias
    for tokens in (3, 40):  # 3 x 2 pairs: unsorted; 40 x 2 = 80 >= 64: sorted
        x = mx.array(rng.standard_normal((1, tokens, K)).astype(np.float32) * 0.01)
        chosen = mx.array(rng.integers(0, N_EXPERT, (1, tokens, 2)).astype(np.int32))
        want, got = float_glu(x, chosen), block_glu(x, chosen)
        assert got.shape == want.shape == (1, tokens, 2, K)
        relative = (mx.sqrt(((got - want) ** 2).sum()) / mx.sqrt((want ** 2).sum())).item()
        assert relative < 0.02, relative


def test_bad_expert_ids_are_an_error() -> None:
    stack, _ = stack_of(T.Q8_0)
    x = np.ones((2, K), np.float32)
    with pytest.raises(ValueError, match="expert ids must be in 0..5"):
        gather_product(stack, x[:, None, None, :], np.array([[0, 6], [1, 2]]))
    with pytest.raises(ValueError, match="do not split into 7 experts"):
        ExpertStack(stack.weight, 7)


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K), (T.Q4_K, T.Q8_0)], ids=lambda t: f"{t[0].name}+{t[1].name}")
def test_gate_and_up_in_one_call_are_each_stacks_product(types: tuple[T, T]) -> None:
    """Two stacks over the same pairs in one call (each token's row quantized once, per
    activation type) equal each stack's call on rows gathered one per pair, bit for bit."""
    stacks = [stack_of(qtype, seed=10 + i)[0] for i, qtype in enumerate(types)]
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, K)).astype(np.float32)
    chosen = rng.integers(0, N_EXPERT, (5, 3)).reshape(-1).astype(np.int32)
    order = np.argsort(chosen, kind="stable")
    experts, counts = np.unique(chosen[order], return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    source = (order // 3).astype(np.int32)
    both = block_experts.grouped_matmuls(stacks, x, experts, starts, source)
    for stack, got in zip(stacks, both):
        np.testing.assert_array_equal(got, stack.grouped_matmul(x[source], experts, starts))
    with pytest.raises(ValueError, match="expert ids"):  # a source row outside x
        block_experts.grouped_matmuls(stacks, x, experts, starts, np.full_like(source, 5))


def test_switch_glu_over_block_stacks_runs_gate_and_up_together() -> None:
    """Installing block gate and up stacks makes the ``SwitchGLU`` a ``BlockSwitchGLU``, whose one
    fused call gives mlx-lm's own ``SwitchGLU`` call over the same layers bit for bit (its MLX sort
    for 64 pairs or more included), and a token's output whatever else shares the chunk."""
    hidden = 256
    glu = SwitchGLU(K, hidden, N_EXPERT)
    for seed, name, (rows, k) in ((20, "gate_proj", (hidden, K)), (21, "up_proj", (hidden, K)),
                                  (22, "down_proj", (K, hidden))):
        raw = raw_weight(T.Q4_K, N_EXPERT * rows, k, seed=seed)
        block_experts.install(glu, name, ExpertStack(BlockWeight(raw, T.Q4_K, N_EXPERT * rows, k, LIB), N_EXPERT))
    assert type(glu) is block_experts.BlockSwitchGLU
    rng = np.random.default_rng(23)
    x = mx.array(rng.standard_normal((1, 40, K)).astype(np.float32))
    chosen = mx.array(rng.integers(0, N_EXPERT, (1, 40, 2)).astype(np.int32))
    got = glu(x, chosen)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(SwitchGLU.__call__(glu, x, chosen)))
    for t in (0, 17, 39):
        np.testing.assert_array_equal(np.asarray(glu(x[:, t:t + 1], chosen[:, t:t + 1]))[0, 0], np.asarray(got)[0, t])
