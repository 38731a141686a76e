"""The CPU decode runtime on DeepSeek V2/V3's multi-head latent attention (runtime/decode_mla.py,
native/mla_attention.c) and grouped expert selection (``n_group``: decode_moe.py, moe_layer.c).

- Float32 MLA (the factory's deepseek_v3 and deepseek_v2 configurations, dense: the runtime takes
  experts only in ggml's blocks) follows MLX's step for 40 steps within 1e-4 of the largest logit,
  greedy tokens equal, the cache in mlx-lm's own form (v3: latent + rotary key; v2: per-head keys
  and values) as MLX leaves it.
- The factory's quantized GGUFs (q8_0: attention, experts, shared experts in ggml's blocks; v3's
  sigmoid router with its selection bias over 4 groups of which 2 are kept, v2's softmax router
  times routed_scaling_factor): teacher-forced steps within BLOCK_RTOL of MLX's, most of them
  bit-identical; rows together = rows alone; prompt chunks (long and short, cold and on a
  prompt-cache hit's shared arrays) leave MLX's cache.
- glm4_moe and deepseek_v2 with grouped selection (n_group > 1, set on the loaded model as the
  config would) on the runtime equal MLX's, and the groups change MLX's logits (the test can fail).
- The engine on a deepseek2 GGUF uses the runtime; a prompt-cache hit gives the cold run's tokens.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.model.load_options import LoadOptions
from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from mlxcel_compat.runtime.kv_precision import KvTypes
from tests.conftest import slow_but, tiny_model
from tests.engine.harness import EngineHarness
from tests.runtime.step_checks import (assert_rows_together_equal_rows_alone, follow_mlx_teacher_forced, ids, mlx_logits,
                                       prefilled)

# As the MoE tests': both steps quantize activations to the blocks' vec_dot_type, so a ~1e-7
# difference elsewhere (here: the attention's sums, absorbed against MLX's) can move one
# activation by a quantum.
BLOCK_RTOL = 0.06
# The factory's quantized GGUFs: deepseek_v3's by default, deepseek_v2's with --slow (the suite's budget).
SPECS = ["deepseek_v3:q8_0", "deepseek_v2:q8_0"]

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


def close(got: np.ndarray, want: np.ndarray, rtol: float = BLOCK_RTOL) -> bool:
    return bool(np.abs(got - want).max() <= rtol * np.abs(want).max())


def dense_mla(family: str) -> nn.Module:
    """The factory's tiny ``family`` configuration without routed experts (every layer MLA and a
    dense MLP), random float32 weights from a fixed seed."""
    from mlx_lm.utils import _get_classes

    config = json.loads((tiny_model(family) / "config.json").read_text())
    config["n_routed_experts"] = None
    model_class, args_class = _get_classes(config)
    mx.random.seed(3)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def gguf_decoder() -> Callable[[str], tuple[nn.Module, cpu_decode.CpuDecoder]]:
    loaded: dict[str, tuple[nn.Module, cpu_decode.CpuDecoder]] = {}

    def get(spec: str) -> tuple[nn.Module, cpu_decode.CpuDecoder]:
        if spec not in loaded:
            model = load_model(str(tiny_model(spec)), [])
            assert isinstance(model.decoder, cpu_decode.CpuDecoder), cpu_decode.unsupported(model.model)
            loaded[spec] = model.model, model.decoder
        return loaded[spec]

    return get


def assert_cache_equal(ours: list[Any], theirs: list[Any], n: int, rtol: float) -> None:
    for a, b in zip(ours, theirs):
        assert a.offset == b.offset == n
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert x.shape[:2] == y.shape[:2] and x.shape[3] == y.shape[3]
            x, y = (np.array(z[..., :n, :].astype(mx.float32)) for z in (x, y))  # bfloat16: NumPy has none
            err = np.abs(x - y).max() / np.abs(y).max()
            assert err <= rtol, err


@pytest.mark.parametrize("family", slow_but(["deepseek_v3", "deepseek_v2"], ["deepseek_v3"]))
def test_float32_mla_follows_mlx_step_for_40_steps(family: str) -> None:
    model = dense_mla(family)
    decoder = cpu_decode.build(model, backend.matmul_shim())
    assert isinstance(decoder, cpu_decode.CpuDecoder), decoder
    assert all(layer.mla is not None and layer.q is None for layer in decoder.layers)
    v3 = family == "deepseek_v3"
    # the cache's rows: v3 one latent (64) and one rotary key (16); v2 4 heads of keys (32 + 16) and values (32)
    assert (decoder.n_kv_heads, decoder.kv.widths) == ((1, (64, 16)) if v3 else (4, (48, 32)))
    ours = prefilled(model, 24)
    theirs = copy.deepcopy(ours)
    owned = decode_kv.OwnedCache()
    token, worst = 11, 0.0
    for step in range(40):
        assert decoder.can_run(ours, owned)
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, token, theirs)
        err = np.abs(got - want).max() / np.abs(want).max()
        worst = max(worst, err)
        assert err <= 1e-4, (step, err)
        assert int(got.argmax()) == int(want.argmax()), step
        token = int(want.argmax())
    assert decoder.steps == 40
    assert_cache_equal(ours, theirs, 64, 1e-5)
    print(f"{family}: worst {worst:.2e} of the largest logit")


@pytest.mark.parametrize("spec", slow_but(SPECS, SPECS[:1]))
def test_quantized_mla_follows_mlx_teacher_forced(gguf_decoder: Callable, spec: str) -> None:
    """8 teacher-forced steps from each of two prompts (the first step on MLX's prefilled arrays
    read in place, its rows kept apart; the next ones on the sequence's own copy): within
    BLOCK_RTOL of MLX's, the same greedy token where decided, the cache as MLX's; most steps
    bit-identical (the same ggml products on activations that agree to float32 rounding)."""
    model, decoder = gguf_decoder(spec)
    v3 = spec.startswith("deepseek_v3")
    layers = decoder.layers
    assert layers[0].moe is None and layers[0].gate is not None  # first_k_dense_replace = 1
    for layer in layers[1:]:
        moe = layer.moe
        assert layer.mla is not None and moe is not None and moe.shared_gate is not None and moe.shared_scale is None
        assert (moe.gating, moe.norm_topk, moe.n_group, moe.topk_group) == (
            ("sigmoid_bias", True, 4, 2) if v3 else ("softmax", False, 1, 1))
        assert moe.routed_scale == (2.5 if v3 else 2.0)
        assert (layer.mla.embed_q is not None) == v3 and (layer.mla.kv_b is None) == v3
        assert layer.mla.q_a is not None and layer.mla.q_a.block is not None  # the query LoRA, in blocks
    exact = total = 0
    for n, seed in [(40, 0), (150, 1)]:
        ours = prefilled(model, n, seed)
        theirs, same, _ = follow_mlx_teacher_forced(model, decoder, ours, 8, BLOCK_RTOL)
        exact, total = exact + same, total + 8
        assert_cache_equal(ours, theirs, n + 8, BLOCK_RTOL)
    print(f"{spec}: {exact} of {total} steps bit-identical to MLX's")
    assert exact >= total // 2


@pytest.mark.parametrize("spec", slow_but(SPECS, SPECS[:1]))
def test_mla_rows_stepped_together_are_bit_identical_to_rows_alone(gguf_decoder: Callable, spec: str) -> None:
    model, decoder = gguf_decoder(spec)
    together = [prefilled(model, n, seed) for n, seed in ((20, 0), (70, 1), (130, 2))]
    assert_rows_together_equal_rows_alone(decoder, together, 5)
    assert [c[0].offset for c in together] == [25, 75, 135]


@pytest.mark.parametrize("spec", slow_but(SPECS, SPECS[:1]))
@pytest.mark.parametrize("rows", [70, 9])
def test_an_mla_prompt_chunk_leaves_mlx_s_cache(gguf_decoder: Callable, spec: str, rows: int) -> None:
    """A cold prompt fed by ``prefill`` (70 rows: the prompt products; 9: the decode rows'
    kernels) leaves the cache MLX's chunk leaves, and the next step agrees with MLX's; then a
    further chunk on MLX's arrays read in place (a prompt-cache hit's: its rows kept apart)
    leaves MLX's cache too."""
    model, decoder = gguf_decoder(spec)
    prompt = ids(rows, seed=31)
    theirs = make_prompt_cache(model)
    model(mx.array([prompt]), cache=theirs)
    mx.eval([c.state for c in theirs])
    ours, owned = make_prompt_cache(model), decode_kv.OwnedCache()
    assert decoder.can_prefill(ours, owned)
    prefilled_before = decoder.prefilled
    assert decoder.prefill(prompt, ours, owned, logits=False) is None
    assert decoder.prefilled == prefilled_before + rows
    assert_cache_equal(ours, theirs, rows, BLOCK_RTOL)
    hit, hit_theirs = copy.deepcopy(theirs), copy.deepcopy(theirs)  # MLX's arrays, not the decoder's
    got, want = decoder.step(5, ours, owned).copy(), mlx_logits(model, 5, theirs)
    assert close(got, want)
    rest = ids(12, seed=5)
    hit_owned = decode_kv.OwnedCache()
    assert decoder.can_prefill(hit, hit_owned)
    got = decoder.prefill(rest, hit, hit_owned).copy()
    want = np.array(model(mx.array([rest]), cache=hit_theirs)[0, -1])
    assert close(got, want)
    assert_cache_equal(hit, hit_theirs, rows + 12, BLOCK_RTOL)


def test_mla_draft_rows_and_chunks_together_equal_them_one_by_one(gguf_decoder: Callable) -> None:
    """A speculative draft's rows on one cache (``step_tokens``: each row writes its latent before
    the next attends) are bit-identical to single steps; two sequences' prompt chunks in one
    ``prefill_rows`` pass leave the caches each leaves alone."""
    model, decoder = gguf_decoder("deepseek_v3:q8_0")
    drafted, stepped = prefilled(model, 30), prefilled(model, 30)
    o_drafted, o_stepped = decode_kv.OwnedCache(), decode_kv.OwnedCache()
    decoder.step(9, drafted, o_drafted), decoder.step(9, stepped, o_stepped)  # both on their own copies
    assert decoder.can_step_tokens(drafted, o_drafted)
    rows = decoder.step_tokens([11, 12, 13, 14], drafted, o_drafted)
    for token, row in zip([11, 12, 13, 14], rows):
        assert np.array_equal(row, decoder.step(token, stepped, o_stepped))
    chunks = [ids(40, seed=2), ids(25, seed=3)]
    together = [make_prompt_cache(model) for _ in chunks]
    alone = [make_prompt_cache(model) for _ in chunks]
    decoder.prefill_rows(chunks, together, [decode_kv.OwnedCache() for _ in chunks])
    for chunk, cache in zip(chunks, alone):
        decoder.prefill(chunk, cache, decode_kv.OwnedCache(), logits=False)
    for a, b, chunk in zip(together, alone, chunks):
        assert_cache_equal(a, b, len(chunk), 0.0)


@pytest.mark.parametrize("kind", ["f16", pytest.param("bf16", marks=pytest.mark.slow)])
def test_mla_over_16_bit_kv_follows_mlx(kind: str) -> None:
    """-ctk/-ctv f16 and bf16: the latent and rotary rows stored in the type (rounded as MLX
    rounds them), widened for the attention; teacher-forced steps within BLOCK_RTOL of MLX's over
    its own 16-bit cache, then a prompt chunk on a 16-bit cache."""
    loaded = load_model(str(tiny_model("deepseek_v3:q8_0")), [], options=LoadOptions(kv_types=KvTypes(kind, kind)))
    model, decoder = loaded.model, loaded.decoder
    assert isinstance(decoder, cpu_decode.CpuDecoder), cpu_decode.unsupported(model)
    dtype = {"f16": mx.float16, "bf16": mx.bfloat16}[kind]
    ours, theirs = prefilled(model, 50), prefilled(model, 50)  # a 16-bit cache's copy: its own prefill
    owned, token = decode_kv.OwnedCache(), 11
    for step in range(8):
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, token, theirs)
        assert close(got, want), step
        token = int(want.argmax())
    assert all(c.keys.dtype == c.values.dtype == dtype for c in ours)
    assert_cache_equal(ours, theirs, 58, BLOCK_RTOL)
    rest = ids(20, seed=9)
    got = decoder.prefill(rest, ours, owned).copy()
    assert close(got, np.array(model(mx.array([rest]), cache=theirs)[0, -1]))
    assert_cache_equal(ours, theirs, 78, BLOCK_RTOL)


def set_groups(model: nn.Module, n_group: int, method: str) -> None:
    """Every router of ``model``: ``n_group`` expert groups of which the best 2 are searched (1: none),
    by ``method`` (mlx-lm's ``topk_method``)."""
    for layer in model.model.layers:
        if hasattr(layer.mlp, "switch_mlp"):
            gate = layer.mlp.gate
            gate.n_group, gate.topk_group = n_group, min(2, n_group)
            if hasattr(gate, "topk_method"):
                gate.topk_method = method if n_group > 1 or method == "noaux_tc" else "greedy"


@pytest.mark.parametrize("spec,method", [("glm4_moe:q8_0", "noaux_tc"),
                                         pytest.param("deepseek_v2:q8_0", "group_limited_greedy", marks=pytest.mark.slow)])
def test_grouped_expert_selection_on_the_runtime_equals_mlx(spec: str, method: str) -> None:
    """Routers with 4 expert groups of which the best 2 are searched (glm4_moe and deepseek_v3:
    groups ranked by their two best biased scores; deepseek_v2's group_limited_greedy: by their
    best softmax score): the runtime's steps agree with MLX's as the ungrouped ones do, and
    grouping changes MLX's logits (so the comparison sees it)."""
    model = load_model(str(tiny_model(spec)), []).model
    set_groups(model, 4, method)
    decoder = cpu_decode.build(model, backend.matmul_shim())
    assert isinstance(decoder, cpu_decode.CpuDecoder), decoder
    moes = [layer.moe for layer in decoder.layers if layer.moe is not None]
    assert moes and all((m.n_group, m.topk_group, m.group_by_max) == (4, 2, method == "group_limited_greedy")
                        for m in moes)
    ours = prefilled(model, 60, 4)
    theirs, owned = copy.deepcopy(ours), decode_kv.OwnedCache()
    plain_cache = copy.deepcopy(theirs)
    tokens, wants, exact = [11], [], 0
    for step in range(6):
        got = decoder.step(tokens[-1], ours, owned).copy()
        wants.append(mlx_logits(model, tokens[-1], theirs))
        assert close(got, wants[-1]), (step, np.abs(got - wants[-1]).max() / np.abs(wants[-1]).max())
        exact += bool(np.array_equal(got, wants[-1]))
        tokens.append(int(wants[-1].argmax()))
    set_groups(model, 1, method)  # MLX's steps on the same tokens without groups
    moved = sum(not np.allclose(mlx_logits(model, token, plain_cache), want, rtol=0, atol=1e-3 * np.abs(want).max())
                for token, want in zip(tokens, wants))
    assert exact >= 3 and moved >= 2, (exact, moved)


def test_engine_on_a_deepseek2_gguf_uses_the_runtime_and_a_hit_equals_the_cold_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deepseek_v3's q8_0 GGUF through the engine: the runtime runs its steps and prompt chunks;
    a prompt-cache hit (the cached latent rows read in place) gives the cold run's tokens, and
    MLX's step gives them too."""
    prompt = [(11 * i + 7) % 900 + 20 for i in range(150)]
    runs = {}
    for on in (True, False):
        monkeypatch.setenv("MLXCEL_CPU_DECODE", "1" if on else "0")
        h = EngineHarness(tiny_model("deepseek_v3:q8_0"))
        try:
            decoder = h.engine.loaded.decoder
            assert (decoder is not None) == on
            cold = h.run(prompt, n_predict=24, ignore_eos=True)
            hit = h.run(prompt, n_predict=24, ignore_eos=True)
            assert hit.finish.n_cached == len(prompt) - 1
            assert hit.tokens == cold.tokens
            if on:  # the cold run: 144 prompt rows in chunks, the last 6 as the rows of one step; the
                # hit (its latent rows in shared prompt-cache blocks, read in place) one step; then 23
                # fed back each
                assert (decoder.prefilled, decoder.steps) == (144, (6 + 23) + (1 + 23))
            runs[on] = cold.tokens
        finally:
            h.close()
    assert len(runs[True]) == 24 and runs[True] == runs[False]
