"""LoRA adapters served unfused, against a model whose weights this test fuses itself.

Each adapted linear adds ``scale * multiplier * B (A x)`` (``lora/layers.py``); the
reference is the same model with ``W + scale * multiplier * B @ A`` written into its weights
here. Unfused and fused differ only in float32 summation order: the logits agree to 2e-5 of
the largest, and greedy tokens are the same. Families: llama, qwen3 and gemma3 (sliding
windows), adapters as GGUF LoRA files, mlx-lm directories and PEFT directories, bases as
directories and GGUF files (float, and quantized blocks: there the reference's weights are the
blocks' float32 values, and decode steps quantize activations as llama.cpp does, hence a looser
bound on those).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.runtime import backend
from mlxcel_compat.runtime import cpu_decode
from mlxcel_compat.runtime.decode_kv import OwnedCache
from mlxcel_compat.runtime import lora_rows
from mlxcel_compat.runtime.block_layers import module_at
from mlxcel_compat.model.loader import load_model
from mlxcel_compat.lora.adapters import AdapterError, AdapterSet, AdapterSpec, inspect_adapter, parse_scaled
from mlxcel_compat.testing import adapters as factory
from tests.conftest import MODEL_CACHE, tiny_model

FAMILIES = ("llama", "qwen3", "gemma3_text")
PROMPT = [1, 5, 9, 200, 33, 7, 8, 100, 42, 17, 256, 3]
TOL = 2e-5  # of the largest logit: float32 summation order (unfused vs fused)


def adapter(family: str, fmt: str, **kw) -> Path:
    return factory.ensure_adapter(family, "tiny", fmt, cache_dir=MODEL_CACHE, **kw)


def adapters_of(*paths: Path, scales: tuple[float, ...] = ()) -> AdapterSet:
    return AdapterSet.from_specs([AdapterSpec(str(p), s) for p, s in zip(paths, scales or (1.0,) * len(paths))])


def fused(model_path: Path, family: str, scale: float, blocks: bool = True, **kw):
    """The base model with ``W + scale * multiplier * B @ A`` in its weights, and its decoder."""
    loaded = load_model(str(model_path), [])
    if not blocks:
        from mlxcel_compat.gguf.load import load_gguf

        loaded.model = load_gguf(str(model_path), blocks=False)[0]
    factors, multiplier = factory.adapter_factors(family, "tiny", **kw)
    for path, (a, b) in factors.items():
        module = module_at(loaded.model, path)
        module.weight = module.weight + np.float32(scale * multiplier) * (mx.array(b) @ mx.array(a))
    mx.eval(loaded.model.parameters())
    return loaded.model, cpu_decode.build(loaded.model, backend.matmul_shim())


def prefill_logits(model, tokens: list[int], rows=None) -> np.ndarray:
    with lora_rows.applied(rows):
        return np.array(model(mx.array([tokens]), cache=make_prompt_cache(model))[0])


def decode(model, decoder, tokens: list[int], steps: int, scales=None) -> tuple[list[int], list[np.ndarray]]:
    """Prefill all but the last token through MLX, then greedy steps through the CPU runtime."""
    cache = make_prompt_cache(model)
    with lora_rows.applied(None if scales is None else [scales]):
        model(mx.array([tokens[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    owned, token, out, logits = OwnedCache(), tokens[-1], [], []
    for _ in range(steps):
        row = decoder.step(token, cache, owned, scales).copy()
        token = int(np.argmax(row))
        out.append(token)
        logits.append(row)
    return out, logits


def assert_close(ours: np.ndarray, theirs: np.ndarray, tol: float = TOL) -> None:
    err = float(np.max(np.abs(ours - theirs)))
    assert err <= tol * float(np.max(np.abs(theirs))), err


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["gguf", "mlx"])
def test_adapted_model_equals_the_fused_model(family: str, fmt: str) -> None:
    base = tiny_model(family)
    loaded = load_model(str(base), [], adapters=adapters_of(adapter(family, fmt)).adapters)
    assert loaded.n_adapted == 7 * loaded.config["num_hidden_layers"] and loaded.decoder is not None
    scale = 0.75
    ref_model, ref_decoder = fused(base, family, scale)
    ours = prefill_logits(loaded.model, PROMPT, [(scale,)])
    theirs = prefill_logits(ref_model, PROMPT)
    assert_close(ours, theirs)
    plain = prefill_logits(load_model(str(base), []).model, PROMPT)
    assert np.max(np.abs(plain - theirs)) > 0.5  # the adapter matters ...
    # ... and scale 0 is exactly the base model's arithmetic (compiled MLPs included).
    assert np.array_equal(prefill_logits(loaded.model, PROMPT, [(0.0,)]), plain)
    assert np.array_equal(prefill_logits(loaded.model, PROMPT[:1], [(0.0,)]), prefill_logits(load_model(str(base), []).model, PROMPT[:1]))
    tokens, logits = decode(loaded.model, loaded.decoder, PROMPT, 6, (scale,))
    ref_tokens, ref_logits = decode(ref_model, ref_decoder, PROMPT, 6)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        assert_close(a, b)


def test_peft_directory_and_a_quantized_gguf_adapter_read_the_same_factors() -> None:
    base = tiny_model("llama")
    ref_model, _ = fused(base, "llama", 1.0)
    theirs = prefill_logits(ref_model, PROMPT)
    peft = load_model(str(base), [], adapters=adapters_of(adapter("llama", "peft")).adapters)
    assert_close(prefill_logits(peft.model, PROMPT, [(1.0,)]), theirs)
    # Q8_0 factors (B's 8-value rows are not whole blocks: F16, as the converter falls back).
    q8 = load_model(str(base), [], adapters=adapters_of(adapter("llama", "gguf", gguf_type="q8_0")).adapters)
    assert_close(prefill_logits(q8.model, PROMPT, [(1.0,)]), theirs, 2e-2)


@pytest.mark.parametrize("gguf_type", ["f32", "q8_0"])
def test_gguf_base_with_a_gguf_adapter(gguf_type: str) -> None:
    """llama's Q/K rows are permuted in both files; quantized bases keep their blocks (BlockLinear)."""
    base = tiny_model(f"llama:{gguf_type}")
    loaded = load_model(str(base), [], adapters=adapters_of(adapter("llama", "gguf")).adapters)
    assert loaded.decoder is not None
    ref_model, ref_decoder = fused(base, "llama", 0.5, blocks=gguf_type == "f32")
    # Q8_0 blocks quantize the activations to Q8_0, in decode steps (llama.cpp's vec_dot) and
    # prompts (its mul_mat) alike; the float32 reference does not (measured: 1.6e-2 of the
    # largest logit for the prompt, 2.1e-2 for steps over its KV).
    tol = TOL if gguf_type == "f32" else 3e-2
    assert_close(prefill_logits(loaded.model, PROMPT, [(0.5,)]), prefill_logits(ref_model, PROMPT), tol)
    tokens, logits = decode(loaded.model, loaded.decoder, PROMPT, 4, (0.5,))
    ref_tokens, ref_logits = decode(ref_model, ref_decoder, PROMPT, 4)
    for a, b in zip(logits, ref_logits):
        assert_close(a, b, tol)
    if gguf_type == "f32":
        assert tokens == ref_tokens


def test_two_adapters_and_per_row_scales_in_one_batch() -> None:
    base = tiny_model("qwen3")
    second = adapter("qwen3", "mlx", seed=7)
    loaded = load_model(str(base), [], adapters=adapters_of(adapter("qwen3", "gguf"), second).adapters)
    rows = [(0.0, 0.0), (1.0, 0.0), (0.5, 2.0)]
    # MLX path: a batch whose rows have different scales computes each adapted row as a batch of
    # the same shape whose rows all have that row's scales (bit for bit), and every row close to
    # the row alone. (A batch with no adapter active runs the compiled MLPs of the base model,
    # which round a little differently from the plain ones an adapted batch runs.)
    def batch(scales) -> np.ndarray:
        with lora_rows.applied(scales):
            return np.array(loaded.model(mx.array([PROMPT] * 3), cache=make_prompt_cache(loaded.model)))

    mixed = batch(rows)
    for i, row in enumerate(rows):
        if any(row):
            assert np.array_equal(mixed[i], batch([row] * 3)[i]), i
        assert_close(mixed[i], prefill_logits(loaded.model, PROMPT, [row]))
    assert np.max(np.abs(mixed[2] - mixed[1])) > 0.5
    # CPU decode runtime: rows stepped together are bit-identical to rows stepped alone.
    caches = []
    for row in rows:
        cache = make_prompt_cache(loaded.model)
        with lora_rows.applied([row]):
            loaded.model(mx.array([PROMPT[:-1]]), cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    import copy

    alone_caches = [copy.deepcopy(c) for c in caches]
    owned = [OwnedCache() for _ in rows]
    together = loaded.decoder.step_rows([PROMPT[-1]] * 3, caches, owned, rows).copy()
    for i, row in enumerate(rows):
        alone = loaded.decoder.step(PROMPT[-1], alone_caches[i], OwnedCache(), row)
        assert np.array_equal(together[i], alone), i
    base_only = load_model(str(base), [])
    base_cache = make_prompt_cache(base_only.model)
    base_only.model(mx.array([PROMPT[:-1]]), cache=base_cache)
    assert np.array_equal(together[0], base_only.decoder.step(PROMPT[-1], base_cache, OwnedCache()))


def test_an_adapter_that_does_not_fit_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    llama = tiny_model("llama")
    # An mlx-lm adapter of gemma3 (4 layers) names layers llama (2 layers) does not have.
    with pytest.raises(AdapterError, match=r"model\.layers\.[23]\..*lora_a|model\.layers\.[23]"):
        load_model(str(llama), [], adapters=adapters_of(adapter("gemma3_text", "mlx")).adapters)
    # A GGUF adapter for another architecture.
    with pytest.raises(AdapterError, match="architecture 'qwen3'.*'llama'"):
        load_model(str(llama), [], adapters=adapters_of(adapter("qwen3", "gguf")).adapters)
    # A factor of the wrong width: the message names the tensor and both shapes.
    bad = tmp_path / "bad"
    bad.mkdir()
    source = adapter("llama", "mlx")
    tensors = dict(mx.load(str(source / "adapters.safetensors")))
    tensors["model.layers.1.mlp.down_proj.lora_a"] = mx.zeros((64, 8))  # down_proj's input is 192 wide
    mx.save_safetensors(str(bad / "adapters.safetensors"), tensors)
    (bad / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    with pytest.raises(AdapterError, match=r"'model\.layers\.1\.mlp\.down_proj'.*in 192"):
        load_model(str(llama), [], adapters=adapters_of(bad).adapters)
    # A half pair.
    del tensors["model.layers.1.mlp.down_proj.lora_a"]
    mx.save_safetensors(str(bad / "adapters.safetensors"), tensors)
    with pytest.raises(AdapterError, match="model.layers.1.mlp.down_proj.lora_b' has no matching"):
        load_model(str(llama), [], adapters=AdapterSet.from_specs([AdapterSpec(str(bad))]).adapters)


def test_files_that_are_not_adapters_are_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="does not exist"):
        inspect_adapter(0, str(tmp_path / "missing.gguf"))
    with pytest.raises(AdapterError, match="general.type is None|general.type is 'model'"):
        inspect_adapter(0, str(tiny_model("llama:f32")))  # a model, not an adapter
    (tmp_path / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "dora"}))
    (tmp_path / "adapters.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match="fine_tune_type 'dora'"):
        inspect_adapter(0, str(tmp_path))


def test_the_set_follows_llama_server_rules() -> None:
    a, b = adapter("llama", "gguf"), adapter("llama", "mlx")
    aset = AdapterSet.from_specs([AdapterSpec(str(a)), AdapterSpec(str(b), 0.5)])
    assert aset.scales == (1.0, 0.5)
    assert AdapterSet.from_specs([AdapterSpec(str(a))], init_without_apply=True).scales == (0.0,)
    # construct_lora_list: listed ids take their scale, the others 0; bad ids and types ignored.
    assert aset.from_entries([{"id": 1, "scale": 0.25}]) == (0.0, 0.25)
    assert aset.from_entries([{"id": 7, "scale": 1}, {"id": "0", "scale": 2}, {"id": 0}, 3]) == (0.0, 0.0)
    assert aset.for_request([]) == aset.scales and aset.for_request(None) == aset.scales
    # lora_id: empty for the base model; changes with every non-zero scale; ignores zeros' ids.
    assert aset.lora_id((0.0, 0.0)) == ""
    ids = {aset.lora_id(s) for s in [(1.0, 0.0), (0.5, 0.0), (0.0, 1.0), (1.0, 1.0)]}
    assert len(ids) == 4 and all(i.startswith("lora:") for i in ids)
    assert aset.lora_id((1.0, 0.0)) == adapters_of(a).lora_id((1.0,))  # identity, not position or path
    assert aset.lora_id((1.0, 0.0)) != adapters_of(adapter("llama", "gguf", seed=7)).lora_id((1.0,))
    assert aset.listing()[1] == {"id": 1, "path": str(b), "scale": 0.5, "task_name": "", "prompt_prefix": ""}
    assert parse_scaled("x.gguf:0.5").scale == 0.5
    with pytest.raises(ValueError, match="FNAME:SCALE"):
        parse_scaled("x.gguf")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_prefill_chunk_through_the_runtime_applies_the_adapter(family: str) -> None:
    """A hit's rest fed by ``CpuDecoder.prefill`` (a prompt chunk through the runtime, the head
    on the last row) with an adapter's scale: the fused model's last logits, within TOL."""
    base = tiny_model(family)
    loaded = load_model(str(base), [], adapters=adapters_of(adapter(family, "gguf")).adapters)
    ref_model, _ = fused(base, family, 0.75)
    head, rest = PROMPT[:5], PROMPT[5:] * 3  # 5 adopted, 21 to prefill
    cache = make_prompt_cache(loaded.model)
    with lora_rows.applied([(0.75,)]):
        mx.eval(loaded.model(mx.array([head]), cache=cache))
    ours = loaded.decoder.prefill(rest, cache, OwnedCache(), (0.75,)).copy()
    assert_close(ours, prefill_logits(ref_model, head + rest)[-1])
