"""GGUF files of MXFP4 and the i-quants, as the test factory writes them with ggml's quantizer.

The tiny llama's rows are 64 or 192 values long, so llama-quantize's fallbacks would turn every
i-quant of 256-value blocks into IQ4_NL: the files here are the tiny llama with an FFN of 256,
whose two ``ffn_down`` matrices (rows of 256) take the type itself and the rest its fallback,
IQ4_NL (MXFP4 and IQ4_NL files: every matrix in the type). Each file:

- is reported as it is: llama.cpp's file type name, the tensor types, what keeps each tensor;
- keeps its matrices in their blocks on the CPU, whose values are gguf-py's reading of the
  file's bytes, bit for bit;
- generates: prompt logits and teacher-forced decode steps near the float32 expansion of the
  same file (``blocks=False``), with the greedy token wherever that one's top two are apart.
  Every product here rounds the activations to 8 bits as llama.cpp does (ggml's repacked GEMM
  for MXFP4 and IQ4_NL, ggml's mul_mat and vec_dot for the others), so logits agree within the
  tolerances of ``tests/gguf/test_models.py``'s 8-bit paths;
- on Metal / CUDA (the GPU policy, run here on the CPU) becomes MLX quantized layers: MXFP4 in
  MLX's own mxfp4 mode with the file's values exactly, the i-quants requantized affine forms.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.gguf import precision
from mlxcel_compat.gguf.load import load_gguf
from mlxcel_compat.gguf.reader import open_gguf, read_tensor
from mlxcel_compat.runtime import ggml_repack
from mlxcel_compat.runtime.block_weight import library
from mlxcel_compat.testing.families import family_spec, model_config
from mlxcel_compat.testing.gguf_writer import write_gguf
from mlxcel_compat.testing.model_directory import FORMAT_VERSION
from mlxcel_compat.testing.weights import WEIGHT_SEED, init_tensor, instantiate, stored_shapes
from tests.conftest import MODEL_CACHE, tiny_model

pytestmark = pytest.mark.engine

LIB = library()
NEW_TYPES = ("mxfp4", "iq4_nl", "iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s")
FILE_TYPE_NAMES = {"mxfp4": "MXFP4 MoE", "iq4_nl": "IQ4_NL - 4.5 bpw", "iq4_xs": "IQ4_XS - 4.25 bpw",
                   "iq3_s": "IQ3_S - 3.4375 bpw", "iq3_xxs": "IQ3_XXS - 3.0625 bpw", "iq2_s": "IQ2_M - 2.7 bpw",
                   "iq2_xs": "IQ2_XS - 2.3125 bpw", "iq2_xxs": "IQ2_XXS - 2.0625 bpw", "iq1_m": "IQ1_M - 1.75 bpw",
                   "iq1_s": "IQ1_S - 1.5625 bpw"}
FFN = 256
# Logits within this of the float32 expansion: 8-bit activations, as tests/gguf/test_models.py's
# PROMPT_8BIT_TOLERANCE and DECODE_TOLERANCE (measured here: 0.05-0.12 on logits of about +-1.5).
PROMPT_TOLERANCE, DECODE_TOLERANCE = 0.4, 0.25
PROMPT = "The quick brown fox jumps over the lazy dog. def f(x: int) -> str:\n    return 'café'"
IDS = [[1, 2, 3, 4, 5, 6, 7, 8]]


def ensure_type_gguf(gguf_type: str) -> Path:
    """The tiny llama with an FFN of 256 as a GGUF of ``gguf_type`` (written once into the test
    model cache; the weights are the factory's seeded ones for that shape)."""
    target = Path(MODEL_CACHE).absolute() / f"llama-tiny-ffn{FFN}-v{FORMAT_VERSION}-{gguf_type}.gguf"
    if target.is_file():
        return target
    config = {**model_config("llama", "tiny"), "intermediate_size": FFN}
    shapes = stored_shapes(instantiate(config), config)
    rng = np.random.default_rng(WEIGHT_SEED)
    spec = family_spec("llama", "tiny")
    weights = {name: mx.array(init_tensor(rng, name, shapes[name], spec)) for name in sorted(shapes)}
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    try:
        write_gguf("llama", "tiny", tmp, gguf_type, model_dir=tiny_model("llama"), weights=weights, config=config)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _own_type(gguf_type: str) -> bool:
    """Whether every matrix is in the type itself (32-value blocks), or only ffn_down."""
    return gguf_type in ("mxfp4", "iq4_nl")


def _decode_within(model, reference, prompt: list[int], tolerance: float, steps: int = 8) -> tuple[float, list[int]]:
    """Teacher-forced decode steps of ``model`` against ``reference``: logits within ``tolerance``
    and the same greedy token wherever the reference's top two are over twice that apart.
    Returns the largest difference and the reference's greedy tokens."""
    caches = make_prompt_cache(model), make_prompt_cache(reference)
    ours, theirs = model(mx.array([prompt]), cache=caches[0]), reference(mx.array([prompt]), cache=caches[1])
    worst, tokens = 0.0, []
    for _ in range(steps):
        a, b = np.array(ours[0, -1]), np.array(theirs[0, -1])
        worst = max(worst, float(np.abs(a - b).max()))
        assert worst <= tolerance, worst
        first, second = np.sort(b)[-2:][::-1]
        if first - second > 2 * tolerance:
            assert int(a.argmax()) == int(b.argmax())
        tokens.append(int(b.argmax()))
        ours = model(mx.array([[tokens[-1]]]), cache=caches[0])
        theirs = reference(mx.array([[tokens[-1]]]), cache=caches[1])
    return worst, tokens


@pytest.mark.skipif(isinstance(LIB, str), reason=f"no block kernels here: {LIB}")
@pytest.mark.parametrize("gguf_type", NEW_TYPES)
def test_a_factory_file_of_each_type_loads_from_its_blocks_and_generates(gguf_type: str) -> None:
    path = ensure_type_gguf(gguf_type)
    file = open_gguf(path)
    model, tokenizer, _, summary = load_gguf(str(path), on_cpu=True)

    # What start-up logs and /props report.
    assert summary.file_type == FILE_TYPE_NAMES[gguf_type]
    matrices = 16  # 2 layers x 7, the embedding and the output
    own = matrices if _own_type(gguf_type) else 2
    fallback = {} if _own_type(gguf_type) else {"iq4_nl": matrices - own}
    assert summary.type_counts == {"f32": 5, gguf_type: own, **fallback}
    label = f"blocks {gguf_type}"
    assert summary.precision == {label: own, "float32": 5, **{f"blocks {t}": n for t, n in fallback.items()}}
    activations = "q8_0" if _own_type(gguf_type) else "q8_K"
    assert summary.kernels[label].startswith(f"ggml {gguf_type} x {activations}")
    assert not summary.blocks_unavailable
    linears = own - 1 if _own_type(gguf_type) else own  # the embedding is not a linear layer
    if gguf.GGMLQuantizationType[gguf_type.upper()] in ggml_repack.REPACKED_TYPES:
        assert summary.repacked[label] == linears
    elif ggml_repack.takes_prompt_products(gguf.GGMLQuantizationType[gguf_type.upper()]):
        assert summary.prompt_products[label] == linears

    # The blocks hold the file's values: gguf-py's reading of the same bytes.
    info = file.tensors["blk.1.ffn_down.weight"]
    stored = gguf.quants.dequantize(read_tensor(info), info.ggml_type).reshape(info.shape)
    held = model.model.layers[1].mlp.down_proj.block
    assert held.ggml_type == gguf.GGMLQuantizationType[gguf_type.upper()]
    np.testing.assert_array_equal(held.dequantize(), stored)

    reference, *_ = load_gguf(str(path), on_cpu=True, blocks=False)
    assert reference.model.layers[1].mlp.down_proj.weight.dtype == mx.float32
    np.testing.assert_array_equal(np.array(reference.model.layers[1].mlp.down_proj.weight), stored)
    ids = tokenizer.encode(PROMPT)
    prompt_diff = mx.abs(model(mx.array([ids])) - reference(mx.array([ids]))).max().item()
    assert 0 < prompt_diff <= PROMPT_TOLERANCE, prompt_diff  # 8-bit activations: never float32's exact result
    worst, tokens = _decode_within(model, reference, ids, DECODE_TOLERANCE)
    print(f"{gguf_type}: prompt logits within {prompt_diff:.3g}, decode steps within {worst:.3g} of float32 math; "
          f"greedy {tokens}")
    assert len(set(tokens)) > 1  # it generates text, not one token over and over


@pytest.fixture(scope="module")
def float_logits() -> mx.array:
    """The same model's F32 file: the logits before any quantization."""
    model, *_ = load_gguf(str(ensure_type_gguf("f32")), on_cpu=True, blocks=False)
    return model(mx.array(IDS))


@pytest.mark.parametrize("gguf_type", NEW_TYPES)
def test_the_gpu_policy_keeps_each_type_quantized(gguf_type: str, float_logits: mx.array) -> None:
    """On Metal / CUDA: MXFP4 matrices of linear layers become MLX mxfp4 layers holding the file's
    exponents and codes (the embedding, whose MLX form would give bfloat16 rows, float16); the
    i-quants become affine layers in their forms (precision.GPU_FORMS: IQ3_S and IQ1_S their own
    integers, the others requantized). In float32 math (float16 scales, biases and norms
    widened, exactly) the MXFP4 model is the file's float32 expansion up to summation order, and
    the i-quants' forms move the logits by at most half what the file's own quantization moved
    them (tests/gguf/test_gpu_policy.py's MAPPING_SHARE); as loaded, in float16, every model runs."""
    path = ensure_type_gguf(gguf_type)
    model, _, _, summary = load_gguf(str(path), on_cpu=False)
    reference, *_ = load_gguf(str(path), on_cpu=True, blocks=False)
    assert summary.compute_dtype == "float16" and not summary.affine_fallbacks
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down, nn.QuantizedLinear)
    qtype = gguf.GGMLQuantizationType[gguf_type.upper()]
    if gguf_type == "mxfp4":
        assert summary.precision == {"mlx mxfp4": 15, "float16": 6}
        assert summary.kernels["mlx mxfp4"] == "MLX mxfp4, group 32 (exact)"
        assert down.mode == "mxfp4" and down.bits == 4 and down.group_size == 32
        assert type(model.model.embed_tokens) is nn.Embedding
        q_proj = model.model.layers[0].self_attn.q_proj  # rows un-permuted as the float path's
        for layer, expected in ((down, reference.model.layers[1].mlp.down_proj),
                                (q_proj, reference.model.layers[0].self_attn.q_proj)):
            restored = mx.dequantize(layer.weight, layer.scales, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
            assert mx.array_equal(restored, expected.weight).item()
    else:
        bits, group = precision.GPU_FORMS[qtype]
        assert (down.bits, down.group_size, down.mode) == (bits, group, "affine")
        assert summary.precision[f"affine {gguf_type}"] == (16 if gguf_type == "iq4_nl" else 2)
        assert summary.kernels[f"affine {gguf_type}"] == precision.affine_form(qtype, "float16").describe()
    as_loaded = model(mx.array(IDS))
    assert as_loaded.dtype == mx.float16 and mx.all(mx.isfinite(as_loaded)).item()

    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.float16 else a, model.parameters()))
    got, expected = model(mx.array(IDS)), reference(mx.array(IDS))
    assert got.dtype == mx.float32
    mapping, quantization = _rms(got - expected), _rms(expected - float_logits)
    print(f"{gguf_type}: the GPU form moves logits {mapping:.3g} RMS, the file's quantization {quantization:.3g}")
    if gguf_type == "mxfp4":
        assert mx.abs(got - expected).max().item() <= 1e-4
    else:
        assert mapping <= 0.5 * quantization


def _rms(x: mx.array) -> float:
    return mx.sqrt(mx.mean(x * x)).item()


@pytest.mark.skipif(isinstance(LIB, str), reason=f"no block kernels here: {LIB}")
def test_a_type_the_ggml_build_lacks_is_expanded_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ggml builds this project loads have every type's kernels (tests/runtime/
    test_block_weight.py); were one to lack a type, its tensors would be expanded to float32
    (by gguf-py where ggml cannot) and the start-up warning would name the type."""
    iq2_xxs = gguf.GGMLQuantizationType.IQ2_XXS
    monkeypatch.setattr(LIB.ggml, "supports", lambda t, real=LIB.ggml.supports: t != iq2_xxs and real(t))
    model, _, _, summary = load_gguf(str(ensure_type_gguf("iq2_xxs")), on_cpu=True)
    assert summary.precision == {"blocks iq4_nl": 14, "float32": 7}
    assert summary.blocks_unavailable.endswith("lacks IQ2_XXS") and LIB.ggml.version in summary.blocks_unavailable
    assert type(model.model.layers[1].mlp.down_proj) is nn.Linear
