"""The CPU levers inside the model (runtime/cpu_fusion.py, runtime/attention.py) and what they change.

- Compiled small-input modules: bit-identical to the plain modules; their compile traces are
  bounded (a trace per prompt-chunk length would stay for the life of the process).
- SiLU gating through a power of 2 (in MLX, or in NumPy for prompt chunks): within SWIGLU_RTOL of
  mlx-lm's ``swiglu``.
- Everything together (plus the matmul shim of this process): greedy tokens equal to mlx-lm's own
  reference model, run untouched in a fresh process without any lever, wherever the reference's
  choice was decided (top-2 log-probability gap above MARGIN).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import activations
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.runtime import cpu_fusion
from mlxcel_compat.model.loader import load_model
from tests.conftest import REPO_ROOT, tiny_model
from tests.engine.harness import EngineHarness

SWIGLU_RTOL = 1e-6  # float32 rounding of 2 ** y against exp(y ln 2): a few 1e-7 measured
MARGIN = 1e-3


@pytest.mark.parametrize("rows", [1, 64])  # one row: MLX's compiled loop; 64 rows of 4104: NumPy's
def test_swiglu_agrees_with_mlx_lm(rows: int) -> None:
    special = mx.array([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 200.0, -200.0])
    gate = mx.concatenate([mx.random.normal((rows, 4096)) * 6, mx.broadcast_to(special, (rows, 8))], axis=1)[None]
    x = mx.random.normal(gate.shape)
    assert (gate.size >= cpu_fusion.NUMPY_MIN) == (rows > 1)
    ours, theirs = cpu_fusion.swiglu(gate, x), activations.swiglu(gate, x)
    assert bool(mx.all(mx.isfinite(ours)))
    scale = mx.maximum(mx.abs(theirs), mx.abs(gate * x) * 1e-30 + 1e-30)
    assert (mx.abs(ours - theirs) / scale).max().item() < SWIGLU_RTOL


def test_swiglu_inside_a_compiled_trace_stays_in_mlx() -> None:
    """A compiled MLP traces ``swiglu`` with inputs NumPy would take: no evaluation is possible
    there, so it computes in MLX, to the same values."""
    gate, x = mx.random.normal((1, 64, 4096)), mx.random.normal((1, 64, 4096))
    compiled = mx.compile(cpu_fusion.swiglu)
    assert mx.allclose(compiled(gate, x), cpu_fusion.swiglu(gate, x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 64])  # one row: nn.gelu itself; 64 rows of 1032: NumPy's erf
def test_gelu_agrees_with_the_exact_erf_form(rows: int) -> None:
    special = mx.array([0.0, -0.0, 1e-30, -1e-30, 9.0, -9.0, 80.0, -80.0])
    x = mx.concatenate([mx.random.normal((rows, 1024)) * 4, mx.broadcast_to(special, (rows, 8))], axis=1)[None]
    assert (x.size >= cpu_fusion.NUMPY_MIN) == (rows > 1)
    ours, theirs = cpu_fusion.gelu(x), nn.gelu(x)
    assert bool(mx.all(mx.isfinite(ours)))
    # Abramowitz and Stegun's erf within 6e-7: the GELU within 3e-7 |x| (plus float32 rounding)
    assert (mx.abs(ours - theirs) / (mx.abs(x) + 1e-6)).max().item() < 1e-6
    if rows == 1:  # small inputs are MLX's own GELU
        assert mx.array_equal(ours, theirs)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_compiled_modules_are_bit_identical(family: str) -> None:
    loaded = load_model(str(tiny_model(family)), [])
    model = loaded.model
    assert any(type(m).__name__.startswith("Fused") for _, m in model.named_modules())
    prompt = mx.array([[5, 17, 300, 41, 9, 77, 123, 8]])

    def decode(enabled: bool) -> list[mx.array]:
        saved = cpu_fusion.SMALL_ELEMENTS, cpu_fusion.SHARED_ROPE_ANGLES
        cpu_fusion.SMALL_ELEMENTS = saved[0] if enabled else -1
        cpu_fusion.SHARED_ROPE_ANGLES = enabled  # off: every RoPE call is mx.fast.rope's own
        try:
            cache = make_prompt_cache(model)
            outs = [model(prompt, cache=cache), model(prompt[:, :3], cache=cache)]  # chunks: shapeless
            for token in (3, 99, 1000):  # decode-sized: the compiled modules
                outs.append(model(mx.array([[token]]), cache=cache))
            mx.eval(outs)
            return outs
        finally:
            cpu_fusion.SMALL_ELEMENTS, cpu_fusion.SHARED_ROPE_ANGLES = saved

    for fused, plain in zip(decode(True), decode(False)):
        assert mx.array_equal(fused, plain)


def test_compile_traces_are_bounded() -> None:
    """Prompt chunks use shapeless compiles (norms, MLPs; RoPE's one shared rotation); decode
    steps one per shape."""
    model = load_model(str(tiny_model("llama")), []).model
    fused = [m for _, m in model.named_modules() if type(m).__name__.startswith("Fused")]
    ropes = [m for m in fused if isinstance(m, nn.RoPE)]
    assert ropes and len(ropes) < len(fused)
    made = lambda slot: [m for m in fused if slot in m.__dict__]  # noqa: E731 - made on first compiled call
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 17, 300, 41, 9]]), cache=cache))
    mx.eval(model(mx.array([[5, 17, 300, 41, 9, 1, 2]] * 3), cache=make_prompt_cache(model)))
    assert made("_mlxcel_fused") == []
    assert made("_mlxcel_fused_shapeless") == [m for m in fused if m not in ropes]
    mx.eval(model(mx.array([[3]]), cache=cache))
    # One sequence's cache has an integer offset: RoPE shares the step's angles (no trace per module).
    assert made("_mlxcel_fused") == [m for m in fused if m not in ropes]
    x = mx.random.normal((2, 4, 1, ropes[0].dims))
    offsets = mx.array([7, 30])  # a batch's cache: one offset per row, an array
    assert mx.array_equal(ropes[0](x, offset=offsets), super(type(ropes[0]), ropes[0]).__call__(x, offset=offsets))
    assert "_mlxcel_fused" in ropes[0].__dict__
    # A per-head norm of a one-KV-head model sees (B, 1, L, Dh) for every chunk length L.
    norm = next(m for m in fused if m not in ropes)
    for length in range(1, 2 * cpu_fusion.MAX_SPECIALIZED_SHAPES):
        x = mx.random.normal((1, 1, length, norm.weight.shape[0]))
        assert mx.array_equal(norm(x), super(type(norm), norm).__call__(x))
    assert len(norm.__dict__["_mlxcel_shapes"]) == cpu_fusion.MAX_SPECIALIZED_SHAPES
    assert cpu_fusion.rope_compiles(mx.zeros((4, 12, 1, 64))) and not cpu_fusion.rope_compiles(mx.zeros((1, 12, 2, 64)))
    assert not cpu_fusion.rope_compiles(mx.zeros((64, 12, 1, 64)))  # above SMALL_ELEMENTS


@pytest.mark.parametrize("dims,base,scale", [(64, 500000.0, 1.0), (16, 10000.0, 1.0), (128, 1000000.0, 0.25)])
def test_decode_rope_with_shared_angles_is_bit_identical(dims: int, base: float, scale: float) -> None:
    """A decode step's RoPE takes its angles from one mx.fast.rope call per position and rotates
    every layer's queries and keys with them: bit-identical to mx.fast.rope, angles computed once."""
    rope = nn.RoPE(dims, traditional=False, base=base, scale=scale)
    cpu_fusion.fuse(rope, cpu_fusion.fused_rope_call)
    for offset in (0, 1, 777, 31999):
        for heads in (12, 4):
            x = mx.random.normal((1, heads, 1, dims)) * 3
            assert mx.array_equal(rope(x, offset=offset), mx.fast.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset))
        first = cpu_fusion.shared_angles(rope, offset)
        assert all(a is b for a, b in zip(first, cpu_fusion.shared_angles(rope, offset)))  # once per position


@pytest.mark.parametrize("dims,base,scale", [(64, 500000.0, 1.0), (16, 10000.0, 1.0), (128, 1000000.0, 0.25)])
def test_prompt_chunk_rope_with_shared_angles_is_bit_identical(dims: int, base: float, scale: float) -> None:
    """A prompt chunk's RoPE takes the angles of its positions from one mx.fast.rope call, shared
    by queries and keys of every layer, and rotates in one shapeless trace: bit-identical to
    mx.fast.rope for every chunk length and offset."""
    rope = nn.RoPE(dims, traditional=False, base=base, scale=scale)
    cpu_fusion.fuse(rope, cpu_fusion.fused_rope_call)
    for length, offset in ((2, 0), (7, 900), (100, 37), (512, 512), (1000, 31000)):
        for heads in (12, 4):
            x = mx.random.normal((1, heads, length, dims)) * 3
            assert mx.array_equal(rope(x, offset=offset), mx.fast.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset))
        first = cpu_fusion.shared_angles(rope, offset, length)
        assert first[0].shape == (1, 1, length, dims // 2)
        assert all(a is b for a, b in zip(first, cpu_fusion.shared_angles(rope, offset, length)))  # once per chunk


def test_install_is_idempotent() -> None:
    loaded = load_model(str(tiny_model("llama")), [])
    assert cpu_fusion.install(loaded.model) == {"swiglu": 0, "norm": 0, "rope": 0, "mlp": 0}


REFERENCE = r"""
import json, os, sys
os.environ["MLXCEL_BLAS_SHIM"] = "0"
from mlxcel_compat.runtime.backend import load_optimized_blas
load_optimized_blas()  # OpenBLAS as in the server, but MLX calls its sgemm directly
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load
model, _ = load(sys.argv[1])  # mlx-lm's own model: its attention, activations and modules
model.set_dtype(mx.float32)
out = []
for prompt in json.loads(sys.argv[2]):
    tokens, margins = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=int(sys.argv[3]), prefill_step_size=16):
        top = sorted(logprobs.tolist(), reverse=True)[:2]
        tokens.append(int(token))
        margins.append(top[0] - top[1])
    out.append({"tokens": tokens, "margins": margins})
print(json.dumps(out))
"""


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_tokens_agree_with_mlx_lm_reference(family: str) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(8000) for _ in range(n)] for n in (9, 40, 150)]
    n_tokens = 16
    ref = subprocess.run([sys.executable, "-c", REFERENCE, str(tiny_model(family)), json.dumps(prompts), str(n_tokens)],
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                         env={**os.environ})
    assert ref.returncode == 0, ref.stderr
    reference = json.loads(ref.stdout.strip().splitlines()[-1])
    harness = EngineHarness(tiny_model(family), batch_size=16, enabled=False)
    try:
        exact = 0
        for prompt, theirs in zip(prompts, reference):
            ours = harness.run(prompt, n_predict=n_tokens, ignore_eos=True, cache=False).tokens
            assert len(ours) == n_tokens
            for pos, (a, b) in enumerate(zip(ours, theirs["tokens"])):
                if a != b:
                    assert theirs["margins"][pos] < MARGIN, f"position {pos} differs although decided"
                    break
            exact += ours == theirs["tokens"]
        assert exact >= 2, "almost every prompt should match the reference token for token"
    finally:
        harness.close()
