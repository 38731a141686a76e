"""MLX affine-quantized directories on the CPU, repacked into ggml blocks (runtime/mlx_affine.py).

Tensors: every bit width MLX has (2, 3, 4 -> Q4_1; 5, 6, 8 -> Q8_0 + group biases) at group
sizes 32, 64 and 128, with bfloat16 and float16 scales:

- the repacked rows expand bit for bit to ``mx.dequantize`` of the original weight (with its
  scales and biases in float32, the values MLX's own layer multiplies by on the CPU), read both
  by ggml's kernels and by gguf-py's independent Q4_1 / Q8_0 reader;
- products by float32 tiles equal float32 math to rounding; products by ggml's vec_dot stay
  within the bound of quantizing the activations to 8 bits (tests/runtime/test_block_weight.py);
- what has no exact block form (another mode, scales that are not float16 values, a group
  size that is not whole blocks) is refused with the reason, and a group bias that rounds in
  float32 is flagged.

Models, mlx-lm quantized directories written by the factory (mlx_lm.convert's own path):

- prompt logits of the served model equal MLX's own quantized model of the same directory to
  float32 rounding (prompt chunks multiply expanded tiles: PROMPT_TOLERANCE);
- decode steps run in the CPU decode runtime and, teacher-forced, stay within
  DECODE_TOLERANCE of MLX's (ggml's vec_dot quantizes activations to 8 bits, as llama.cpp does);
- the weights take about the directory's bytes, not 4 a weight; the start-up log says what
  serves each tensor type;
- tensors without a block form (mxfp4, float32 scales) load as float32 layers, logged, and
  then match MLX to float32 rounding at every step;
- through the engine, a prompt-cache hit gives the cold run's tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxcel_compat.runtime import mlx_affine
from mlxcel_compat.runtime.block_layers import BlockEmbedding, BlockLinear, block_weight_of
from mlxcel_compat.runtime.block_weight import BlockWeight, library
from mlxcel_compat.runtime.decode_kv import OwnedCache
from mlxcel_compat.model.loader import load_model, model_fingerprint
from mlxcel_compat.testing import model_directory, models
from mlxcel_compat.testing.model_directory import Quantization, ensure_model
from tests.conftest import MODEL_CACHE, SLOW
from tests.engine.harness import EngineHarness
from tests.runtime.test_block_weight import activation_error

LIB = library()
pytestmark = pytest.mark.skipif(isinstance(LIB, str), reason=f"no block kernels here: {LIB}")

# Prompt logits: the same weight values multiplied in float32 on both sides, in another order
# (the BLAS's sgemm on expanded tiles against MLX's quantized matmul) and through our CPU
# attention; the tiny models' logits span about +-6. Measured: 4e-6.
PROMPT_TOLERANCE = 1e-4
# Decode steps by ggml's vec_dot: every activation row is quantized to 8-bit blocks (Q8_1 for
# Q4_1 weights, Q8_0 for Q8_0), a relative error up to 1/254 of each block's largest value per
# input, through two layers of random unit-gain weights and into KV that later steps read.
# Measured over 12 steps, on logits of about +-5: 0.07-0.14 for the two-layer llama, qwen3 and
# qwen2 at every width and group size, 0.06 for gemma3 (4 layers); lfm2 (4 layers, 2 of them
# convolutions that carry each step's error on) 0.23, hence its own bound.
DECODE_TOLERANCE = 0.3
LFM2_DECODE_TOLERANCE = 0.45
STEPS = 12

BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)


def _quantized(bits: int, group: int, dtype: mx.Dtype, n: int = 48, k: int = 384, seed: int = 0):
    """An (n, k) weight quantized by MLX from ``dtype`` values (rows of very different scales),
    with its scales and biases in float32 (exact widening)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n, k)).astype(np.float32) * np.exp(rng.uniform(-4, 2, (n, 1))).astype(np.float32)
    values[3] = 0.25  # a constant row: zero-width groups
    wq, scales, biases = mx.quantize(mx.array(values).astype(dtype), group_size=group, bits=bits)
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    expected = np.array(mx.dequantize(wq, s32, b32, group_size=group, bits=bits))
    return np.array(wq), np.array(s32), np.array(b32), expected


def _block(repacked: mlx_affine.Repacked, n: int, k: int) -> BlockWeight:
    return BlockWeight(repacked.data, repacked.ggml_type, n, k, LIB, group_bias=repacked.group_bias,
                       bias_group=repacked.bias_group)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_repacked_rows_expand_exactly_to_mx_dequantize(bits: int, group: int, dtype: mx.Dtype) -> None:
    n, k = 48, 384
    wq, scales, biases, expected = _quantized(bits, group, dtype)
    repacked = mlx_affine.repack(wq, scales, biases, bits, group)
    assert not isinstance(repacked, str), repacked
    assert repacked.ggml_type == (T.Q4_1 if bits <= 4 else T.Q8_0) and repacked.exact
    weight = _block(repacked, n, k)
    np.testing.assert_array_equal(weight.dequantize(), expected)  # ggml's to_float (+ group biases)
    np.testing.assert_array_equal(weight.take([47, 3, 0, 3]), expected[[47, 3, 0, 3]])
    # gguf-py reads the same bytes as the same numbers: the layout is ggml's, not just ours.
    read = gguf.quants.dequantize(repacked.data.reshape(-1), repacked.ggml_type).reshape(n, k).astype(np.float32)
    if repacked.group_bias is not None:
        assert repacked.bias_group == group and repacked.group_bias.shape == (n, k // group)
        read = read + np.repeat(repacked.group_bias, group, axis=1)
    np.testing.assert_array_equal(read, expected)
    # Bytes: Q4_1 is 20 per 32 values; Q8_0 34 per 32 plus a float32 bias per group.
    per_row = k // 32 * (20 if bits <= 4 else 34) + (0 if bits <= 4 else 4 * k // group)
    assert weight.nbytes == n * per_row


@pytest.mark.parametrize("bits", [4, 8])
def test_products_by_tiles_and_by_vec_dot(bits: int) -> None:
    n, k, group = 300, 512, 64
    wq, scales, biases, w = _quantized(bits, group, mx.bfloat16, n, k, seed=1)
    repacked = mlx_affine.repack(wq, scales, biases, bits, group)
    weight = _block(repacked, n, k)
    x = np.random.default_rng(2).standard_normal((12, k)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    tiles = weight.matmul(x, tiles=True)
    assert np.all(np.abs(tiles - exact) <= 1e-5 * scale + 1e-6)
    # vec_dot multiplies the blocks' own values by the quantized activations: q * d + m for
    # Q4_1, (q - 128) d for Q8_0 (whose group biases meet the exact input sums).
    blocks = w - np.repeat(repacked.group_bias, group, axis=1) if repacked.group_bias is not None else w
    bound = activation_error(T(repacked.ggml_type), x).astype(np.float64) @ np.abs(blocks).T.astype(np.float64)
    by_dot = weight.matmul(x, tiles=False)
    assert np.all(np.abs(by_dot - exact) <= 1.02 * bound + 1e-5 * scale + 1e-6)
    assert np.abs(by_dot - exact).max() > 1e-5 * scale.max()  # the activations really were quantized


def test_what_has_no_block_form_says_why() -> None:
    assert mlx_affine.block_type(4, 32, "mxfp4") == "mode mxfp4 has no block form here (only affine)"
    assert mlx_affine.block_type(4, 16) == "group size 16 is not a multiple of 32"
    assert mlx_affine.block_type(7, 64) == "7-bit integers have no block form here"
    wq, scales, biases, _ = _quantized(4, 64, mx.float32)  # float32 scales: not float16 values
    assert mlx_affine.repack(wq, scales, biases, 4, 64).startswith("scales are not float16 values")
    wq, scales, biases, _ = _quantized(4, 64, mx.bfloat16)
    off = biases.copy()
    off[5, 1] = np.float32(1 + 2**-20)  # one minimum float16 cannot hold
    assert mlx_affine.repack(wq, scales, off, 4, 64).startswith("biases are not float16 values")
    assert mlx_affine.repack(wq[:, :-1], scales, biases, 4, 64).startswith("unexpected shapes")
    # 8 bits keep float32 biases: only the scales go into the blocks.
    wq, scales, biases, _ = _quantized(8, 64, mx.bfloat16)
    off = biases + np.float32(2**-20)
    repacked = mlx_affine.repack(wq, scales, off, 8, 64)
    assert not isinstance(repacked, str) and repacked.exact


@pytest.mark.parametrize("bits", [4, 8])
def test_a_scale_that_multiplies_only_zeros_is_zeroed(bits: int) -> None:
    """MLX gives a group of equal values the scale -1e-7, which float16 cannot hold; its
    integers are all 0, so the scale is replaced by 0 and the tensor stays in blocks, exactly."""
    values = np.random.default_rng(4).standard_normal((8, 128)).astype(np.float32)
    values[2] = 0.0  # a zero row (padding)
    values[5, 64:] = -0.75  # a constant group
    wq, scales, biases = mx.quantize(mx.array(values).astype(mx.bfloat16), group_size=64, bits=bits)
    s32, b32 = np.array(scales.astype(mx.float32)), np.array(biases.astype(mx.float32))
    assert s32[2, 0] != s32[2, 0].astype(np.float16) and s32[5, 1] != s32[5, 1].astype(np.float16)
    repacked = mlx_affine.repack(np.array(wq), s32, b32, bits, 64)
    assert not isinstance(repacked, str), repacked
    expected = np.array(mx.dequantize(wq, mx.array(s32), mx.array(b32), group_size=64, bits=bits))
    np.testing.assert_array_equal(_block(repacked, 8, 128).dequantize(), expected)
    np.testing.assert_array_equal(expected[2], 0.0)
    # A scale float16 cannot hold that does multiply integers is refused.
    used = s32.copy()
    used[0, 0] = np.float32(1 + 2**-20) * used[0, 0]
    assert mlx_affine.repack(np.array(wq), used, b32, bits, 64).startswith("scales are not float16 values")


def test_a_group_bias_that_rounds_is_flagged_and_within_one_rounding() -> None:
    """bias + 128 scale needs more than float32's 24 bits when their exponents are far apart
    (here 2 ** 10 and 2 ** -17): the expansion is then one float32 rounding off MLX's."""
    n, k = 4, 64
    q = np.random.default_rng(3).integers(0, 256, (n, k)).astype(np.uint8)
    wq = q.view(np.uint32).reshape(n, k // 4)
    scales = np.full((n, 1), 2.0**-24, np.float32)  # the smallest float16 subnormal
    biases = np.full((n, 1), 1024.0, np.float32)
    repacked = mlx_affine.repack(wq, scales, biases, 8, 64)
    assert not isinstance(repacked, str) and not repacked.exact
    expected = np.array(mx.dequantize(mx.array(wq), mx.array(scales), mx.array(biases), group_size=64, bits=8))
    ours = _block(repacked, n, k).dequantize()
    assert np.all(np.abs(ours - expected) <= np.spacing(np.float32(1024.0)))


# ---------------------------------------------------------------------------------- models

Q4, Q8 = Quantization(4, 64), Quantization(8, 64)


def quantized_dir(family: str, quantization: Quantization) -> Path:
    return ensure_model(family, "tiny", cache_dir=MODEL_CACHE, quantization=quantization)


def _prompt(n: int = 40) -> list[int]:
    return [(37 * i + 11) % 4000 + 20 for i in range(n)]


def _reference(directory: Path):
    """MLX's own quantized model of the directory, its scales and biases widened to float32 (what
    the server ran before, and the exact values our blocks hold)."""
    model, _ = load(str(directory))
    model.set_dtype(mx.float32, predicate=lambda dt: dt in (mx.float16, mx.bfloat16))
    return model


@pytest.mark.parametrize("family,quantization", [
    ("llama", Q4), pytest.param("llama", Q8, marks=SLOW), pytest.param("qwen3", Q4, marks=SLOW), ("qwen3", Q8),
    ("llama", Quantization(4, 32)), pytest.param("qwen3", Quantization(8, 32), marks=SLOW), ("llama", Quantization(3, 64)),
    ("llama", Quantization(6, 64)),
], ids=lambda v: v if isinstance(v, str) else v.suffix)  # each family, bit width and group size by default
def test_served_model_matches_mlx_quantized_model(family: str, quantization: Quantization,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    directory = quantized_dir(family, quantization)
    with caplog.at_level(logging.INFO, logger="mlxcel_compat.model.loader"):
        loaded = load_model(str(directory), [])
    text = caplog.text
    kind = "q4_1" if quantization.bits <= 4 else "q8_0"
    assert f"- blocks {kind}: " in text and f"computed by ggml {kind} x" in text
    assert "decode step: CPU decode runtime" in text and "quantized weights expanded to float32" not in text
    modules = [m for _, m in loaded.model.named_modules()]
    assert not any(type(m).__name__.startswith("Quantized") for m in modules)
    blocks = [m for m in modules if isinstance(m, (BlockLinear, BlockEmbedding))]
    assert len(blocks) == 7 * 2 + 1 + (family == "llama")  # every projection, the embedding, an untied head
    assert all(block_weight_of(m).ggml_type == (T.Q4_1 if quantization.bits <= 4 else T.Q8_0) for m in blocks)

    reference = _reference(directory)
    prompt = _prompt()
    ours_cache, ref_cache = make_prompt_cache(loaded.model), make_prompt_cache(reference)
    ours = np.array(loaded.model(mx.array([prompt]), cache=ours_cache))
    theirs = np.array(reference(mx.array([prompt]), cache=ref_cache))
    assert np.abs(ours - theirs).max() <= PROMPT_TOLERANCE

    # Decode steps, teacher-forced with MLX's greedy tokens, in the CPU decode runtime.
    owned, token, worst = OwnedCache(), int(theirs[0, -1].argmax()), 0.0
    for _ in range(STEPS):
        a = loaded.decoder.step(token, ours_cache, owned).copy()
        b = np.array(reference(mx.array([[token]]), cache=ref_cache))[0, -1]
        worst = max(worst, float(np.abs(a - b).max()))
        top = np.sort(b)[-2:]
        if top[1] - top[0] > 2 * DECODE_TOLERANCE:
            assert int(a.argmax()) == int(b.argmax())
        token = int(b.argmax())
    assert worst <= DECODE_TOLERANCE
    assert worst > PROMPT_TOLERANCE  # the activations really were quantized (vec_dot, not tiles)
    assert loaded.decoder.steps == STEPS


@pytest.mark.parametrize("family,quantization", [("qwen2", Q4), ("gemma3_text", Q4), ("lfm2", Q8)],
                         ids=["qwen2-q4", "gemma3-q4", "lfm2-q8"])
def test_other_families_serve_blocks(family: str, quantization: Quantization) -> None:
    """qwen2 (biases on q/k/v, kept next to the blocks) and lfm2 (convolution layers, not quantized:
    runtime/decode_conv.py) through the decode runtime; gemma3 (a scaled, tied embedding; sliding
    windows) through MLX's step, whose block layers take ggml's vec_dot for decode-sized inputs."""
    directory = quantized_dir(family, quantization)
    loaded = load_model(str(directory), [])
    modules = [m for _, m in loaded.model.named_modules()]
    assert not any(type(m).__name__.startswith("Quantized") for m in modules)
    assert sum(isinstance(m, (BlockLinear, BlockEmbedding)) for m in modules) >= 8
    if family == "qwen2":
        assert "bias" in loaded.model.model.layers[0].self_attn.q_proj and loaded.decoder is not None
    if family == "lfm2":
        assert loaded.decoder is not None
    reference = _reference(directory)
    prompt = _prompt()
    ours_cache, ref_cache = make_prompt_cache(loaded.model), make_prompt_cache(reference)
    ours = np.array(loaded.model(mx.array([prompt]), cache=ours_cache))
    theirs = np.array(reference(mx.array([prompt]), cache=ref_cache))
    assert np.abs(ours - theirs).max() <= PROMPT_TOLERANCE
    owned, token, worst = OwnedCache(), int(theirs[0, -1].argmax()), 0.0
    for _ in range(STEPS):
        if loaded.decoder is not None:
            a = loaded.decoder.step(token, ours_cache, owned).copy()
        else:
            a = np.array(loaded.model(mx.array([[token]]), cache=ours_cache))[0, -1]
        b = np.array(reference(mx.array([[token]]), cache=ref_cache))[0, -1]
        worst = max(worst, float(np.abs(a - b).max()))
        token = int(b.argmax())
    assert PROMPT_TOLERANCE < worst <= (LFM2_DECODE_TOLERANCE if family == "lfm2" else DECODE_TOLERANCE)


@pytest.mark.parametrize("family,quantization", [("llama", Q4), ("qwen3", Q8)], ids=["llama-q4", "qwen3-q8"])
def test_weights_take_about_the_directory_bytes(family: str, quantization: Quantization) -> None:
    directory = quantized_dir(family, quantization)
    loaded = load_model(str(directory), [])
    tensors = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    manifest = ensure_model(family, "tiny", MODEL_CACHE) / model_directory.MANIFEST_NAME
    float_params = json.loads(manifest.read_text())["num_parameters"]
    assert loaded.n_params == float_params  # block weights count as their n x k values
    # Q4_1 holds 5 bits a weight where the directory holds 4.5 (group 64); Q8_0 plus group
    # biases 9 where it holds 8.5; the norms widen to float32.
    assert 0.9 * tensors <= loaded.size_bytes <= 1.2 * tensors
    assert loaded.size_bytes < 0.35 * 4 * float_params  # float32 would take 4 bytes a weight
    # Saved KV from MLX's quantized matmul must not be taken for this model's.
    assert loaded.fingerprint != model_fingerprint(directory)


@pytest.mark.parametrize("quantization,why", [
    (Quantization(4, 32, mode="mxfp4"), "mode mxfp4 has no block form"),
    (Quantization(4, 64, dtype="float32"), "scales are not float16 values"),
], ids=["mxfp4", "float32-scales"])
def test_tensors_without_a_block_form_load_as_float32(quantization: Quantization, why: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    directory = quantized_dir("llama", quantization)
    with caplog.at_level(logging.INFO, logger="mlxcel_compat.model.loader"):
        loaded = load_model(str(directory), [])
    assert "quantized weights expanded to float32 (4 bytes a weight), 16 tensors: " in caplog.text
    assert why in caplog.text and "decode step: CPU decode runtime" in caplog.text
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is nn.Linear and q_proj.weight.dtype == mx.float32
    reference = _reference(directory)
    prompt = _prompt()
    ours_cache, ref_cache = make_prompt_cache(loaded.model), make_prompt_cache(reference)
    ours = np.array(loaded.model(mx.array([prompt]), cache=ours_cache))
    theirs = np.array(reference(mx.array([prompt]), cache=ref_cache))
    assert np.abs(ours - theirs).max() <= PROMPT_TOLERANCE
    owned, token = OwnedCache(), int(theirs[0, -1].argmax())
    for _ in range(4):  # float32 weights: the runtime's steps match MLX's to rounding
        a = loaded.decoder.step(token, ours_cache, owned)
        b = np.array(reference(mx.array([[token]]), cache=ref_cache))[0, -1]
        assert np.abs(a - b).max() <= PROMPT_TOLERANCE
        token = int(b.argmax())


def test_engine_cache_hit_equals_the_cold_run_on_a_quantized_directory() -> None:
    prompt = [(11 * i + 7) % 900 + 20 for i in range(300)]
    h = EngineHarness(quantized_dir("llama", Q4))
    try:
        assert h.engine.loaded.decoder is not None
        cold = h.run(prompt, n_predict=32, ignore_eos=True)
        hit = h.run(prompt, n_predict=32, ignore_eos=True)
        assert hit.finish.n_cached == len(prompt) - 1
        assert len(cold.tokens) == 32 and hit.tokens == cold.tokens
        # the cold run: 288 prompt rows in 16-row chunks, its last 12 as the rows of one step, 31 fed
        # back; the hit: its last prompt token's step, 31 fed back
        assert h.engine.loaded.decoder.steps == (12 + 31) + (1 + 31)
    finally:
        h.close()


def test_factory_cli_writes_mlx_lm_quantized_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(MODEL_CACHE))  # where the float directory it converts is cached
    out = tmp_path / "llama-q8"
    assert models.main(["--family", "llama", "--quantize", "8", "--q-group-size", "32", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert model_directory.is_complete(out)
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == mx.uint32
    assert weights["model.layers.0.mlp.down_proj.scales"].dtype == mx.bfloat16
    model, _ = load(str(out))
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    # Deterministic: the cached build of the same parameters has the same bytes.
    cached = quantized_dir("llama", Quantization(8, 32))
    def safetensors(directory: Path) -> dict:
        return json.loads((directory / model_directory.MANIFEST_NAME).read_text())["files"]["model.safetensors"]

    assert safetensors(cached) == safetensors(out)
