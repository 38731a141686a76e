"""The dense architectures served from GGUF (``gguf/arch_dense.py``) load as their mlx-lm directories.

For every dense factory family (``testing/families_dense.py``), the factory's GGUF, written as
llama.cpp's converter writes that architecture:

- F32: the same token ids and rendered chat prompt as the directory, logits over a prompt within
  ``F32_TOLERANCE`` of mlx-lm's on the directory (the same float32 weights through the same
  mlx-lm class, so only metadata values rounded to float32, e.g. an epsilon, may differ; measured
  0 for every family), and the same greedy tokens through the engine;
- Q8_0: the CPU serves the matrices from the file's blocks (ggml's kernels); the prompt's logits
  within ``Q8_0_TOLERANCE`` of the same file expanded to float32 (``load_gguf(..., blocks=False)``);
  Metal/CUDA's policy on the same file (affine layers, float16) within ``GPU_POLICY_TOLERANCE``.

The generic path (``gguf/generic_path.py``) is tested at the end: a file whose
architecture no row serves loads through mlx-lm's class of that name when it fits, and otherwise
stops with a message naming the architecture and the served ones.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxcel_compat.gguf import architectures as gguf_arch
from mlxcel_compat.gguf.arch_spec import UnsupportedArchitecture
from mlxcel_compat.gguf.load import load_gguf
from mlxcel_compat.runtime import cpu_decode
from mlxcel_compat.testing import families_dense
from mlxcel_compat.testing.gguf_writer import ensure_gguf
from tests.conftest import MODEL_CACHE, slow_but, tiny_model
from tests.engine.harness import EngineHarness
from tests.gguf.reference_checks import assert_tokenizer_and_template_match

pytestmark = pytest.mark.engine

DENSE_FAMILIES = tuple(f.name for f in families_dense.FAMILIES)
PROMPT = ("The quick brown fox jumps over the lazy dog. def f(x: int) -> str:\n    return 'café 你好' "
          "and a few more words, so that the prompt runs past the tiny models' sliding windows")
TEXTS = [PROMPT, "  two spaces\n\ttab <|im_start|>user\nhi<|im_end|>", "🚀 ✅"]
F32_TOLERANCE = 1e-5
# Prompt products of Q8_0 blocks quantize the activations to 8 bits, as llama.cpp does (ggml's
# mul_mat, or the shim's own GEMM): the tiny models' logits (spread about +-2) move by up to ~0.1
# against float32 math on the same weights; decode rows by as much.
Q8_0_TOLERANCE = 0.4
N_GREEDY = 8


def greedy(model, prompt: list[int], n: int = N_GREEDY, banned: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens after ``prompt`` (never one of ``banned``: the end tokens ``ignore_eos``
    bans), and the gap between the top two logits at each step."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    tokens, gaps = [], []
    for _ in range(n):
        row = np.array(logits[0, -1], dtype=np.float32)
        row[list(banned)] = -np.inf
        top = np.sort(row)[-2:]
        tokens.append(int(row.argmax()))
        gaps.append(float(top[1] - top[0]))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)
    return tokens, gaps


def agree_where_clear(ours: list[int], theirs: list[int], gaps: list[float], margin: float) -> None:
    """The same tokens up to the first step whose top two are within ``margin`` (after a near-tie
    either continuation is right, and the sequences may part)."""
    for got, expected, gap in zip(ours, theirs, gaps):
        if gap <= margin:
            return
        assert got == expected, (ours, theirs, gaps)


class Directories(dict):
    """mlx-lm's model and tokenizer of each family's directory, loaded on first use."""

    def __missing__(self, family: str) -> tuple:
        self[family] = load(str(tiny_model(family)))
        return self[family]


@pytest.fixture(scope="module")
def directories() -> Directories:
    return Directories()


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_f32_gguf_equals_the_directory(family: str, directories: dict[str, tuple]) -> None:
    reference, hf_tok = directories[family]
    path = ensure_gguf(family, "tiny", "f32", cache_dir=MODEL_CACHE)
    model, tokenizer, config, summary = load_gguf(str(path), on_cpu=True)
    assert summary.architecture == families_dense.GGUF_TARGETS[family].arch
    assert set(summary.precision) == {"float32"}

    assert_tokenizer_and_template_match(tokenizer, hf_tok, TEXTS)

    ids = hf_tok.encode(PROMPT)
    expected = reference(mx.array([ids]))
    diff = mx.abs(model(mx.array([ids])) - expected).max().item()
    assert diff <= F32_TOLERANCE, (family, diff)
    theirs_tokens, gaps = greedy(reference, ids)
    agree_where_clear(greedy(model, ids)[0], theirs_tokens, gaps, 10 * F32_TOLERANCE)


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_q8_0_blocks_equal_their_float32_expansion(family: str, directories: dict[str, tuple]) -> None:
    path = ensure_gguf(family, "tiny", "q8_0", cache_dir=MODEL_CACHE)
    model, _, _, summary = load_gguf(str(path), on_cpu=True)
    expanded, *_ = load_gguf(str(path), on_cpu=True, blocks=False)
    assert "blocks q8_0" in summary.precision, summary.precision
    ids = directories[family][1].encode(PROMPT)
    diff = mx.abs(model(mx.array([ids])) - expanded(mx.array([ids]))).max().item()
    assert diff <= Q8_0_TOLERANCE, (family, diff)
    tokens, gaps = greedy(expanded, ids)
    agree_where_clear(greedy(model, ids)[0], tokens, gaps, 2 * Q8_0_TOLERANCE)


# Float16 activations against float32 ones on the same Q8_0 values (tests/gguf/test_models.py's bound).
GPU_POLICY_TOLERANCE = 0.1


@pytest.mark.parametrize("family", slow_but(DENSE_FAMILIES, ("phi3", "gemma2", "apertus")))
def test_gpu_policy_serves_the_q8_0_file_as_affine_weights(family: str) -> None:
    """Metal/CUDA's policy (exercised on the CPU): the matrices become MLX affine layers, the rest
    float16, Gemma 2's norm shift and Apertus's metadata constants included."""
    path = ensure_gguf(family, "tiny", "q8_0", cache_dir=MODEL_CACHE)
    model, _, _, summary = load_gguf(str(path), on_cpu=False)
    expanded, *_ = load_gguf(str(path), on_cpu=True, blocks=False)
    assert summary.compute_dtype == "float16" and set(summary.precision) == {"affine q8_0", "float16"}
    ids = [5, 17, 300, 42, 1000, 7, 8, 9, 10, 11, 12, 13]
    diff = mx.abs(model(mx.array([ids])).astype(mx.float32) - expanded(mx.array([ids]))).max().item()
    assert diff <= GPU_POLICY_TOLERANCE, (family, diff)


@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_engine_generates_greedily_from_the_gguf(family: str, directories: dict[str, tuple]) -> None:
    """Through the engine (prefill, decode steps, the attention and fusion levers): the directory's
    greedy tokens; where the CPU decode runtime cannot take the family, it says why."""
    reference, hf_tok = directories[family]
    ids = hf_tok.encode(PROMPT)
    harness = EngineHarness(ensure_gguf(family, "tiny", "f32", cache_dir=MODEL_CACHE), n_parallel=1)
    expected, gaps = greedy(reference, ids, banned=tuple(harness.tokenizer.eos_token_ids or ()))
    try:
        run = harness.run(ids, n_predict=N_GREEDY, ignore_eos=True, cache=False)
        loaded = harness.engine.loaded
        reason = cpu_decode.unsupported(loaded.model)  # what the start-up log says (model/loader.py)
    finally:
        harness.close()
    assert run.finish is not None and len(run.tokens) == N_GREEDY
    agree_where_clear(run.tokens, expected, gaps, 1e-3)
    assert (loaded.decoder is None) == bool(reason), reason


def test_exaone4_takes_sliding_windows_only_at_the_32b_layer_count(tmp_path) -> None:
    """llama.cpp runs EXAONE 4's sliding windows (three local layers with RoPE, one global without)
    only for the 32B's 64 layers; a 64-layer file with them loads as mlx-lm's model of that layout."""
    from mlxcel_compat.testing.families import model_config
    from mlxcel_compat.testing.gguf_writer import write_gguf
    from mlxcel_compat.testing.model_directory import write_model_directory
    from mlxcel_compat.testing.weights import seeded_weights

    config = model_config("exaone4", "tiny")
    n = 64
    config.update(num_hidden_layers=n, sliding_window=8, sliding_window_pattern="LLLG",
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)])
    weights = seeded_weights("exaone4", "tiny", config)
    directory = tmp_path / "exaone4-64"
    directory.mkdir()
    write_model_directory(directory, "exaone4", "tiny", weights, config)
    path = write_gguf("exaone4", "tiny", tmp_path / "exaone4-64.gguf", model_dir=directory, weights=weights,
                      config=config)[0]
    model, _, loaded_config, _ = load_gguf(str(path), on_cpu=True)
    assert loaded_config["sliding_window"] == 8 and loaded_config["sliding_window_pattern"] == "LLLG" * 16
    reference, tok = load(str(directory))
    ids = tok.encode(PROMPT)  # past the window of 8
    assert mx.abs(model(mx.array([ids])) - reference(mx.array([ids]))).max().item() <= F32_TOLERANCE


def relabel(source: Path, out: Path, architecture: str) -> Path:
    """A copy of an F32 GGUF whose ``general.architecture`` (and ``{arch}.*`` keys) name another
    architecture: a file of an architecture no row serves."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    old = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = architecture + name[len(old):] if name.startswith(f"{old}.") else name
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_an_architecture_without_a_row_is_served_by_mlx_lms_class_of_its_name(caplog) -> None:
    """EXAONE 3.5 (``exaone``) has no row: its mlx-lm class of that name takes the shared config,
    gguf-py's tensor names and the file's Llama 3 RoPE factors (the family's tests above compare
    its logits with the directory's); the log says it was served generically."""
    assert "exaone" not in gguf_arch.ARCHITECTURES
    with caplog.at_level("WARNING"):
        _, _, config, summary = load_gguf(str(ensure_gguf("exaone", "tiny", "f32", cache_dir=MODEL_CACHE)),
                                          on_cpu=True)
    assert summary.architecture == "exaone" and config["model_type"] == "exaone"
    assert "served generically by mlx-lm's 'exaone' model" in caplog.text


@pytest.mark.parametrize("architecture, reason", [
    ("internlm2", "mlx-lm's 'internlm2' model does not fit it through the generic path"),
    ("made-up-arch", "no row serves it and mlx-lm has no model class of that name"),
])
def test_an_architecture_that_does_not_fit_is_refused_by_name(architecture: str, reason: str, tmp_path: Path) -> None:
    """mlx-lm's internlm2 wants a fused ``attn_qkv`` the file lacks; no mlx-lm module is called
    ``made-up-arch``. Either way start-up stops naming the architecture and the served ones."""
    path = relabel(ensure_gguf("exaone", "tiny", "f32", cache_dir=MODEL_CACHE), tmp_path / "x.gguf", architecture)
    with pytest.raises(UnsupportedArchitecture) as error:
        load_gguf(str(path), on_cpu=True)
    message = str(error.value)
    assert f"GGUF architecture '{architecture}' is not supported" in message and reason in message
    assert f"(supported: {', '.join(gguf_arch.SUPPORTED_ARCHITECTURES)})" in message


def test_mistral3_without_the_temperature_is_plain_llama(tmp_path: Path) -> None:
    """A ``mistral3`` file as the converter writes Mistral Small 3.x (no YaRN, no
    ``attention.temperature_scale``) loads with the temperature's beta at 0: llama's logits."""
    from mlxcel_compat.testing.families import model_config
    from mlxcel_compat.testing.gguf_writer import write_gguf
    from mlxcel_compat.testing.model_directory import write_model_directory
    from mlxcel_compat.testing.weights import seeded_weights

    config = model_config("ministral3", "tiny")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "llama_4_scaling_beta": 0.0,
                                 "original_max_position_embeddings": config["max_position_embeddings"]}
    weights = seeded_weights("ministral3", "tiny", config)
    directory = tmp_path / "mistral-small"
    directory.mkdir()
    write_model_directory(directory, "ministral3", "tiny", weights, config)
    path = write_gguf("ministral3", "tiny", tmp_path / "mistral-small.gguf", model_dir=directory, weights=weights,
                      config=config)[0]
    model, _, loaded_config, _ = load_gguf(str(path), on_cpu=True)
    assert loaded_config["rope_parameters"]["llama_4_scaling_beta"] == 0.0
    assert "factor" not in loaded_config["rope_parameters"]
    reference, tok = load(str(directory))
    ids = tok.encode(PROMPT)
    assert mx.abs(model(mx.array([ids])) - reference(mx.array([ids]))).max().item() <= F32_TOLERANCE
