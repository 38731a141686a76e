"""Hybrid and recurrent GGUF architectures: the factory's GGUF of each family loads as its directory.

For every family of ``testing/families_hybrid.py`` (tiny sizes):

- F32: token ids and the rendered chat prompt equal the directory's; the logits over a short
  prompt equal mlx-lm's on the directory to float32 rounding (``F32_TOLERANCE``: the undo steps
  that compute, such as ``A_log = log(-(-exp(A_log)))``, round once), and greedy tokens agree;
- Q8_0: every parameter of the float32 expansion (``load_gguf(..., blocks=False)``) is within
  Q8_0's rounding of the directory's (half a step of its block's scale, ``max|w| / 254``, and
  the scale's float16 rounding), which
  a wrong row or column order would break by the size of the weights themselves; the model
  served from the blocks agrees with that expansion within ``PROMPT_8BIT`` (a prompt with
  8-bit activations, as llama.cpp computes it) and ``DECODE_8BIT`` (teacher-forced decode steps);
- stacked expert tensors (``ffn_*_exps``) stay in the file's blocks (``runtime/block_experts.py``:
  only the chosen experts' rows are computed), none expanded (``GGUFSummary.expanded_experts``);
- a greedy generation through the engine on the F32 file gives mlx-lm's greedy tokens, and on
  the Q8_0 file runs to its length.

Against llama.cpp itself (its converter on the same directory, llama-server on the result): see
docs/gguf.md's architectures table and the command there.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxcel_compat.gguf.load import load_gguf
from mlxcel_compat.gguf.reader import open_gguf
from mlxcel_compat.gguf.stored_parts import FusedGateUpSwitchGLU, StoredPartsLinear
from mlxcel_compat.testing import families_hybrid
from mlxcel_compat.testing.gguf_writer import ensure_gguf
from tests.conftest import MODEL_CACHE, tiny_model
from tests.engine.harness import EngineHarness
from tests.gguf.reference_checks import assert_tokenizer_and_template_match

pytestmark = pytest.mark.engine

FAMILIES = tuple(families_hybrid.GGUF_TARGETS)
PROMPT = "The quick brown fox jumps over the lazy dog. def f(x: int) -> str:\n    return 'café 你好'"
TEXTS = [PROMPT, "  two spaces\n\ttab <|im_start|>user\nhi<|im_end|>", "<think>\nx\n</think>\n\n🚀 ✅"]
# F32 logits against mlx-lm on the directory (logits of the tiny models span about +-4).
F32_TOLERANCE = {"qwen3_next": 1e-5, "qwen3_5": 1e-5, "qwen3_5_moe": 1e-5, "gemma4_text": 1e-5,
                 "gemma4_text_moe": 1e-5, "granitemoehybrid": 1e-5, "nemotron_h": 1e-5}
# Blocks against their float32 expansion, measured on the tiny models (prompt: qwen3_5 0.58,
# qwen3_next 0.42, qwen3_5_moe 0.62, gemma4_text 0.48, gemma4_text_moe 0.17, nemotron_h 0.21, granitemoehybrid 0.006:
# its logits are divided by 6): 8-bit activations, and a recurrent state that sums every token's rounding.
PROMPT_8BIT = {"qwen3_next": 1.0, "qwen3_5": 1.0, "qwen3_5_moe": 1.0, "gemma4_text": 1.0, "gemma4_text_moe": 1.0,
               "granitemoehybrid": 0.1, "nemotron_h": 1.0}
DECODE_8BIT = {"qwen3_next": 1.0, "qwen3_5": 1.0, "qwen3_5_moe": 1.0, "gemma4_text": 1.0, "gemma4_text_moe": 1.0,
               "granitemoehybrid": 0.1, "nemotron_h": 1.0}


@pytest.fixture(scope="module")
def directories() -> dict[str, tuple]:
    return {family: load(str(tiny_model(family))) for family in FAMILIES}


def _greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_equals_the_directory(family: str, directories: dict[str, tuple]) -> None:
    reference, hf_tok = directories[family]
    model, tokenizer, config, summary = load_gguf(str(ensure_gguf(family, "tiny", "f32", cache_dir=MODEL_CACHE)),
                                                  on_cpu=True)
    assert summary.architecture == families_hybrid.GGUF_TARGETS[family].arch
    assert config["model_type"] == reference.model_type
    assert_tokenizer_and_template_match(tokenizer, hf_tok, TEXTS)

    ids = hf_tok.encode(PROMPT)
    diff = mx.abs(model(mx.array([ids])) - reference(mx.array([ids]))).max().item()
    assert diff <= F32_TOLERANCE[family], diff
    assert _greedy(model, ids) == _greedy(reference, ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_gguf_holds_the_directory_weights_in_order(family: str, directories: dict[str, tuple]) -> None:
    reference, hf_tok = directories[family]
    path = str(ensure_gguf(family, "tiny", "q8_0", cache_dir=MODEL_CACHE))
    expanded, *_ = load_gguf(path, on_cpu=True, blocks=False)
    want = dict(tree_flatten(reference.parameters()))
    got = dict(tree_flatten(expanded.parameters()))
    for where, module in expanded.named_modules():  # a fused layer the file stores split (stored_parts.py)
        if isinstance(module, StoredPartsLinear):
            got = {k: v for k, v in got.items() if not k.startswith(f"{where}.parts.")}
            got[f"{where}.weight"] = module.fused_weight()
        if isinstance(module, FusedGateUpSwitchGLU):  # the file's fused expert gate_up (gate rows first)
            got[f"{where}.gate_proj.weight"], got[f"{where}.up_proj.weight"] = mx.split(
                got.pop(f"{where}.gate_up_proj.weight"), 2, axis=1)
    assert set(got) == set(want)
    for name, w in want.items():
        # Half a Q8_0 step of the largest block, plus its float16 scale's rounding (2^-11 of 127 steps).
        step = float(mx.abs(w).max().item()) * (1 / 254 + 1 / 2048) + 1e-6
        assert mx.abs(got[name] - w).max().item() <= step, name

    model, _, config, summary = load_gguf(path, on_cpu=True)
    assert "blocks q8_0" in summary.precision  # the matrices are served from the file's blocks
    # Stacked experts (ffn_*_exps) stay in the file's blocks too (block_experts.py), none expanded.
    stacked = sum(len(t.shape) == 3 for t in open_gguf(path).tensors.values())
    assert (stacked > 0) == bool(config.get("num_experts") or config.get("num_local_experts"))
    assert summary.precision.get("experts in blocks q8_0", 0) == stacked and summary.expanded_experts == {}
    ids = hf_tok.encode(PROMPT)
    diff = mx.abs(model(mx.array([ids])) - expanded(mx.array([ids]))).max().item()
    assert diff <= PROMPT_8BIT[family], diff
    caches = make_prompt_cache(model), make_prompt_cache(expanded)
    ours, theirs = model(mx.array([ids]), cache=caches[0]), expanded(mx.array([ids]), cache=caches[1])
    for _ in range(8):  # teacher-forced decode steps: the blocks' vec_dot against float32 math
        assert mx.abs(ours[0, -1] - theirs[0, -1]).max().item() <= DECODE_8BIT[family]
        token = int(mx.argmax(theirs[0, -1]).item())
        ours, theirs = model(mx.array([[token]]), cache=caches[0]), expanded(mx.array([[token]]), cache=caches[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_generates_from_the_gguf(family: str, directories: dict[str, tuple]) -> None:
    reference, hf_tok = directories[family]
    ids = hf_tok.encode(PROMPT)
    for gguf_type in ("f32", "q8_0"):
        harness = EngineHarness(ensure_gguf(family, "tiny", gguf_type, cache_dir=MODEL_CACHE))
        try:
            # Recurrent or sliding-window state cannot be cut to a prefix: the session-snapshot store.
            assert harness.stats()["snapshot_family"] is True
            run = harness.run(ids, n_predict=8, ignore_eos=True)
        finally:
            harness.close()
        assert run.finish is not None and len(run.tokens) == 8, gguf_type
        if gguf_type == "f32":
            assert run.tokens == _greedy(reference, ids)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in ("qwen3_5", "gemma4_text", "nemotron_h")])
def test_the_gpu_policy_keeps_the_undo_steps(family: str) -> None:
    """Metal/CUDA's policy, exercised on the CPU (dense families: MLX's CPU expert products take
    float32 only): quantized matrices become MLX affine layers with their rows in the model's order,
    and a matrix whose columns the file reorders (Qwen3.5's ``ssm_out``) is dequantized instead of
    taking an affine form whose groups run along those columns. float16 activations against the
    float32 expansion: within 0.25 (measured 0.05-0.11)."""
    path = str(ensure_gguf(family, "tiny", "q8_0", cache_dir=MODEL_CACHE))
    model, _, config, summary = load_gguf(path, on_cpu=False)
    reference, *_ = load_gguf(path, on_cpu=True, blocks=False)
    reordered = config.get("full_attention_interval") and sum(
        (i + 1) % config["full_attention_interval"] != 0 for i in range(config["num_hidden_layers"]))
    matrices = sum(len(t.shape) == 2 and t.ggml_type == 8 for t in open_gguf(path).tensors.values())  # Q8_0
    assert summary.precision["affine q8_0"] == matrices - (reordered or 0)
    ids = [1, 5, 9, 200, 33, 7, 8, 100, 42, 17, 256, 3]
    diff = mx.abs(model(mx.array([ids])).astype(mx.float32) - reference(mx.array([ids]))).max().item()
    assert diff < 0.25, diff


def test_the_small_sizes_are_benchmark_sized() -> None:
    """As the first families' (tests/testing/test_models.py): about 90M parameters, for benchmarks."""
    from mlxcel_compat.testing import models

    for family in (f.name for f in families_hybrid.FAMILIES):
        count = models.describe(family, "small")["num_parameters"]
        assert 88_000_000 <= count <= 100_000_000, (family, count)
