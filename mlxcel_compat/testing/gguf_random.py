"""Random-block GGUF files of any size, written one tensor at a time (:func:`write_random_gguf`).

For benchmarks of large files (a 7B-shaped Q4_K_M, ``LLAMA2_7B_DIMS``) without a float32 source:
the metadata, tokenizer and tensor types are what ``gguf_writer.write_gguf`` would write for the
factory family at those dimensions; the quantized tensors are valid random blocks whose values
have the factory weights' spread. ``python -m mlxcel_compat.testing.gguf_writer`` is its command
line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from .families import FAMILY_SPECS, model_config
from .gguf_metadata import add_hparams, add_tokenizer
from .gguf_tensors import GGUF_FAMILIES, GGUF_TARGETS, GGUF_TYPES, file_type, stored_type
from .model_directory import ensure_model
from .weights import instantiate, stored_shapes

# Llama-2-7B's dimensions (the vocabulary stays the factory tokenizer's).
LLAMA2_7B_DIMS: dict[str, int] = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=32, head_dim=128, intermediate_size=11008)
# Qwen3-30B-A3B's layer (48 of them in the real model): 128 experts of 768, top-8, GQA 32:4 at
# head_dim 128 (queries wider than the hidden size), every layer sparse.
QWEN3_30B_A3B_DIMS: dict[str, int] = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                                          head_dim=128, intermediate_size=6144, num_experts=128,
                                          num_experts_per_tok=8, moe_intermediate_size=768)
# gpt-oss-20b's layer (24 in the real model): 32 experts of 2880, top-4, GQA 64:8 at head_dim 64,
# attention sinks, 128-token sliding windows on every other layer.
GPT_OSS_20B_DIMS: dict[str, int] = dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8,
                                        head_dim=64, intermediate_size=2880, num_local_experts=32,
                                        num_experts_per_tok=4, sliding_window=128)
RANDOM_SEED = 20251201


def moe_dims(family: str, n_layers: int) -> dict[str, Any]:
    """The real MoE model's layer (``QWEN3_30B_A3B_DIMS`` for ``qwen3_moe``, ``GPT_OSS_20B_DIMS``
    for ``gpt_oss``) with ``n_layers`` of them: the layers dropped so that a file fits a small
    machine (gpt-oss's sliding and full layers alternate, as in the real one)."""
    dims: dict[str, Any] = {"qwen3_moe": QWEN3_30B_A3B_DIMS, "gpt_oss": GPT_OSS_20B_DIMS}[family] | {
        "num_hidden_layers": n_layers}
    if family == "gpt_oss":
        dims["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    return dims

# Byte offsets of the float16 scale fields in one block: (d, the min/dmin field or None). The
# values are y = d * A + m * B with A and B set by the block's other bytes (Q4_1/Q5_1 add m,
# the K-quants subtract dmin times a sub-block min), so a block is linear in these two fields.
# The i-quants are d times their codes or grid points (IQ1_M keeps d's 16 bits in the top
# nibbles of its four scale words, at byte 48); MXFP4 is 2^(e - 127) times its codes, its
# exponent byte e at 0 (d rounded to a power of two there).
_SCALE_FIELDS: dict[str, tuple[int, int | None]] = {
    "q4_0": (0, None), "q4_1": (0, 2), "q5_0": (0, None), "q5_1": (0, 2), "q8_0": (0, None),
    "q2_k": (80, 82), "q3_k": (108, None), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208, None),
    **{t: (0, None) for t in ("iq4_nl", "iq4_xs", "iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s")},
    "iq1_m": (48, None), "mxfp4": (0, None),
}


def _set_f16(blocks: np.ndarray, offset: int, values: np.ndarray, kind: str = "") -> None:
    """Set each block's scale field at ``offset`` to ``values`` (float16, or the field's form)."""
    if kind == "mxfp4":  # the nearest power of two, as an E8M0 exponent; 0 the smallest one
        magnitude = np.abs(values.astype(np.float64))
        exponent = np.rint(np.log2(np.where(magnitude > 0, magnitude, 2.0**-127))) + 127
        blocks[:, offset] = np.clip(exponent, 0, 254).astype(np.uint8)
        return
    bits = values.astype("<f2").view(np.uint16).reshape(-1)
    if kind == "iq1_m":  # bits 4i..4i+3 of d in the top nibble of scale word i
        words = np.ascontiguousarray(blocks[:, offset:offset + 8]).view("<u2")
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        blocks[:, offset:offset + 8] = words.view(np.uint8)
        return
    blocks[:, offset:offset + 2] = bits.view(np.uint8).reshape(-1, 2)


def _scale_of(blocks: np.ndarray, offset: int, kind: str) -> np.ndarray:
    """Each block's scale field at ``offset`` as float32 (the inverse of ``_set_f16``)."""
    if kind == "mxfp4":
        return np.ldexp(np.float32(1), blocks[:, offset].astype(np.int32) - 127).astype(np.float32)
    if kind == "iq1_m":
        words = np.ascontiguousarray(blocks[:, offset:offset + 8]).view("<u2")
        bits = sum(((words[:, i] >> 12) & 0xF) << (4 * i) for i in range(4)).astype(np.uint16)
        return bits.view("<f2").astype(np.float32)
    return blocks[:, offset:offset + 2].copy().view("<f2").astype(np.float32).reshape(-1)


def _random_blocks(rng: np.random.Generator, kind: str, n_blocks: int, d: float, min_ratio: float) -> np.ndarray:
    """``n_blocks`` blocks of ``kind``: random bytes, then d = ``d`` times a factor in [0.5, 1.5)
    per block and the min field ``min_ratio`` times that d (both finite float16)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = GGML_QUANT_SIZES[GGMLQuantizationType[kind.upper()]][1]
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * size)), dtype=np.uint8).reshape(n_blocks, size)
    d_at, m_at = _SCALE_FIELDS[kind]
    scale = (np.float32(d) * (np.float32(0.5) + rng.random(n_blocks, dtype=np.float32))).astype(np.float16)
    _set_f16(blocks, d_at, scale, kind)
    if m_at is not None:
        _set_f16(blocks, m_at, scale.astype(np.float32) * np.float32(min_ratio))
    return blocks


def _block_calibration(kind: str) -> tuple[float, float]:
    """``(min_ratio, unit_std)`` for random blocks of ``kind``: the min field as a multiple of d
    that centres the values on 0, and the values' standard deviation when d's factor is 1.

    Measured with gguf-py's dequantizer on a fixed sample, using the linearity in the two fields
    (a sample with the min field 0, and one with d 0, give A and B). Every value of a block whose
    two fields are 0 must be 0: that checks the field offsets.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind.upper()]
    d_at, m_at = _SCALE_FIELDS[kind]
    rng = np.random.default_rng(RANDOM_SEED)
    base = _random_blocks(rng, kind, 512, 1.0, 0.0)
    factors = _scale_of(base, d_at, kind).reshape(-1, 1)
    block_values = GGML_QUANT_SIZES[qtype][0]

    def values(d_on: bool, m_on: bool) -> np.ndarray:
        blocks = base.copy()
        _set_f16(blocks, d_at, factors[:, 0] if d_on else np.zeros(len(blocks), np.float32), kind)
        if m_at is not None:
            _set_f16(blocks, m_at, factors[:, 0] if m_on else np.zeros(len(blocks), np.float32))
        return quants.dequantize(blocks, qtype).reshape(len(blocks), block_values).astype(np.float64)

    if np.abs(values(False, False)).max() > 1e-30:  # MXFP4's smallest exponent: 2^-127 times its codes
        raise AssertionError(f"{kind}: the scale fields are not at {_SCALE_FIELDS[kind]}")
    a = values(True, False)
    ratio = 0.0
    if m_at is not None:
        b = values(False, True)
        ratio = float(-a.mean() / b.mean())
        a = a + ratio * b
    return ratio, float(a.std())


def random_blocks(rng: np.random.Generator, kind: str, n_rows: int, k: int) -> np.ndarray:
    """An (n_rows, k) matrix of ``kind`` as valid random blocks scaled like the factory's weights
    (what :func:`write_random_gguf` writes for it): uint8 (n_rows, row bytes)."""
    import gguf

    block_values = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind.upper()]][0]
    ratio, unit_std = _block_calibration(kind)
    blocks = _random_blocks(rng, kind, n_rows * k // block_values, 1.0 / math.sqrt(k) / unit_std, ratio)
    return np.ascontiguousarray(blocks).reshape(n_rows, -1)


def random_tensor_shapes(family: str, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GGUF name -> NumPy shape of every tensor a converted ``family`` model of ``config`` holds,
    in the order ``write_gguf`` writes them (HF names sorted)."""
    import gguf

    target = GGUF_TARGETS[family]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == target.arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    shapes = stored_shapes(instantiate(config), config)  # lazy arrays: no memory
    out: dict[str, tuple[int, ...]] = {}
    for mlx_name in sorted(shapes):
        hf_name = target.hf_name(mlx_name) if target.hf_name else mlx_name
        for factory_part, checkpoint_part in target.renames:  # stacked experts, gpt-oss's sinks, ...
            hf_name = hf_name.replace(factory_part, checkpoint_part)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias", ".scale"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name} in {target.arch}")
        shape = shapes[mlx_name]
        out[gguf_name] = shape[:2] if gguf_name.endswith("shortconv.conv.weight") else shape
    return out


def random_config(family: str, dims: dict[str, Any] | None) -> dict[str, Any]:
    """The factory's ``small`` config of ``family`` with ``dims`` in place of its dimensions
    (``head_dim`` follows ``hidden_size / num_attention_heads`` unless given)."""
    config = model_config(family, "small")
    dims = dict(dims or {})
    if "layer_types" in config and "num_hidden_layers" in dims and "layer_types" not in dims:
        raise ValueError(f"{family} has per-layer types: give layer_types with num_hidden_layers")
    if "head_dim" in config and "head_dim" not in dims and ({"hidden_size", "num_attention_heads"} & set(dims)):
        dims["head_dim"] = dims.get("hidden_size", config["hidden_size"]) // dims.get(
            "num_attention_heads", config["num_attention_heads"])
    config.update(dims)
    return config


def write_random_gguf(out: str | Path, family: str = "llama", dims: dict[str, Any] | None = None,
                      gguf_type: str = "q4_k_m", seed: int = RANDOM_SEED,
                      model_dir: str | Path | None = None, expert_type: str | None = None) -> Path:
    """Write a random-weight GGUF of any size, one tensor at a time, without a float32 source.

    The file is what ``write_gguf`` would write for the factory's ``family`` with its dimensions
    replaced by ``dims`` (``LLAMA2_7B_DIMS`` for a 7B-shaped file): the same metadata, tokenizer
    and chat template, the tensor types of ``gguf_type`` (``stored_type``: llama-quantize's
    Q4_K_M/Q5_K_M mixes and row-length fallbacks). Quantized tensors are valid random blocks:
    random bytes, with finite float16 scale fields chosen so that the values have mean about 0
    and standard deviation 1/sqrt(fan_in), as the factory's weights (``_block_calibration``).
    Float tensors are normal with that deviation; norm weights are 1. The bytes depend only on
    the arguments. The memory used is one tensor's blocks. ``model_dir`` is a factory directory
    of ``family`` to take the tokenizer from (the tiny one is built on demand otherwise).
    ``expert_type``: the type of the stacked experts (``ffn_*_exps``) where it differs from the
    rest, as in gpt-oss's files (MXFP4 experts, Q8_0 elsewhere: ``gguf_type="q8_0", expert_type="mxfp4"``).
    """
    from mlxcel_compat.gguf.architectures import is_expert_stack

    import gguf

    target = GGUF_TARGETS.get(family)
    if target is None or target.all_hparams is not None or target.split or target.convert or target.checkpoint:
        # (a family whose keys are all its own, GgufTarget.all_hparams, or whose converter splits,
        # reshapes or fuses tensors, is written by write_gguf only)
        raise ValueError(f"family {family!r} has no GGUF writer for random weights; "
                         f"choose one of: {', '.join(GGUF_FAMILIES)}")
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; choose one of: {', '.join(GGUF_TYPES)}")
    config = random_config(family, dims)
    n_layers = config["num_hidden_layers"]
    shapes = random_tensor_shapes(family, config)
    if expert_type is not None and expert_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {expert_type!r}; choose one of: {', '.join(GGUF_TYPES)}")
    kinds = {name: stored_type(name, shape, expert_type if expert_type and is_expert_stack(name) else gguf_type,
                               n_layers) for name, shape in shapes.items()}
    calibration = {k: _block_calibration(k) for k in sorted(set(kinds.values())) if k in _SCALE_FIELDS}
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), GGUF_TARGETS[family].arch)
    writer.add_name(f"mlxcel-{family}-random")
    writer.add_file_type(file_type(gguf_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_hparams(writer, family, config)
    source = Path(model_dir) if model_dir is not None else ensure_model(family, "tiny")  # one per family
    add_tokenizer(writer, source, GGUF_TARGETS[family].pre)
    for name, shape in shapes.items():
        kind = kinds[name]
        if kind in ("f32", "f16"):
            dtype = np.float32 if kind == "f32" else np.float16
            writer.add_tensor_info(name, shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype).itemsize)
        else:
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = shape[-1] // block_values * block_bytes
            writer.add_tensor_info(name, (*shape[:-1], row_bytes), np.dtype(np.uint8),
                                   math.prod(shape[:-1]) * row_bytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    norm_one = np.float32(FAMILY_SPECS[family].norm_one + GGUF_TARGETS[family].norm_shift)
    for name, shape in shapes.items():
        kind = kinds[name]
        std = 1.0 / math.sqrt(shape[-1]) if len(shape) > 1 else 0.0
        if len(shape) == 1:
            data: np.ndarray = (np.full(shape, norm_one, np.float32) if "norm" in name
                                else np.zeros(shape, np.float32))
        elif kind in ("f32", "f16"):
            data = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(
                np.float32 if kind == "f32" else np.float16)
        else:
            qtype = gguf.GGMLQuantizationType[kind.upper()]
            ratio, unit_std = calibration[kind]
            n_blocks = math.prod(shape) // gguf.GGML_QUANT_SIZES[qtype][0]
            data = _random_blocks(rng, kind, n_blocks, std / unit_std, ratio)
        writer.write_tensor_data(data)
    writer.close()
    return out
