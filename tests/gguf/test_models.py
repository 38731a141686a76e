"""A GGUF written by the factory loads as the same model as its Hugging Face directory.

For every GGUF family and every writable type: the same token ids and rendered prompts, the
same logits and the same greedy tokens. The reference for a type is the HF model with its
matrices passed through the same GGML encoding (gguf-py's quantize/dequantize, or a float16
round trip), so what is compared is the loader, not quantization noise:

- F32: logits bit-exact against the HF directory itself;
- F16 / Q8_0 / Q4_0: logits within 1e-4 of the equally-rounded HF model (float32 sums over
  identical weights; the only freedom left is the order of floating point operations).

How far each type is from the float model is printed for information (``-s``), never asserted.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxcel_compat.chat.template import ChatTemplate
from mlxcel_compat.gguf import architectures as gguf_arch
from mlxcel_compat.runtime.block_weight import library
from mlxcel_compat.gguf.reader import open_gguf
from mlxcel_compat.gguf.load import load_gguf
from mlxcel_compat.gguf.quants import UnsupportedTensorType
from mlxcel_compat.model.loader import load_model
from mlxcel_compat.testing.gguf_tensors import GGUF_FAMILIES, permute_rows
from mlxcel_compat.testing.gguf_writer import ensure_gguf, write_gguf
from tests.conftest import MODEL_CACHE, matrix, tiny_model

pytestmark = pytest.mark.engine

PROMPT = "The quick brown fox jumps over the lazy dog. def f(x: int) -> str:\n    return 'café 你好'"
TEXTS = [PROMPT, "  two spaces\n\ttab <|im_start|>user\nhi<|im_end|>", "<think>\nx\n</think>\n\n🚀 ✅"]
TOLERANCE = {"f32": 0.0, "f16": 1e-4, "q8_0": 1e-4, "q4_0": 1e-4}
# The types gguf-py can round-trip a directory's weights through (the other types, written by
# ggml's quantizer, are decoded block by block against gguf-py in test_gguf_quants.py and followed
# step by step against MLX's step on the same file in test_cpu_decode.py).
DIRECTORY_TYPES = tuple(TOLERANCE)
# Decode steps of block weights multiply by activations quantized as llama.cpp does (Q8_0 for
# these types, F16 for F16): their logits differ from float32 math on the same weights by this
# much at most on the tiny models, whose logits span about +-1.5 (measured: 0.11 and 0.004).
DECODE_TOLERANCE = {"f32": 0.0, "f16": 0.01, "q8_0": 0.25, "q4_0": 0.25}
# A whole prompt with 8-bit activations (Q8_0's lanes, Q4_0's repacked GEMM): the
# rounding of every position's activations compounds over the prompt's layers; measured on the
# tiny models: q8_0 0.09-0.10 (lfm2 0.31), q4_0 0.10-0.15 (lfm2 0.24); float32 tiles 1e-4.
PROMPT_8BIT_TOLERANCE = {"q8_0": 0.4, "q4_0": 0.4}
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def _round_trip(weight: mx.array, name: str, gguf_type: str) -> mx.array:
    """The HF weight after the writer's encoding: what the GGUF really holds."""
    data = np.array(weight, dtype=np.float32)
    if gguf_type == "f32" or data.ndim < 2 or name.endswith("conv.weight"):
        return weight
    if gguf_type == "f16" or data.shape[-1] % 32:
        return mx.array(data.astype(np.float16).astype(np.float32))
    q = gguf.quants.quantize(data, GGML[gguf_type])
    return mx.array(gguf.quants.dequantize(q, GGML[gguf_type]).reshape(data.shape))


@pytest.fixture(scope="module")
def hf_models() -> dict[str, tuple]:
    return {family: load(str(tiny_model(family))) for family in GGUF_FAMILIES}


def _decode_agrees(model, reference, prompt: list[int], tolerance: float, n: int = 8) -> float:
    """Teacher-forced decode steps of ``model`` against ``reference``: every step's logits within
    ``tolerance``, and the same greedy token wherever the reference's top two are further apart
    than twice that. Returns the largest difference seen."""
    caches = make_prompt_cache(model), make_prompt_cache(reference)
    ours, theirs = model(mx.array([prompt]), cache=caches[0]), reference(mx.array([prompt]), cache=caches[1])
    worst = 0.0
    for _ in range(n):
        a, b = np.array(ours[0, -1]), np.array(theirs[0, -1])
        worst = max(worst, float(np.abs(a - b).max()))
        assert worst <= tolerance, worst
        top = np.sort(b)[-2:]
        if top[1] - top[0] > 2 * tolerance:
            assert int(a.argmax()) == int(b.argmax())
        token = int(b.argmax())
        ours = model(mx.array([[token]]), cache=caches[0])
        theirs = reference(mx.array([[token]]), cache=caches[1])
    return worst


def _greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


@pytest.mark.parametrize("family, gguf_type", matrix(GGUF_FAMILIES, DIRECTORY_TYPES))
def test_gguf_equals_hf_directory(family: str, gguf_type: str, hf_models: dict[str, tuple]) -> None:
    hf_model, hf_tok = hf_models[family]
    path = ensure_gguf(family, "tiny", gguf_type, cache_dir=MODEL_CACHE)
    model, tokenizer, config, summary = load_gguf(str(path), on_cpu=True)
    assert summary.architecture == gguf_arch.ARCHITECTURES[summary.architecture].gguf_arch
    # On the CPU, matrices in a block type are served from the file's blocks; the rest is float32.
    assert set(summary.precision) == ({"float32"} if gguf_type == "f32" else {"float32", f"blocks {gguf_type}"})

    for text in TEXTS:
        for special in (True, False):
            assert tokenizer.encode(text, add_special_tokens=special) == hf_tok.encode(text, add_special_tokens=special)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ours, theirs = ChatTemplate.from_tokenizer(tokenizer), ChatTemplate.from_tokenizer(hf_tok)
    assert ours.source == theirs.source
    assert ours.render(messages, add_generation_prompt=True) == theirs.render(messages, add_generation_prompt=True)

    reference = hf_model
    if gguf_type != "f32":
        weights = [(name, _round_trip(w, name, gguf_type)) for name, w in tree_flatten(hf_model.parameters())]
        reference, _ = load(str(tiny_model(family)))
        reference.load_weights(weights)
    ids = hf_tok.encode(PROMPT)
    expected = reference(mx.array([ids]))
    got = model(mx.array([ids]))
    diff = mx.abs(got - expected).max().item()
    # A weight ggml repacks (Q4_0 here, ggml_repack.py) or multiplies by its own mul_mat (Q8_0
    # here: ggml_repack.PROMPT_TYPES), or whose prompts the shim's lanes take (Q8_0 with AVX-512
    # VNNI), computes prompts with 8-bit activations, as decode steps do (llama.cpp's arithmetic);
    # the others expand float32 tiles for prompts.
    lib = library()
    lanes = gguf_type in GGML and not isinstance(lib, str) and int(GGML[gguf_type]) in lib.lane_prompts
    eight_bit = summary.repacked or any(summary.prompt_products.values()) or lanes
    prompt_tolerance = PROMPT_8BIT_TOLERANCE[gguf_type] if eight_bit else TOLERANCE[gguf_type]
    print(f"{family} {gguf_type}: prompt logits within {diff:.3g} of float32 math")
    assert diff <= prompt_tolerance, (family, gguf_type, diff)
    if gguf_type == "f32":
        assert _greedy(model, ids) == _greedy(reference, ids)
    else:
        worst = _decode_agrees(model, reference, ids, DECODE_TOLERANCE[gguf_type])
        print(f"{family} {gguf_type}: decode steps within {worst:.3g} of float32 math")
    if gguf_type != "f32":
        drift = mx.abs(got - hf_model(mx.array([ids]))).max().item()
        print(f"{family} {gguf_type}: max |logit - float model| = {drift:.3g}")


def test_without_the_unpermute_llama_logits_are_wrong(hf_models: dict[str, tuple], monkeypatch) -> None:
    """The Q/K un-permute is load-bearing: skipping it gives plausible but different logits."""
    path = ensure_gguf("llama", "tiny", "f32", cache_dir=MODEL_CACHE)
    monkeypatch.setattr(gguf_arch, "qk_heads", lambda spec, config, name: None)
    model, *_ = load_gguf(str(path), on_cpu=True)
    hf_model, hf_tok = hf_models["llama"]
    ids = hf_tok.encode(PROMPT)
    diff = mx.abs(model(mx.array([ids])) - hf_model(mx.array([ids]))).max().item()
    assert diff > 1e-3


def test_unpermute_inverts_the_converter_permutation() -> None:
    rows = np.arange(8 * 3 * 2, dtype=np.float32).reshape(8 * 2, 3)
    for heads in (1, 2, 4):
        np.testing.assert_array_equal(gguf_arch.unpermute_rows(permute_rows(rows, heads), heads), rows)
        assert not np.array_equal(permute_rows(rows, heads), rows)


def test_gpu_policy_keeps_q8_0_as_exact_affine_weights() -> None:
    """Exercised on the CPU: Q8_0 matrices become QuantizedLinear with the file's exact blocks, the
    same values the CPU's block layers hold (every type's form: tests/gguf/test_gpu_policy.py)."""
    import mlx.nn as nn

    path = ensure_gguf("qwen3", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    model, _, config, summary = load_gguf(str(path), on_cpu=False)
    cpu_model, *_ = load_gguf(str(path), on_cpu=True)
    assert summary.compute_dtype == "float16"
    assert summary.precision["affine q8_0"] == 15 and summary.precision["float16"] == 9
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, nn.QuantizedLinear) and layer.bits == 8 and layer.group_size == 32
    restored = mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32),
                             group_size=32, bits=8)
    cpu_weight = cpu_model.model.layers[0].self_attn.q_proj.block.dequantize()  # the file's blocks, expanded
    assert mx.array_equal(restored, mx.array(cpu_weight)).item()
    ids = [1, 2, 3, 4, 5, 6]
    diff = mx.abs(model(mx.array([ids])).astype(mx.float32) - cpu_model(mx.array([ids]))).max().item()
    assert diff < 0.1  # float16 activations against float32 ones


def test_split_gguf_loads_from_its_first_part(tmp_path: Path) -> None:
    parts = write_gguf("qwen3", "tiny", tmp_path / "model.gguf", "q8_0", split_max_tensors=7,
                       model_dir=tiny_model("qwen3"))
    assert [p.name for p in parts] == [f"model-{i:05d}-of-00004.gguf" for i in range(1, 5)]
    model, *_ , summary = load_gguf(str(parts[0]), on_cpu=True)
    single, *_ = load_gguf(str(ensure_gguf("qwen3", "tiny", "q8_0", cache_dir=MODEL_CACHE)), on_cpu=True)
    assert summary.parts == 4
    ids = [5, 6, 7, 8]
    assert mx.array_equal(model(mx.array([ids])), single(mx.array([ids]))).item()
    with pytest.raises(ValueError, match="pass the first part"):
        open_gguf(parts[1])
    parts[2].unlink()
    with pytest.raises(ValueError, match="00003-of-00004.gguf' is missing"):
        open_gguf(parts[0])


def _rewrite(source: Path, target: Path, arch: str | None = None, retype: dict[str, int] | None = None) -> Path:
    """Copy a GGUF, changing its architecture or storing some tensors under another type."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(target), arch or reader.fields["general.architecture"].contents())
    old_arch = reader.fields["general.architecture"].contents()
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, vtype = field.contents(), field.types[0]
        new_key = key.replace(f"{old_arch}.", f"{arch}.", 1) if arch else key
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(new_key, value, vtype, sub_type=sub)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        qtype = (retype or {}).get(tensor.name)
        if qtype is not None:  # raw bytes of the right size; the loader must refuse before decoding
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
            data = np.zeros((rows, cols // block * size), dtype=np.uint8)
            writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType(qtype))
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_unsupported_architecture_names_it_and_lists_the_supported(tmp_path: Path) -> None:
    path = _rewrite(ensure_gguf("llama", "tiny", "f32", cache_dir=MODEL_CACHE), tmp_path / "x.gguf", arch="falcon")
    with pytest.raises(gguf_arch.UnsupportedArchitecture) as info:
        load_gguf(str(path), on_cpu=True)
    assert str(info.value) == ("GGUF architecture 'falcon' is not supported by mlxcel_compat: no row serves it and "
                               "mlx-lm has no model class of that name "
                               f"(supported: {', '.join(gguf_arch.SUPPORTED_ARCHITECTURES)})")
    assert gguf_arch.SUPPORTED_ARCHITECTURES[:5] == ("llama", "qwen2", "qwen3", "gemma3", "lfm2")


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path: Path) -> None:
    path = _rewrite(ensure_gguf("llama", "tiny", "f32", cache_dir=MODEL_CACHE), tmp_path / "nvfp4.gguf",
                    retype={"blk.1.ffn_down.weight": gguf.GGMLQuantizationType.NVFP4})
    with pytest.raises(UnsupportedTensorType, match=r"tensor 'blk\.1\.ffn_down\.weight' is stored as NVFP4"):
        load_gguf(str(path), on_cpu=True)


def test_load_model_reports_gguf_facts() -> None:
    path = ensure_gguf("gemma3_text", "tiny", "q8_0", cache_dir=MODEL_CACHE)
    loaded = load_model(str(path), [])
    assert loaded.model_id == path.name
    assert loaded.file_type == "Q8_0"
    file = open_gguf(path)
    assert loaded.n_params == file.n_params == sum(t.n_values for t in file.tensors.values())
    assert loaded.size_bytes == file.size_bytes < path.stat().st_size
    assert loaded.config["model_type"] == "gemma3_text" and loaded.config["sliding_window_pattern"] == 2
    assert loaded.gguf.type_counts == {"f32": 25, "q8_0": 29}


def test_factory_cli_writes_a_gguf(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "m.gguf"
    done = subprocess.run([sys.executable, "-m", "mlxcel_compat.testing.models", "--family", "qwen2", "--size", "tiny",
                           "--format", "gguf", "--gguf-type", "q4_0", "--out", str(out)],
                          capture_output=True, text=True, env={**__import__("os").environ, "MLXCEL_CACHE_DIR": str(MODEL_CACHE)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert out.read_bytes() == ensure_gguf("qwen2", "tiny", "q4_0", cache_dir=MODEL_CACHE).read_bytes()
    bad = subprocess.run([sys.executable, "-m", "mlxcel_compat.testing.models", "--family", "gpt9",
                          "--format", "gguf", "--out", str(tmp_path / "x.gguf")], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown model family 'gpt9'" in bad.stderr
    with pytest.raises(ValueError, match="family 'gpt9' has no GGUF writer"):  # every factory family has one
        write_gguf("gpt9", "tiny", tmp_path / "x.gguf")
