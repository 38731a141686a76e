"""The seeded random weights of a factory model, and the mlx-lm model they fit.

The weights come from a fixed NumPy PCG64 seed, generated in sorted name order with exact IEEE
operations only, so every build of a pair produces the same bytes on every machine. The GGUF
writer, the draft pair, the adapters and the vision factory draw on the same functions.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .families import Family, family_spec, model_config

WEIGHT_SEED = 20240229


def instantiate(config: dict[str, Any]) -> Any:
    """The mlx-lm model for ``config``; its arrays stay lazy, so this is cheap."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def stored_shapes(model: Any, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors written to ``model.safetensors``.

    Tied families omit ``lm_head.weight`` (gemma3_text's ``sanitize`` then drops
    the head module when loading).
    """
    from mlx.utils import tree_flatten

    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    return shapes


def init_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...],
                 spec: Family) -> np.ndarray:
    """One seeded float32 tensor.

    Matrices are normal with std 1/sqrt(fan_in) (unit gain), which keeps the
    logits' spread near 1 so greedy decoding is not decided by near-ties.
    Only exact IEEE operations are used (no log/exp), so the bits do not depend
    on the machine's math library.
    """
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 0:
        return _scalar(rng, name, leaf)
    if len(shape) == 1:
        if leaf == "A_log":
            # Decay rates of the gated delta net (and Mamba-2): A = exp(A_log) in [0.01, 1], so the
            # state keeps tens of tokens. With the checkpoints' initial U(1, 16) it keeps about one,
            # and a head's output is then one token's value times its small, random q.k: its sign,
            # and with it the logits, flip under quantization noise (measured: Q8_0 weights moved
            # a tiny Qwen3.5's logits by 3.6 of their 4.4, by 0.6 with these decays).
            return rng.random(shape, dtype=np.float32) * np.float32(4.5) - np.float32(4.5)
        if leaf == "dt_bias":
            return np.ones(shape, dtype=np.float32)
        if leaf in ("layer_scalar", "scale", "per_expert_scale", "D"):
            # Gains that multiply (Gemma 4's layer and router scales, Mamba-2's skip): about 1,
            # and distinct, so a tensor read into the wrong place shows.
            return rng.random(shape, dtype=np.float32) * np.float32(0.5) + np.float32(0.75)
        if leaf == "bias":
            return np.zeros(shape, dtype=np.float32)
        if leaf in ("e_score_correction_bias", "expert_bias"):
            # DeepSeek-V3 / GLM-4.5 / LFM2-MoE's expert selection bias, added to sigmoid scores in (0, 1).
            return rng.random(shape, dtype=np.float32) * np.float32(0.1)
        if leaf == "sinks":
            # gpt-oss's attention sinks: one logit per head, of the scale of the scores.
            return rng.standard_normal(shape, dtype=np.float32)
        if "norm" in name or name.rsplit(".", 2)[-2].startswith("ln_"):  # (GPT-2-style names: ln_1, ln_f)
            return np.full(shape, spec.norm_one, dtype=np.float32)
        raise ValueError(f"no initializer for the 1-D parameter {name}")
    if name.endswith("embed_tokens.weight"):
        fan_in = shape[1]  # as the tied output head, the hidden size is the fan-in
    else:
        fan_in = math.prod(shape[1:])
    std = np.float32(1.0 / math.sqrt(fan_in))
    return rng.standard_normal(shape, dtype=np.float32) * std


def _scalar(rng: np.random.Generator, name: str, leaf: str) -> np.ndarray:
    """A 0-d parameter: Apertus's xIELU constants (``alpha_p`` and ``alpha_n`` before their
    softplus, near the 0.8 the model starts from; ``beta`` 0.5; ``eps`` -1e-6)."""
    if leaf in ("alpha_p", "alpha_n"):
        return np.array(0.25 + 0.5 * rng.random(dtype=np.float32), dtype=np.float32)
    if leaf == "beta":
        return np.array(0.5, dtype=np.float32)
    if leaf == "eps":
        return np.array(-1e-6, dtype=np.float32)
    raise ValueError(f"no initializer for the 0-d parameter {name}")


def random_weights(family: str, size: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config and its weights as MLX arrays, generated in sorted name order."""
    config = model_config(family, size)
    return seeded_weights(family, size, config), config


def seeded_weights(family: str, size: str, config: dict[str, Any]) -> dict[str, Any]:
    """Seeded weights of the family for ``config`` (the pair's own, or a variant of it a test
    builds: another layer count or layout), as MLX arrays, generated in sorted name order."""
    import mlx.core as mx

    spec = family_spec(family, size)
    model = instantiate(config)
    shapes = stored_shapes(model, config)
    rng = np.random.default_rng(WEIGHT_SEED)
    weights = {
        name: mx.array(init_tensor(rng, name, shapes[name], spec)) for name in sorted(shapes)
    }
    _check_loadable(model, weights)
    return weights


def _check_loadable(model: Any, arrays: dict[str, Any]) -> None:
    """Fail the build, not the later load, if mlx-lm would reject these weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if hasattr(model, "sanitize"):
        sanitized = model.sanitize(dict(arrays))
        # (a sanitize that returns an equal copy, as Apertus's squeeze of a 0-d array, changes nothing)
        changed = [k for k in arrays if sanitized.get(k) is not arrays[k]
                   and (k not in sanitized or sanitized[k].shape != arrays[k].shape
                        or not mx.array_equal(sanitized[k], arrays[k]).item())]
        if changed or len(sanitized) != len(arrays):
            raise RuntimeError(f"sanitize would rewrite stored tensors: {changed[:5]}")
    expected = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    actual = {name: tuple(a.shape) for name, a in arrays.items()}
    if expected != actual:
        raise RuntimeError(f"weights do not match the model: {sorted(set(expected) ^ set(actual))}")
