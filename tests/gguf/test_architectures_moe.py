"""The mixture-of-experts architectures served from GGUF (``gguf/arch_moe.py``) load as the same
model as the factory's directory of their family (``testing/families_moe.py``).

For every MoE family, on the factory's own GGUF writer (which writes what llama.cpp's converter
writes; the converter itself is run against it by a script, not here):

- F32: the same token ids and rendered chat prompt as the directory, logits bit-exact against
  mlx-lm on the directory (the same float32 weights through the same mlx-lm class: nothing may
  differ) and the same greedy tokens;
- Q8_0: attention and dense matrices and the stacked expert tensors stay in the file's blocks
  (the experts as one block weight per stack, only the chosen experts' rows computed:
  ``runtime/block_experts.py``), none copied; the file's float32 expansion (``blocks=False``)
  equals the directory with its matrices passed through the same Q8_0 encoding (to 1e-4:
  float32 sums over identical weights), and the block layers' 8-bit activations stay within
  ``BLOCKS_RELATIVE_RMS`` of it;
- Q4_K_M (the tiny rows take llama-quantize's fallback types) likewise, and a prompt split in two
  chunks gives the logits of the whole prompt;
- a greedy generation through the engine on the F32 file gives the directory's greedy tokens,
  with MLX's decode step (the CPU decode runtime names the MoE layers as the reason);
- files mlx-lm's classes cannot serve as llama.cpp does are refused with the reason, and a
  GLM file's NextN layer is left out.
"""

from __future__ import annotations

import mmap
from functools import cache
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxcel_compat.gguf import architectures as gguf_arch
from mlxcel_compat.gguf.load import load_gguf
from mlxcel_compat.gguf.reader import open_gguf
from mlxcel_compat.runtime import cpu_decode
from mlxcel_compat.testing import families_moe
from mlxcel_compat.testing.gguf_tensors import GGUF_TARGETS, stored_type
from mlxcel_compat.testing.families import model_config
from mlxcel_compat.testing.gguf_metadata import add_hparams
from tests.conftest import slow_but, tiny_model
from tests.engine.harness import EngineHarness
from tests.gguf.reference_checks import assert_tokenizer_and_template_match

pytestmark = pytest.mark.engine

MOE_FAMILIES = tuple(f.name for f in families_moe.FAMILIES)
PROMPT = "The quick brown fox jumps over the lazy dog. def f(x: int) -> str:\n    return 'café 你好'"
TEXTS = [PROMPT, "  two spaces\n\ttab <|im_start|>user\nhi<|im_end|>", "<think>\nx\n</think>\n\n🚀 ✅"]
# Block layers multiply by 8-bit activations (llama.cpp's arithmetic) where the float32 expansion
# multiplies by float32 ones. On the tiny MoE models (logits within about +-5) that moves the
# prompt's logits by 0.05-0.1 at most, or up to 0.3 at a position where it moves a router across
# an expert choice, so the bound is on all the prompt's logits together: their RMS difference
# relative to their RMS, measured 0.005-0.025 (Q8_0; gpt-oss 0.041, its experts' clamped SwiGLU
# after 8-bit products); a wrong or misplaced tensor makes it order 1.
BLOCKS_RELATIVE_RMS = 0.05


@cache
def directory(family: str) -> tuple[Any, Any]:
    return load(str(tiny_model(family)))


def greedy(model: Any, prompt: list[int], n: int = 8) -> list[int]:
    cache_ = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache_)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache_)
    return out


def round_trip(weight: mx.array, gguf_name: str) -> mx.array:
    """A directory weight as the Q8_0 file holds it (the writer's stored type for its GGUF name)."""
    data = np.array(weight, dtype=np.float32)
    kind = stored_type(gguf_name, data.shape, "q8_0")
    if kind == "f32":
        return weight
    if kind == "f16":
        return mx.array(data.astype(np.float16).astype(np.float32))
    q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    return mx.array(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(data.shape))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_f32_gguf_is_the_directory_model(family: str) -> None:
    hf_model, hf_tok = directory(family)
    model, tokenizer, config, summary = load_gguf(str(tiny_model(f"{family}:f32")), on_cpu=True)
    assert summary.architecture == GGUF_TARGETS[family].arch
    assert config["model_type"] == hf_model.args.model_type
    n_tensors = len(open_gguf(tiny_model(f"{family}:f32")).tensors)
    joined = summary.precision.pop("float32 (joined from 2 tensors)", 0)  # DeepSeek-V2's kv_b_proj
    assert summary.precision == {"float32": n_tensors - 2 * joined}

    assert_tokenizer_and_template_match(tokenizer, hf_tok, TEXTS)

    ids = hf_tok.encode(PROMPT)
    assert mx.array_equal(model(mx.array([ids])), hf_model(mx.array([ids]))).item()
    assert greedy(model, ids) == greedy(hf_model, ids)


def relative_rms(got: mx.array, want: mx.array) -> float:
    return (mx.sqrt(((got - want) ** 2).sum()) / mx.sqrt((want ** 2).sum())).item()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_q8_0_gguf_keeps_matrices_and_experts_in_blocks(family: str) -> None:
    path = tiny_model(f"{family}:q8_0")
    file = open_gguf(path)
    stacks = [n for n, t in file.tensors.items() if gguf_arch.is_expert_stack(n)]
    assert stacks and all(file.tensors[n].ggml_type == gguf.GGMLQuantizationType.Q8_0 for n in stacks)
    model, _, config, summary = load_gguf(str(path), on_cpu=True)
    assert summary.precision["experts in blocks q8_0"] == len(stacks)
    assert summary.weight_bytes["experts in blocks q8_0"] == sum(file.tensors[n].n_bytes for n in stacks)
    assert summary.expanded_experts == {}
    assert summary.precision["blocks q8_0"] > 0

    expanded, _, _, reference_summary = load_gguf(str(path), on_cpu=True, blocks=False)
    assert reference_summary.expanded_experts == {"q8_0": len(stacks)}
    hf_model, hf_tok = directory(family)
    spec, params = gguf_arch.arch_spec(file), tree_flatten(hf_model.parameters())
    names = {m: g for g, m in gguf_arch.gguf_names(spec, [n for n, _ in params], config["num_hidden_layers"]).items()}
    joins = gguf_arch.joined_parameters(spec, [n for n, _ in params])

    def as_stored(name: str, weight: mx.array) -> mx.array:
        if name not in joins:
            return round_trip(weight, names[name])
        join, parts = joins[name]  # split as the converter splits it, each part through Q8_0
        pieces = GGUF_TARGETS[family].split(name, np.array(weight), config)
        return join.join([round_trip(mx.array(data), part) for (_, data), part in zip(pieces, parts)], config)

    reference, _ = load(str(tiny_model(family)))
    reference.load_weights([(n, as_stored(n, w)) for n, w in params])
    ids = hf_tok.encode(PROMPT)
    want = reference(mx.array([ids]))
    assert mx.abs(expanded(mx.array([ids])) - want).max().item() <= 1e-4
    got = model(mx.array([ids]))
    relative = relative_rms(got, want)
    print(f"{family} q8_0: block layers' prompt logits within {mx.abs(got - want).max().item():.3g} of float32 "
          f"math, relative RMS {relative:.3g}")
    assert relative <= BLOCKS_RELATIVE_RMS


# Q4_K_M on every family with --slow; by default on the families whose expert layers differ most
# (SwiGLU, gpt-oss's clamped SwiGLU with expert biases, LFM2's).
Q4_FAMILIES = ("qwen3_moe", "gpt_oss", "lfm2_moe")


@pytest.mark.parametrize("family", slow_but(MOE_FAMILIES, Q4_FAMILIES))
def test_q4_k_m_gguf_experts_in_blocks_agree_with_the_float32_expansion(family: str) -> None:
    """The tiny models' expert rows (64 values) are too short for K-quants: llama-quantize's
    fallbacks (Q4_0-Q8_0 by row length) are what a Q4_K_M file holds there, and they stay in
    their blocks too. Served with experts in blocks, the file agrees with its own float32
    expansion (``blocks=False``) within the 8-bit-activation bound, and a greedy generation
    through the expert layers is deterministic whatever the prompt's chunking (the layer's rows do
    not depend on each other)."""
    path = tiny_model(f"{family}:q4_k_m")
    file = open_gguf(path)
    stacks = [n for n in file.tensors if gguf_arch.is_expert_stack(n)]
    model, tokenizer, _, summary = load_gguf(str(path), on_cpu=True)
    in_blocks = {label: n for label, n in summary.precision.items() if label.startswith("experts in blocks")}
    assert sum(in_blocks.values()) == len(stacks) and summary.expanded_experts == {}
    expanded, *_ = load_gguf(str(path), on_cpu=True, blocks=False)
    ids = tokenizer.encode(PROMPT)
    got, want = model(mx.array([ids])), expanded(mx.array([ids]))
    relative = relative_rms(got, want)
    print(f"{family} q4_k_m ({', '.join(in_blocks)}): relative RMS {relative:.3g} against float32 math")
    assert relative <= BLOCKS_RELATIVE_RMS
    # The same tokens split into two chunks give the same logits at every position, to float32
    # rounding: with a prompt cache, the first chunk's KV feeds the second, and the MoE layers'
    # rows are per token whatever else shares their group (bit for bit: test_block_experts.py).
    # Measured 0 on qwen3_moe and gpt_oss; up to 4e-6 where the dense parts' float32 sums round
    # by the chunk's row count (the engine splits cold runs and hits on one grid for that).
    cache_ = make_prompt_cache(model)
    split = mx.concatenate([model(mx.array([ids[:9]]), cache=cache_), model(mx.array([ids[9:]]), cache=cache_)],
                           axis=1)
    assert mx.abs(split - got).max().item() <= 1e-4


def test_expert_stacks_hold_the_file_s_bytes_once() -> None:
    """No expert stack is held twice: each layer's block weight is a view of the file's memory map
    (its bytes the tensor's bytes in the file), or, where the loader grouped its rows for the
    shim's lanes (``block_weight.group_rows``: Q8_0 stacks whose experts are whole groups of 16
    rows, as here), a copy whose rows are the tensor's rows, the file's pages of it dropped; the
    model's MLX parameters hold no expert weight."""
    from mlxcel_compat.runtime.block_experts import BlockSwitchLinear
    from mlxcel_compat.runtime.block_weight import ungrouped_rows

    path = tiny_model("qwen3_moe:q8_0")
    file = open_gguf(path)
    model, *_ = load_gguf(str(path), on_cpu=True)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, BlockSwitchLinear)]
    stacks = {n: file.tensors[n] for n in file.tensors if gguf_arch.is_expert_stack(n)}
    assert len(layers) == len(stacks) > 0
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    by_bytes = {raw[t.offset:t.offset + t.n_bytes].tobytes(): t.offset for t in stacks.values()}
    offsets = set()
    for _, layer in layers:
        weight = layer.block
        if weight.grouped:
            rows = ungrouped_rows(weight.data, weight.ggml_type, np.arange(weight.n)).tobytes()
            assert rows in by_bytes  # the tensor's rows, rearranged only
            offsets.add(by_bytes[rows])
            continue
        root = weight.data
        while isinstance(root.base, np.ndarray):
            root = root.base
        assert isinstance(root.base.obj, mmap.mmap) and root.size == path.stat().st_size  # the file's map
        assert not root.flags.writeable
        offsets.add(weight.data.ctypes.data - root.ctypes.data)
    assert any(layer.block.grouped for _, layer in layers)
    assert offsets == {t.offset for t in stacks.values()}
    assert sum(layer.block.nbytes for _, layer in layers) == sum(t.n_bytes for t in stacks.values())
    params = dict(tree_flatten(model.parameters()))
    assert not any(("switch_mlp." in name or ".experts." in name) and name.endswith(".weight") for name in params)


# The engine test starts an engine per family: by default on the families whose caches differ
# (plain KV, gpt-oss's rotating windows, MLA's latent, LFM2's convolutions); the rest with --slow.
ENGINE_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3", "lfm2_moe")


@pytest.mark.parametrize("family", slow_but(MOE_FAMILIES, ENGINE_FAMILIES))
def test_engine_generates_the_directory_greedy_tokens(family: str) -> None:
    hf_model, hf_tok = directory(family)
    prompt = hf_tok.encode(PROMPT)
    h = EngineHarness(tiny_model(f"{family}:f32"))
    try:
        decoder = h.engine.loaded.decoder  # the F32 file's float32 experts on the runtime (expert_f32.c)
        assert decoder is not None, cpu_decode.unsupported(h.engine.loaded.model)
        steps = decoder.steps
        run = h.run(prompt, n_predict=8, ignore_eos=True, cache=False)
        assert run.tokens == greedy(hf_model, prompt)
        assert decoder.steps >= steps + 7
    finally:
        h.close()


def rewritten(source: Any, target: Any, keys: dict[str, Any] | None = None,
              extra: dict[str, np.ndarray] | None = None, extra_keys: dict[str, bool] | None = None) -> Any:
    """A copy of a GGUF with some ``{arch}.*`` keys replaced (same value type), boolean keys
    added (``extra_keys``) and tensors added."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            value = (keys or {}).get(key.removeprefix(f"{arch}."), field.contents())
            writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for key, flag in (extra_keys or {}).items():
        writer.add_bool(f"{arch}.{key}", flag)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_deepseek2_files_are_served_by_their_router_or_refused_by_name(tmp_path) -> None:
    """A deepseek2 file is DeepSeek-V3's (sigmoid router: mlx-lm's deepseek_v3) or V2's (softmax:
    deepseek_v2, MLA's kv_b joined back from the converter's halves). A V2 router mlx-lm's class
    would run otherwise than llama.cpp (renormalised, or in groups, which llama.cpp ranks by V3's
    rule), and files from before llama.cpp split kv_b, are refused with the reason."""
    v3, v2 = tiny_model("deepseek_v3:f32"), tiny_model("deepseek_v2:f32")
    assert load_gguf(str(v3), on_cpu=True)[2]["model_type"] == "deepseek_v3"
    model, _, config, summary = load_gguf(str(v2), on_cpu=True)
    assert config["model_type"] == "deepseek_v2" and "expert_gating_func" not in str(gguf.GGUFReader(v2).fields)
    assert summary.precision["float32 (joined from 2 tensors)"] == config["num_hidden_layers"]
    normalised = rewritten(v2, tmp_path / "norm.gguf", extra_keys={"expert_weights_norm": True})
    with pytest.raises(gguf_arch.UnsupportedArchitecture, match="expert_weights_norm has no mlx-lm equivalent"):
        load_gguf(str(normalised), on_cpu=True)
    grouped = rewritten(v3, tmp_path / "groups.gguf", keys={"expert_gating_func": 1, "expert_weights_norm": False})
    with pytest.raises(gguf_arch.UnsupportedArchitecture, match="4 expert groups: llama.cpp ranks groups"):
        load_gguf(str(grouped), on_cpu=True)
    legacy = rewritten(v3, tmp_path / "legacy.gguf",
                       extra={"blk.0.attn_kv_b.weight": np.zeros((4 * 64, 64), np.float32)})
    with pytest.raises(gguf_arch.UnsupportedArchitecture, match="predates llama.cpp's MLA split"):
        load_gguf(str(legacy), on_cpu=True)


def test_ernie4_5_moe_with_a_selection_bias_is_refused_without_one_served(tmp_path) -> None:
    """llama.cpp chooses ERNIE's experts with the optional selection bias exp_probs_b; mlx-lm's
    ernie4_5_moe has none. A zero bias changes nothing (the same logits); any other is refused."""
    source = tiny_model("ernie4_5_moe:f32")
    n_expert = int(gguf.GGUFReader(source).fields["ernie4_5-moe.expert_count"].contents())
    zero = rewritten(source, tmp_path / "zero.gguf", extra={"blk.1.exp_probs_b.bias": np.zeros(n_expert, np.float32)})
    model, *_ = load_gguf(str(zero), on_cpu=True)
    plain, *_ = load_gguf(str(source), on_cpu=True)
    ids = [5, 6, 7, 8, 9]
    assert mx.array_equal(model(mx.array([ids])), plain(mx.array([ids]))).item()
    biased = rewritten(source, tmp_path / "biased.gguf",
                       extra={"blk.1.exp_probs_b.bias": np.full(n_expert, 0.01, np.float32)})
    with pytest.raises(gguf_arch.UnsupportedArchitecture, match=r"expert selection bias \(blk.1.exp_probs_b.bias"):
        load_gguf(str(biased), on_cpu=True)


def test_glm4moe_nextn_layers_are_left_out(tmp_path, caplog) -> None:
    """A GLM-4.5 file counts its NextN (multi-token prediction) layer in block_count and carries
    its tensors (blk.N.nextn.*, and a decoder layer's under N): the model is the first
    block_count - nextn_predict_layers layers, and the extra tensors are named as left out."""
    import logging

    source = tiny_model("glm4_moe:f32")
    reader = gguf.GGUFReader(source)
    n_layers = int(reader.fields["glm4moe.block_count"].contents()) - 1
    assert int(reader.fields["glm4moe.nextn_predict_layers"].contents()) == 1
    hidden = int(reader.fields["glm4moe.embedding_length"].contents())
    last = f"blk.{n_layers - 1}."
    extra = {t.name.replace(last, f"blk.{n_layers}."): np.array(t.data) for t in reader.tensors
             if t.name.startswith(last)}
    extra[f"blk.{n_layers}.nextn.eh_proj.weight"] = np.ones((hidden, 2 * hidden), np.float32)
    extra[f"blk.{n_layers}.nextn.enorm.weight"] = np.ones(hidden, np.float32)
    rewritten(source, tmp_path / "nextn.gguf", extra=extra)

    with caplog.at_level(logging.INFO, logger="mlxcel_compat.gguf.load"):
        model, _, config, _ = load_gguf(str(tmp_path / "nextn.gguf"), on_cpu=True)
    assert config["num_hidden_layers"] == n_layers == len(model.layers)
    assert f"{len(extra)} tensors of the layers past the model's {n_layers}" in caplog.text
    assert "without a counterpart" not in caplog.text
    plain, *_ = load_gguf(str(source), on_cpu=True)
    ids = [5, 6, 7, 8, 9]
    assert mx.array_equal(model(mx.array([ids])), plain(mx.array([ids]))).item()


# Keys llama.cpp's converter (b11312) does not write for these families, found by
# scripts/check_gguf_architectures.py comparing its file with the factory writer's: llama.cpp takes
# the vocabulary size from the token list and the head sizes from hidden size / heads.
CONVERTER_OMITS = {
    "qwen3_moe": ("vocab_size",),
    "gpt_oss": ("vocab_size",),
    "glm4_moe": ("vocab_size",),
    "ernie4_5_moe": ("vocab_size",),
    "qwen2_moe": ("vocab_size", "attention.key_length", "attention.value_length"),
    "olmoe": ("vocab_size", "attention.key_length", "attention.value_length"),
}


@pytest.mark.parametrize("family", sorted(CONVERTER_OMITS))
def test_the_writer_leaves_out_what_the_converter_leaves_out(family: str) -> None:
    """The factory's ``{arch}.*`` keys are the converter's: none of the ones it leaves out (the
    loader builds the directory's model without them: test_f32_gguf_is_the_directory_model)."""
    arch = GGUF_TARGETS[family].arch
    writer = gguf.GGUFWriter(None, arch)
    add_hparams(writer, family, model_config(family, "tiny"))
    written = {key for shard in writer.kv_data for key in shard}
    assert f"{arch}.block_count" in written
    assert [key for key in CONVERTER_OMITS[family] if f"{arch}.{key}" in written] == []
