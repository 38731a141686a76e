"""Load a GGUF file as an ordinary mlx-lm model: config from metadata, weights streamed in.

The model object is the one mlx-lm builds from the equivalent ``config.json`` (``gguf_arch``), so
the engine, prompt cache, batching and attention path treat it like any other mlx-lm model.

Weights are streamed: each tensor is read, decoded or repacked, put into the model, and its
buffers dropped before the next one. The memory peak is the final weights plus one tensor in
flight, never a second copy of the model. Every tensor type is checked before the first byte is
read, so an unsupported type fails fast. Three paths (``precision.tensor_precision`` decides):

- on the CPU, the weights of linear layers and the embedding in a block type (every quantized
  type, F16, BF16) are not read at all: they stay in the memory-mapped file
  (``gguf.map_file``), served by ggml's kernels through block layers (``block_layers.py``); the
  query and key rows llama.cpp permuted are read in the model's order (``BlockWeight.rows``); a
  stack of experts (``ffn_*_exps``) too, as one block weight whose chosen experts' rows alone are
  computed (``block_experts.py``);
- float tensors (F32, F16, BF16) are read straight into MLX memory (``gguf.read_float_tensor``)
  and the converter's changes are undone with MLX operations: the one copy a safetensors
  checkpoint costs, which keeps a GGUF load as fast as the same model's directory;
- other quantized tensors are read into NumPy (``gguf.read_tensor``) and decoded or repacked
  there (``gguf_quants``), then handed to MLX. On Metal/CUDA the weights of linear layers and
  the embedding become MLX affine weights in their type's form (``precision.affine_form``), one
  tensor at a time at about the file's size; once all are read, each such layer is swapped for
  a ``QuantizedLinear`` / ``QuantizedEmbedding`` with its own bits and group size. A tensor whose
  scales overflow the compute dtype is dequantized instead (logged, ``affine_fallbacks``).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from mlxcel_compat.runtime import block_weight
from mlxcel_compat.runtime import ggml_repack
from mlxcel_compat.gguf import architectures as gguf_arch
from mlxcel_compat.gguf import input_order, tensor_undo
from mlxcel_compat.gguf import quants as gguf_quants
from mlxcel_compat.gguf import precision
from mlxcel_compat.gguf.reader import (FLOAT_TYPES, GGUFModelFile, TensorInfo, map_file, open_gguf, read_float_tensor,
                                      read_tensor, tensor_view)
from mlxcel_compat.gguf.tokenizer import SpecialTokens, load_tokenizer, with_overrides

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass
class GGUFSummary:
    """What start-up logs, /props and /v1/models report about a loaded GGUF."""

    path: str
    parts: int
    architecture: str
    file_type: str  # llama.cpp's name, e.g. "Q4_K - Medium"
    type_counts: dict[str, int]
    n_params: int
    file_bytes: int
    compute_dtype: str
    precision: dict[str, int] = field(default_factory=dict)  # "blocks q4_K" / "affine q8_0" / "float32" -> tensors
    specials: SpecialTokens | None = None
    load_seconds: float = 0.0
    weight_bytes: dict[str, int] = field(default_factory=dict)  # the same labels -> bytes they take in memory
    kernels: dict[str, str] = field(default_factory=dict)  # "blocks q4_K" -> what computes with them
    repacked: dict[str, int] = field(default_factory=dict)  # the same labels -> how many ggml repacked
    prompt_products: dict[str, int] = field(default_factory=dict)  # -> how many take ggml's mul_mat for prompts
    grouped: dict[str, int] = field(default_factory=dict)  # -> how many block_weight.group_rows grouped
    blocks_unavailable: str = ""  # on the CPU: why quantized weights were expanded to float32
    affine_fallbacks: list[str] = field(default_factory=list)  # tensors whose affine scales overflow the dtype
    # Quantized expert stacks (gguf_arch.is_expert_stack) expanded to float for MLX's gather
    # matmul, by type: where ggml's kernels do not serve them (blocks=False, off the CPU, a type
    # the build lacks); elsewhere they stay in their blocks ("experts in blocks <type>").
    expanded_experts: dict[str, int] = field(default_factory=dict)


def _layer_kind(model: Any, mlx_name: str, shape: tuple[int, ...]) -> str:
    """``linear`` or ``embedding`` for the weight of a Linear or Embedding whose rows are whole
    32-value groups (what ``nn.QuantizedLinear`` can hold, and what a block layer replaces),
    else ``""``."""
    import mlx.nn as nn

    if not mlx_name.endswith(".weight") or len(shape) != 2 or shape[-1] % 32:
        return ""
    module = model
    for part in mlx_name.rsplit(".", 1)[0].split("."):
        module = module[int(part)] if isinstance(module, list) else getattr(module, part, None)
        if module is None:
            return ""
    return "linear" if isinstance(module, nn.Linear) else "embedding" if isinstance(module, nn.Embedding) else ""


def decode_tensor(info: TensorInfo, raw: np.ndarray, mlx_name: str, spec: gguf_arch.ArchSpec,
                  config: dict[str, Any], dtype: str, target_shape: tuple[int, ...]) -> Any:
    """A tensor's bytes expanded in NumPy (any type), the converter's changes undone (query and key
    rows un-permuted, a norm's shift taken off), as an MLX array of ``dtype`` and ``target_shape``."""
    import mlx.core as mx

    heads = gguf_arch.qk_heads(spec, config, mlx_name)
    rows = raw.reshape(info.shape[0], -1) if len(info.shape) > 1 else raw
    if heads is not None:
        rows = gguf_arch.unpermute_rows(rows, heads)
    undo = row_undo(spec, config, mlx_name)
    if undo is not None and undo.rows is not None and len(info.shape) > 1:
        rows = rows[undo.rows]  # whole block rows, before they are expanded
    np_dtype = np.float16 if dtype == precision.FLOAT16 else np.float32
    values = gguf_quants.dequantize(np.ascontiguousarray(rows).reshape(-1), info.ggml_type, info.n_values,
                                    dtype=np_dtype, name=info.name)
    if spec.norm_shift and mlx_name.endswith("norm.weight"):
        values = values - np_dtype(spec.norm_shift)
    if undo is not None:
        done = undo.rows is not None and len(info.shape) > 1
        values = tensor_undo.apply(tensor_undo.TensorUndo(None if done else undo.rows, undo.columns, undo.values),
                                   values.reshape(info.shape[0], -1) if len(info.shape) > 1 else values, np)
    if int(np.prod(target_shape)) != values.size:
        raise ValueError(f"tensor '{info.name}' has shape {info.shape}; the model expects {target_shape} for {mlx_name}")
    array = mx.array(values.reshape(target_shape))
    return array.astype(mx.bfloat16) if dtype == precision.BFLOAT16 else array


def load_float_tensor(info: TensorInfo, mlx_name: str, spec: gguf_arch.ArchSpec, config: dict[str, Any], dtype: str,
                      target_shape: tuple[int, ...]) -> Any:
    """A float tensor read into MLX and transformed there, as :func:`decode_tensor` does in NumPy."""
    import mlx.core as mx

    array = read_float_tensor(info)
    if (heads := gguf_arch.qk_heads(spec, config, mlx_name)) is not None:
        array = gguf_arch.unpermute_rows(array, heads)
    target = {precision.FLOAT32: mx.float32, precision.FLOAT16: mx.float16, precision.BFLOAT16: mx.bfloat16}[dtype]
    # The arithmetic dtype of the NumPy path (bfloat16 is reached from float32), so both round alike.
    work = mx.float16 if target == mx.float16 else mx.float32
    if spec.norm_shift and mlx_name.endswith("norm.weight"):
        array = array.astype(work) - mx.array(spec.norm_shift, dtype=work)
    if (undo := row_undo(spec, config, mlx_name)) is not None:
        rows_first = array.reshape(info.shape[0], -1) if len(info.shape) > 1 else array
        array = tensor_undo.apply(undo, rows_first.astype(work) if undo.values else rows_first, mx)
    if array.dtype != target:
        array = array.astype(target)
    if array.size != int(np.prod(target_shape)):
        raise ValueError(f"tensor '{info.name}' has shape {info.shape}; the model expects {target_shape} for {mlx_name}")
    return array.reshape(target_shape)


def _affine(info: TensorInfo, raw: np.ndarray, mlx_name: str, spec: gguf_arch.ArchSpec, config: dict[str, Any],
            form: precision.AffineForm, dtype: str, target_shape: tuple[int, ...]) -> list[tuple[str, Any]] | None:
    """A quantized matrix as MLX affine ``weight``, ``scales`` and ``biases`` in ``form`` (or
    MLX mxfp4 ``weight`` and ``scales``), or None when its scales or biases overflow ``dtype``
    (or an MXFP4 exponent is E8M0's NaN): the caller dequantizes that tensor instead."""
    import mlx.core as mx

    if tuple(info.shape) != tuple(target_shape):
        raise ValueError(f"tensor '{info.name}' has shape {info.shape}; the model expects {target_shape} for {mlx_name}")

    heads = gguf_arch.qk_heads(spec, config, mlx_name)
    rows = raw.reshape(info.shape[0], -1)
    if heads is not None:
        rows = gguf_arch.unpermute_rows(rows, heads)
    if (undo := row_undo(spec, config, mlx_name)) is not None and undo.rows is not None:
        rows = rows[undo.rows]  # columns and element-wise maps never reach here (undo_plan)
    prefix = mlx_name[: -len("weight")]
    if form.mode == precision.MXFP4:
        fp4 = gguf_quants.to_mxfp4(np.ascontiguousarray(rows).reshape(-1), info.shape)
        return None if fp4 is None else [(mlx_name, mx.array(fp4.weight)), (prefix + "scales", mx.array(fp4.scales))]
    blocks = gguf_quants.to_affine(np.ascontiguousarray(rows).reshape(-1), info.ggml_type, info.shape,
                                   form.bits, form.group_size, dtype)
    if blocks is None:
        return None
    if form.method == precision.EXACT and not blocks.exact:  # the policy's promise, checked on the data
        raise RuntimeError(f"tensor '{info.name}': {form.describe()} changed a value")
    target = {precision.FLOAT16: mx.float16, precision.BFLOAT16: mx.bfloat16, precision.FLOAT32: mx.float32}[dtype]
    # The scales hold dtype values already (gguf_quants rounds them), so the cast is exact.
    return [(mlx_name, mx.array(blocks.weight)), (prefix + "scales", mx.array(blocks.scales).astype(target)),
            (prefix + "biases", mx.array(blocks.biases).astype(target))]


def _blocks(info: TensorInfo, mapped: np.ndarray, mlx_name: str, spec: gguf_arch.ArchSpec, config: dict[str, Any],
            target_shape: tuple[int, ...], lib: block_weight.BlockLibrary) -> block_weight.BlockWeight:
    """A weight served from its blocks in the mapped file: nothing is read or copied."""
    if tuple(info.shape) != tuple(target_shape):
        raise ValueError(f"tensor '{info.name}' has shape {info.shape}; the model expects {target_shape} for {mlx_name}")
    n, k = info.shape
    heads = gguf_arch.qk_heads(spec, config, mlx_name)
    rows = gguf_arch.unpermute_rows(np.arange(n, dtype=np.int32), heads) if heads is not None else None
    if (undo := row_undo(spec, config, mlx_name)) is not None and undo.rows is not None:
        rows = undo.rows if rows is None else rows[undo.rows]  # columns: input_order.order_inputs
    data = tensor_view(info, mapped).reshape(n, -1)
    return block_weight.BlockWeight(data, info.ggml_type, n, k, lib, rows=rows)


def _expert_blocks(model: Any, gguf_name: str, mlx_name: str, info: TensorInfo, lib: Any, spec: gguf_arch.ArchSpec,
                   config: dict[str, Any]) -> bool:
    """Whether a stack of experts stays in the file's blocks (``block_experts.py``): a block type
    ggml's kernels serve, read as stored (no undo step), the weight of an mlx-lm ``SwitchLinear``."""
    from mlxcel_compat.runtime import block_experts

    if (not gguf_arch.is_expert_stack(gguf_name) or isinstance(lib, str) or len(info.shape) != 3
            or not lib.serves(info.ggml_type) or row_undo(spec, config, mlx_name) is not None
            or not block_experts.available()):
        return False
    module = model
    for part in mlx_name.rsplit(".", 1)[0].split("."):
        module = module[int(part)] if isinstance(module, list) else getattr(module, part, None)
        if module is None:
            return False
    return type(module).__name__ == "SwitchLinear"


def release_headers(file: GGUFModelFile, maps: dict[Any, np.ndarray]) -> None:
    """Drop each mapped part's header (metadata and tensor table: the bytes before its first
    tensor) from the process once the weights are in place.

    ``map_file`` populates the whole map up front, so the header's pages count in RSS for as long
    as the server runs, though it was parsed before through a map of its own and is never read
    again: on a 262K-token vocabulary (Gemma 3) the token strings, scores and types take 6.2 MiB.
    The pages stay in the page cache (``ggml_repack.release_pages``); only whole pages before
    the first tensor go, so no tensor's bytes are touched."""
    for part, mapped in maps.items():
        starts = [info.offset for info in file.tensors.values() if info.path == part]
        if starts:
            ggml_repack.release_pages(mapped, 0, min(starts))


def _expert_stack(info: TensorInfo, mapped: np.ndarray, mlx_name: str, target_shape: tuple[int, ...],
                  lib: block_weight.BlockLibrary) -> Any:
    """A stack of experts served from its blocks in the mapped file (``block_experts.ExpertStack``):
    nothing is read or copied, except for a type whose rows the shim's own kernels read grouped
    (``block_weight.group_rows``: Q4_K, Q6_K, Q8_0, the 32-value types and MXFP4, where each
    expert's rows are whole groups of 16) or split (``block_weight.split_rows``: the 32-value
    types and MXFP4 otherwise), which is rearranged into a copy that replaces the file's pages."""
    from mlxcel_compat.runtime import block_experts

    if tuple(info.shape) != tuple(target_shape):
        raise ValueError(f"tensor '{info.name}' has shape {info.shape}; the model expects {target_shape} for {mlx_name}")
    n_expert, rows, k = info.shape
    data = tensor_view(info, mapped).reshape(n_expert * rows, -1)
    weight = block_weight.BlockWeight(data, info.ggml_type, n_expert * rows, k, lib)
    if rows % block_weight.GROUP_ROWS == 0:  # each expert whole groups: its bands start at one
        block_weight.group_rows(weight, mapped, info.offset)
    block_weight.split_rows(weight, mapped, info.offset)
    return block_experts.ExpertStack(weight, n_expert)


def _joined(file: GGUFModelFile, joins: dict[str, tuple[Any, tuple[str, ...]]], spec: gguf_arch.ArchSpec,
            config: dict[str, Any], dtype: str, shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, Any]]:
    """The parameters the converter split into several tensors (``ArchSpec.joins``): each part
    read as ``dtype`` floats, then joined by the row's function, one parameter at a time."""
    import mlx.core as mx

    out = []
    for mlx_name, (join, part_names) in joins.items():
        arrays = []
        for name in part_names:
            info = file.tensors[name]
            if info.ggml_type in FLOAT_TYPES:
                arrays.append(load_float_tensor(info, mlx_name, spec, config, dtype, info.shape))
            else:
                arrays.append(decode_tensor(info, read_tensor(info), mlx_name, spec, config, dtype, info.shape))
        array = join.join(arrays, config)
        if tuple(array.shape) != shapes[mlx_name]:
            raise ValueError(f"tensors {', '.join(part_names)} join into {tuple(array.shape)}; the model expects "
                             f"{shapes[mlx_name]} for {mlx_name}")
        mx.eval(array)
        out.append((mlx_name, array))
    return out


def row_undo(spec: gguf_arch.ArchSpec, config: dict[str, Any], mlx_name: str) -> tensor_undo.TensorUndo | None:
    """The undo steps the architecture's row declares for ``mlx_name`` (``tensor_undo.py``), if any."""
    return spec.undo(config, mlx_name) if spec.undo is not None else None


def undo_plan(plan: str, undo: tensor_undo.TensorUndo | None, dtype: str) -> str:
    """``plan`` for a tensor with undo steps: an element-wise map needs float values, and so does
    a column order in MLX affine form (its groups run along the columns); blocks take a column
    order in their layer (``input_order.py``)."""
    if undo is None:
        return plan
    if undo.float_only and plan in (precision.BLOCKS, precision.AFFINE):
        return dtype
    if undo.columns is not None and plan == precision.AFFINE:
        return dtype
    return plan


def _install_rope_freqs(model: Any, file: GGUFModelFile, config: dict[str, Any]) -> None:
    """Llama 3 files carry the RoPE frequency factors as a tensor (``rope_freqs.weight``)."""
    import mlx.core as mx
    from mlx_lm.models.rope_utils import Llama3RoPE

    factors = gguf_quants.dequantize(read_tensor(file.tensors["rope_freqs.weight"]),
                                     file.tensors["rope_freqs.weight"].ggml_type,
                                     file.tensors["rope_freqs.weight"].n_values)
    head_dim = config["head_dim"]
    periods = config.get("rope_theta", 10000.0) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    freqs = mx.array(periods.astype(np.float32) * factors)
    for _, module in model.named_modules():  # every layer's (EXAONE 4's global layers have none)
        if isinstance(module, Llama3RoPE):
            module._freqs = freqs


def _prepare(file: GGUFModelFile) -> tuple[gguf_arch.ArchSpec, Any, SpecialTokens, dict[str, Any]]:
    spec = gguf_arch.arch_spec(file)
    for info in file.tensors.values():
        gguf_quants.check_supported(info.name, info.ggml_type)
    tokenizer, specials = load_tokenizer(file)
    n_vocab = len(file.metadata.get("tokenizer.ggml.tokens") or [])
    with _generic_misfit(spec):
        config = gguf_arch.model_config(file, spec, n_vocab, specials.eog, specials.bos if specials.add_bos else None)
    if (spec.permute_qk or spec.llama3_rope_freqs) and "rope_freqs.weight" in file.tensors:
        # Llama3RoPE is built from a placeholder and its frequencies replaced by the file's.
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 1.0}
    return spec, tokenizer, specials, config


@contextmanager
def _generic_misfit(spec: gguf_arch.ArchSpec) -> Iterator[None]:
    """On the generic path, any failure to build the model or place its tensors means mlx-lm's
    class does not fit the architecture: say so, naming it and the served ones."""
    try:
        yield
    except Exception as exc:
        if not spec.generic:
            raise
        raise gguf_arch.unsupported(spec.gguf_arch, f"no row serves it, and mlx-lm's '{spec.model_type}' model "
                                                    f"does not fit it through the generic path ({exc})") from exc


def _model_and_names(file: GGUFModelFile, spec: gguf_arch.ArchSpec, config: dict[str, Any]
                     ) -> tuple[Any, dict[str, tuple[int, ...]], dict[str, Any], dict[str, str], dict[str, Any]]:
    """The mlx-lm model, its parameters' shapes, those rebuilt from metadata, GGUF name ->
    parameter name for those read from one tensor each (every one present in the file), and the
    parameters joined from several tensors (``ArchSpec.joins``)."""
    from mlx.utils import tree_flatten

    model = _build_model(config, file)
    if spec.prepare_model is not None:  # a layout the file stores that mlx-lm's model does not (stored_parts.py)
        spec.prepare_model(model, config)
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    from_metadata = spec.metadata_weights(file, config) if spec.metadata_weights is not None else {}
    from_tensors = [n for n in shapes if n not in from_metadata]
    names = gguf_arch.gguf_names(spec, from_tensors, config["num_hidden_layers"])
    joins = gguf_arch.joined_parameters(spec, from_tensors)
    parts = {g for _, tensors in joins.values() for g in tensors}
    missing = sorted((set(names) | parts) - set(file.tensors))
    if missing:
        raise ValueError(f"'{file.path}' lacks tensors the {spec.gguf_arch} model needs: {', '.join(missing[:8])}")
    ignored = sorted(set(file.tensors) - set(names) - parts - {"rope_freqs.weight", *spec.config_tensors})
    past_layers = [n for n in ignored if gguf_arch.layer_index(n) is not None
                   and gguf_arch.layer_index(n) >= config["num_hidden_layers"]]
    if past_layers:
        log.info("%d tensors of the layers past the model's %d (NextN / multi-token prediction layers, which "
                 "mlx-lm's model does not run) are not loaded", len(past_layers), config["num_hidden_layers"])
        ignored = sorted(set(ignored) - set(past_layers))
    if ignored and spec.generic:
        raise ValueError(f"tensors without a counterpart in the model: {', '.join(ignored[:8])}")
    if ignored:
        log.warning("GGUF tensors without a counterpart in the mlx-lm model are ignored: %s", ", ".join(ignored[:8]))
    if spec.generic:
        log.warning("GGUF architecture '%s' has no row: served generically by mlx-lm's '%s' model, with no undo "
                    "steps for what llama.cpp's converter may have changed", spec.gguf_arch, spec.model_type)
    return model, shapes, from_metadata, names, joins


def _build_model(config: dict[str, Any], file: GGUFModelFile) -> Any:
    from mlxcel_compat.zoo import module_classes

    model_class, args_class = module_classes(config["model_type"])  # gguf_arch names mlx-lm's modules
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "lm_head") and "output.weight" not in file.tensors and hasattr(model, "sanitize"):
        model.sanitize({})  # models that decide tying at load time (gemma3) drop the head here
    return model


def load_gguf(path: str, on_cpu: bool | None = None, progress: Progress | None = None, blocks: bool = True,
              repack: bool = True, kv_overrides: Sequence[Any] = (), use_mmap: bool = True, mlock: bool = False,
              adjust_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
              ) -> tuple[Any, Any, dict[str, Any], GGUFSummary]:
    """Load ``path`` (a .gguf, or the first part of a split model).

    Returns ``(model, tokenizer, config, summary)``: an mlx-lm model, an mlx-lm
    ``tokenizer.ServedTokenizer``, the synthesised config.json dict and what to report about the file.
    ``on_cpu`` defaults to MLX's default device; passing it lets tests exercise the GPU policy.
    ``blocks=False`` expands every quantized weight to float32 on the CPU: the float32 reference
    of the file (its dequantized weights in float32 math) that tests and benchmarks compare with.
    ``repack=False`` keeps every weight in the file's blocks only (``ggml_repack.py``; --no-repack).
    ``kv_overrides`` (``gguf/overrides.py``: --override-kv) replace metadata values before anything
    reads them; ``use_mmap=False`` (--no-mmap) reads the blocks into the process's memory instead of
    mapping the file, ``mlock`` (--mlock) locks them in RAM (``reader.map_file``);
    ``adjust_config`` (the RoPE flags, ``model/rope_overrides.py``) changes the synthesised config
    before the model is built.
    """
    import mlx.core as mx
    import mlx.nn as nn

    from mlxcel_compat.runtime import block_experts, block_layers

    t0 = time.perf_counter()
    if on_cpu is None:
        on_cpu = mx.default_device() == mx.cpu
    file = with_overrides(open_gguf(path), kv_overrides)
    spec, tokenizer, specials, config = _prepare(file)
    if adjust_config is not None:
        config = adjust_config(config)
    with _generic_misfit(spec):
        model, shapes, from_metadata, names, joins = _model_and_names(file, spec, config)

    dtype = precision.compute_dtype(on_cpu, {t.ggml_type for t in file.tensors.values()})
    lib = block_weight.library() if on_cpu and blocks else "not on the CPU" if not on_cpu else "blocks=False"
    kinds = {g: _layer_kind(model, m, file.tensors[g].shape) for g, m in names.items()}
    plans = {
        g: undo_plan(precision.tensor_precision(file.tensors[g].ggml_type, on_cpu, bool(kinds[g]), dtype,
                                                blocks=not isinstance(lib, str) and lib.serves(file.tensors[g].ggml_type),
                                                embedding=kinds[g] == "embedding"),
                     row_undo(spec, config, m), dtype)
        for g, m in names.items()
    }
    experts = {g for g, m in names.items() if _expert_blocks(model, g, m, file.tensors[g], lib, spec, config)}
    plans.update({g: precision.BLOCKS for g in experts})
    quantized: dict[str, precision.AffineForm] = {}  # module path -> the form its weight took

    summary = GGUFSummary(
        path=str(file.path), parts=len(file.parts), architecture=file.architecture, file_type=file.file_type,
        type_counts=file.type_counts(), n_params=file.n_params, file_bytes=file.size_bytes,
        compute_dtype=dtype, specials=specials,
    )
    if on_cpu and isinstance(lib, str) and any(file.tensors[g].ggml_type not in FLOAT_TYPES for g in names):
        summary.blocks_unavailable = lib
    elif on_cpu and not isinstance(lib, str):  # a build of ggml older than a type (ggml_cpu.GGMLKernels.supports)
        lacking = sorted({gguf_quants.type_name(file.tensors[g].ggml_type) for g in names
                          if file.tensors[g].ggml_type not in FLOAT_TYPES and not lib.serves(file.tensors[g].ggml_type)})
        if lacking:
            summary.blocks_unavailable = f"ggml {lib.ggml.version} ({lib.ggml.directory}) lacks {', '.join(lacking)}"
    maps = ({part: map_file(part, use_mmap, mlock) for part in file.parts}
            if precision.BLOCKS in plans.values() else {})
    total = sum(file.tensors[g].n_bytes for g in names)
    decoded = [file.tensors[g].n_bytes for g in names
               if file.tensors[g].ggml_type not in FLOAT_TYPES and plans[g] != precision.BLOCKS]
    scratch = np.empty(max(decoded, default=0), dtype=np.uint8)  # only quantized tensors go through NumPy
    done = 0
    loaded: list[tuple[str, Any]] = []
    for gguf_name, info in file.tensors.items():
        if gguf_name not in names:
            continue
        mlx_name, plan = names[gguf_name], plans[gguf_name]
        if gguf_name in experts:  # a stack of experts: one block weight, the chosen experts' rows read
            stack = _expert_stack(info, maps[info.path], mlx_name, shapes[mlx_name], lib)
            block_experts.install(model, mlx_name[: -len(".weight")], stack)
            label = f"experts in blocks {gguf_quants.type_name(info.ggml_type).lower()}"
            summary.precision[label] = summary.precision.get(label, 0) + 1
            summary.weight_bytes[label] = summary.weight_bytes.get(label, 0) + stack.nbytes
            summary.kernels.setdefault(label, block_experts.describe(lib, info.ggml_type))
            done += info.n_bytes
            if progress is not None:
                progress(done, total)
            continue
        if plan == precision.BLOCKS:
            weight = _blocks(info, maps[info.path], mlx_name, spec, config, shapes[mlx_name], lib)
            module = block_layers.install(model, mlx_name[: -len(".weight")], weight)
            label = f"blocks {gguf_quants.type_name(info.ggml_type).lower()}"
            linear = isinstance(module, block_layers.BlockLinear)
            if repack and linear and ggml_repack.attach(weight, maps[info.path], info.offset):
                summary.repacked[label] = summary.repacked.get(label, 0) + 1
            elif linear and block_weight.group_rows(weight, maps[info.path], info.offset):
                summary.grouped[label] = summary.grouped.get(label, 0) + 1  # every product by the shim's lanes
            elif linear and ggml_repack.prompt_product(
                    weight, maps[info.path], info.offset):
                summary.prompt_products[label] = summary.prompt_products.get(label, 0) + 1
            else:
                block_weight.in_output_order(weight, maps[info.path], info.offset)
                block_weight.split_rows(weight, maps[info.path], info.offset)
            if (undo := row_undo(spec, config, mlx_name)) is not None and undo.columns is not None:
                input_order.order_inputs(model, mlx_name[: -len(".weight")], undo.columns)
            summary.precision[label] = summary.precision.get(label, 0) + 1
            summary.weight_bytes[label] = summary.weight_bytes.get(label, 0) + weight.nbytes
            summary.kernels.setdefault(label, lib.describe(info.ggml_type, weight.split, weight.grouped))
            done += info.n_bytes
            if progress is not None:
                progress(done, total)
            continue
        label, weights = plan, None
        if plan == precision.AFFINE:
            form = precision.affine_form(info.ggml_type, dtype)
            weights = _affine(info, read_tensor(info, scratch), mlx_name, spec, config, form, dtype,
                              shapes[mlx_name])
            if weights is None:
                log.warning("tensor '%s' (%s) has no %s here (its scales or biases overflow %s, or an MXFP4 "
                            "exponent is E8M0's NaN); dequantized to %s instead",
                            info.name, gguf_quants.type_name(info.ggml_type), form.describe(), dtype, dtype)
                summary.affine_fallbacks.append(info.name)
                plan = label = dtype
            else:
                quantized[mlx_name[: -len(".weight")]] = form
                kind = "mlx" if form.mode == precision.MXFP4 else "affine"
                label = f"{kind} {gguf_quants.type_name(info.ggml_type).lower()}"
                summary.kernels.setdefault(label, form.describe())
        if gguf_arch.is_expert_stack(gguf_name) and info.ggml_type not in FLOAT_TYPES and plan != precision.AFFINE:
            kind = gguf_quants.type_name(info.ggml_type).lower()
            label = f"{plan} (experts expanded from {kind})"
            summary.expanded_experts[kind] = summary.expanded_experts.get(kind, 0) + 1
        if weights is None and info.ggml_type in FLOAT_TYPES:
            weights = [(mlx_name, load_float_tensor(info, mlx_name, spec, config, plan, shapes[mlx_name]))]
        elif weights is None:
            weights = [(mlx_name, decode_tensor(info, read_tensor(info, scratch), mlx_name, spec, config, plan,
                                                shapes[mlx_name]))]
        mx.eval([w for _, w in weights])  # one tensor in flight: its temporaries go now
        loaded.extend(weights)
        summary.precision[label] = summary.precision.get(label, 0) + 1
        summary.weight_bytes[label] = summary.weight_bytes.get(label, 0) + sum(w.nbytes for _, w in weights)
        done += info.n_bytes
        if progress is not None:
            progress(done, total)
    release_headers(file, maps)
    for mlx_name, array in _joined(file, joins, spec, config, dtype, shapes):
        loaded.append((mlx_name, array))
        label = f"{dtype} (joined from {len(joins[mlx_name][1])} tensors)"
        summary.precision[label] = summary.precision.get(label, 0) + 1
        summary.weight_bytes[label] = summary.weight_bytes.get(label, 0) + array.nbytes
    if quantized:  # each layer with its weight's bits and group size; the rest stay float
        nn.quantize(model, class_predicate=lambda p, m: {"group_size": quantized[p].group_size,
                                                         "bits": quantized[p].bits, "mode": quantized[p].mode}
                    if p in quantized else False)
    loaded.extend((name, mx.array(value).reshape(shapes[name]).astype(getattr(mx, dtype)))  # float32/16, bfloat16
                  for name, value in from_metadata.items())
    model.eval()
    model.load_weights(loaded, strict=False)  # the model's own initial values were never evaluated
    if "rope_freqs.weight" in file.tensors and (spec.permute_qk or spec.llama3_rope_freqs):
        _install_rope_freqs(model, file, config)
    if summary.expanded_experts:
        log.info("stacked expert tensors expanded to %s for MLX's expert layers (SwitchGLU), not kept in "
                 "ggml's blocks: %s", dtype, ", ".join(f"{n} {k}" for k, n in sorted(summary.expanded_experts.items())))
    summary.load_seconds = time.perf_counter() - t0
    return model, tokenizer, config, summary
