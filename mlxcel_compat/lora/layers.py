"""LoRA adapters served unfused: every adapted linear adds ``scale * B (A x)`` to its output.

The base weights are never changed, so one loaded model serves every combination of scales at
once: a scale change costs nothing (no reload, no re-fusing), a request whose scales are all zero
runs exactly the base model's arithmetic, and rows of one batch may use different scales.

How it is installed: each adapted module (``nn.Linear``, ``BlockLinear`` over ggml blocks,
``nn.QuantizedLinear``) gets a subclass of its own class whose ``__call__`` adds the adapters'
products (the technique of ``cpu_fusion.fuse``), with the factors kept outside the module's
parameters. The module keeps its path, its class checks and its weights, so everything that reads
a model (the CPU decode runtime, block-weight lookups, the fingerprint) sees it as before.

Which scales apply is a per-forward-pass setting of the engine thread
(``runtime/lora_rows.py: applied``, where the runtime reads the factors too): one
tuple of scales (one per adapter id) for each row of the batch. Rows with the same scales take a
Python scalar; rows that differ take a (B, 1, 1) column, so a batch of a base request and an
adapter request computes each row as it would alone (adding ``0 * z`` leaves a row unchanged).

``mx.compile`` traces bake Python values in: ``cpu_fusion`` compiles no MLP that holds an adapted
layer (``runtime/lora_rows.py: holds_lora``).

The CPU decode runtime (``cpu_decode.py``) adds the same products with the shim's kernels from
the NumPy copies of the factors (``runtime/lora_rows.py: Factor``).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.lora.adapters import AdapterError, AdapterFile, LoraFactor, read_factors
from mlxcel_compat.runtime.block_layers import BlockLinear, block_weight_of, module_at
from mlxcel_compat.runtime.lora_rows import Factor, Rows, add_factor, current, factors_of

def _column(f: Factor, rows: Rows) -> list[float]:
    return [float(r[f.adapter]) * f.multiplier if f.adapter < len(r) else 0.0 for r in rows]


def _lora_call(self: Any, x: Any) -> Any:
    y = super(type(self), self).__call__(x)
    rows = current()
    if rows is None:
        return y
    for f in factors_of(self):
        column = _column(f, rows)
        if not any(column):
            continue
        z = (x.astype(f.a_mx.dtype) @ f.a_mx.T) @ f.b_mx.T
        if len(set(column)) == 1:
            z = z * column[0]
        else:
            if x.ndim < 2 or x.shape[0] != len(rows):
                raise RuntimeError(f"LoRA scales for {len(rows)} rows, but the input has shape {x.shape}")
            z = z * mx.array(column, dtype=z.dtype).reshape(len(rows), *([1] * (z.ndim - 1)))
        y = y + z.astype(y.dtype)
    return y


_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    """``cls`` with the adapters' products added; its name keeps the base's prefix
    (``QuantizedLinear...`` stays recognisable as quantized)."""
    if cls in _CLASSES.values():
        return cls
    adapted = _CLASSES.get(cls)
    if adapted is None:
        adapted = _CLASSES[cls] = type(f"{cls.__name__}WithLoRA", (cls,), {"__call__": _lora_call, "__module__": __name__})
    return adapted


def linear_dims(module: Any) -> tuple[int, int] | None:
    """(out, in) of a linear layer, or None for anything else."""
    block = block_weight_of(module)
    if block is not None and isinstance(module, BlockLinear):
        return block.n, block.k
    if isinstance(module, nn.QuantizedLinear):
        return module.weight.shape[0], module.weight.shape[1] * 32 // module.bits
    if isinstance(module, nn.Linear):
        return tuple(module.weight.shape)  # type: ignore[return-value]
    return None


def _compute_dtype(module: Any) -> Any:
    if isinstance(module, nn.QuantizedLinear):
        return module.scales.dtype
    if isinstance(module, nn.Linear):
        return module.weight.dtype
    return mx.float32  # block weights compute in float32


# --------------------------------------------------------------------------- names and checks


def _gguf_targets(model: Any, config: dict[str, Any], adapter: AdapterFile, model_arch: str | None) -> tuple[dict[str, str], Any]:
    """GGUF weight name -> module path for the model's linear layers, and the arch spec (for
    llama's Q/K rows, permuted in the file as the converter permutes them)."""
    import gguf

    from mlxcel_compat.gguf import architectures as gguf_arch

    if model_arch is None:
        raise AdapterError(f"LoRA adapter '{adapter.path}' is a GGUF adapter, but model type "
                           f"{config.get('model_type')!r} has no GGUF architecture to map its tensor names")
    if adapter.architecture != model_arch:
        raise AdapterError(f"LoRA adapter '{adapter.path}' is for architecture '{adapter.architecture}', "
                           f"but the model is '{model_arch}'")
    spec = gguf_arch.ARCHITECTURES[model_arch]
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == spec.gguf_arch)
    table = gguf.get_tensor_name_map(arch, int(config.get("num_hidden_layers", 0)))
    names = {}
    for path, module in model.named_modules():
        if linear_dims(module) is not None:
            checkpoint_name = spec.hf_name(path + ".weight") if spec.hf_name else path + ".weight"
            gguf_name = table.get_name(checkpoint_name, try_suffixes=(".weight",))
            if gguf_name is not None:
                names[gguf_name] = path
    return names, spec


def model_architecture(config: dict[str, Any], gguf_summary: Any = None) -> str | None:
    """The GGUF architecture name of a loaded model (its file's, or its model type's)."""
    if gguf_summary is not None:
        return str(gguf_summary.architecture)
    from mlxcel_compat.gguf.architectures import ARCHITECTURES

    model_type = config.get("model_type")
    return next((spec.gguf_arch for spec in ARCHITECTURES.values() if spec.model_type == model_type), None)


def _resolve(model: Any, config: dict[str, Any], adapter: AdapterFile, factors: list[LoraFactor],
             model_arch: str | None) -> list[tuple[str, LoraFactor]]:
    """(module path, factor) for every factor, with shapes checked; errors name the tensor."""
    from mlxcel_compat.gguf import architectures as gguf_arch

    names, spec = _gguf_targets(model, config, adapter, model_arch) if adapter.kind == "gguf" else ({}, None)
    out = []
    for f in factors:
        path = names.get(f.target) if adapter.kind == "gguf" else f.module
        if path is None:
            raise AdapterError(f"LoRA adapter '{adapter.path}': tensor '{f.target}' adapts no linear layer of the model")
        try:
            module = module_at(model, path)
        except (AttributeError, IndexError, ValueError, KeyError):
            module = None
        dims = linear_dims(module) if module is not None else None
        if dims is None:
            raise AdapterError(f"LoRA adapter '{adapter.path}': tensor '{f.target}' names '{path}', "
                               "which is not a linear layer of the model")
        out_dims, in_dims = dims
        if f.a.shape[1] != in_dims or f.b.shape[0] != out_dims:
            raise AdapterError(
                f"LoRA adapter '{adapter.path}': tensor '{f.target}' has shape A {tuple(f.a.shape)}, B "
                f"{tuple(f.b.shape)}, which does not fit '{path}' (in {in_dims}, out {out_dims})")
        if spec is not None:
            heads = gguf_arch.qk_heads(spec, config, path + ".weight")
            if heads is not None:
                f.b = np.ascontiguousarray(gguf_arch.unpermute_rows(f.b, heads))
        out.append((path, f))
    return out


def install(model: Any, config: dict[str, Any], adapters: Sequence[AdapterFile], model_arch: str | None) -> int:
    """Read every adapter, check it against the model, and install it unfused; returns the
    number of adapted modules. Nothing is installed if any adapter does not fit."""
    planned: list[tuple[int, str, LoraFactor]] = []
    for adapter in adapters:
        planned += [(adapter.id, path, f) for path, f in _resolve(model, config, adapter, read_factors(adapter), model_arch)]
    modules: dict[str, Any] = {}
    for adapter_id, path, f in planned:
        module = modules.setdefault(path, module_at(model, path))
        dtype = _compute_dtype(module)
        factor = Factor(adapter_id, f.multiplier, f.a, f.b, mx.array(f.a).astype(dtype), mx.array(f.b).astype(dtype))
        module.__class__ = _adapted_class(type(module))
        add_factor(module, factor)
    mx.eval([(f.a_mx, f.b_mx) for m in modules.values() for f in factors_of(m)])
    return len(modules)


__all__ = ["Factor", "applied", "current", "factors_of", "holds_lora", "install", "linear_dims", "model_architecture"]
