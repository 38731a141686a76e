"""mlx-lm cache objects to tensors and back: the payload of disk-tier entries and slot files.

The MLX side of ``cache/disk_format.py`` (which never imports MLX). A model cache is a list of
mlx-lm cache objects; each one's ``state`` (mlx-lm's own save/restore protocol, also used by its
``save_prompt_cache``) is a small tree of arrays and scalars. ``encode`` turns the tree into a JSON
*layout* (class names, scalars, tensor references) plus the tensors, ``decode`` rebuilds the
objects with ``from_state``. Class names are looked up only among mlx-lm's cache classes.

Threads: ``encode`` runs on the engine thread and hands out numpy views of evaluated arrays (no
copy; the views keep the arrays alive), which the disk writer thread only reads. ``load_arrays``
and ``decode`` run on the engine thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models import cache as mlx_cache

from mlxcel_compat.cache.disk_format import KV_TAG, DiskReject, EntryHeader, Tensor, payload_checksum

LAYOUT_VERSION = 1

_CODES: dict[Any, str] = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64",
    mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64",
    mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32", mx.float64: "F64", mx.complex64: "C64",
}


def runtime_tag(model: Any, kv_types: str = "f32/f32") -> str:
    """What produced a state: mlx and mlx-lm versions, device, the model's compute dtype and the
    KV cache's storage types (-ctk/-ctv, ``runtime/kv_precision.py: KvTypes.tag``).

    A file is adopted only by the same runtime: another version may compute KV differently, and
    KV of another dtype would silently mix precisions.
    """
    from mlx.utils import tree_flatten

    floats = (mx.float16, mx.bfloat16, mx.float32, mx.float64)
    dtype = next((v.dtype for _, v in tree_flatten(model.parameters()) if v.dtype in floats), None)
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    return f"mlx {mx.__version__}; mlx-lm {mlx_lm.__version__}; {device}; {str(dtype).replace('mlx.core.', '')}{KV_TAG}{kv_types}"


def encode(cache: Sequence[Any]) -> tuple[dict[str, Any], list[Tensor]]:
    """The layout and the tensors of a cache (evaluated here; the views are zero-copy).

    Raises:
        TypeError: a state holds something that is neither an array nor a plain scalar.
    """
    arrays: list[mx.array] = []

    def enc(value: Any) -> Any:
        if isinstance(value, mx.array):
            arrays.append(value)
            return {"t": f"t{len(arrays) - 1}"}
        if isinstance(value, tuple):
            return {"tuple": [enc(v) for v in value]}
        if isinstance(value, list):
            return {"list": [enc(v) for v in value]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"v": value}
        raise TypeError(f"cache state holds a {type(value).__name__}")

    layers = [{"class": type(layer).__name__, "state": enc(layer.state)} for layer in cache]
    # numpy has no bfloat16: such tensors are written through a same-size integer view.
    views = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
    mx.eval(views)
    tensors = [
        Tensor(f"t{i}", _CODES[a.dtype], tuple(a.shape), np.asarray(memoryview(v)), a.nbytes)
        for i, (a, v) in enumerate(zip(arrays, views))
    ]
    return {"version": LAYOUT_VERSION, "layers": layers}, tensors


def load_arrays(path: Path, header: EntryHeader) -> dict[str, mx.array]:
    """Read a file's tensors and check them against the header's table and checksum.

    Raises:
        DiskReject: ``payload_checksum`` (bytes changed) or ``bad_payload`` (unreadable tensors).
        FileNotFoundError: the file is gone.
    """
    try:
        arrays = mx.load(str(path), format="safetensors")
        mx.eval(list(arrays.values()))
    except FileNotFoundError:
        raise
    except Exception as exc:  # mlx raises plain runtime errors for malformed files
        raise DiskReject("bad_payload", f"the tensors cannot be read: {exc}") from None
    names = [t.name for t in header.tensors]
    if sorted(arrays) != sorted(names):
        raise DiskReject("bad_payload", "the tensors differ from the header's table")
    for t in header.tensors:
        a = arrays[t.name]
        if _CODES.get(a.dtype) != t.dtype or tuple(a.shape) != t.shape:
            raise DiskReject("bad_payload", f"tensor {t.name} is {a.dtype} {tuple(a.shape)}, header says {t.dtype} {t.shape}")
    if payload_checksum([arrays[n] for n in names]) != header.payload_blake3:
        raise DiskReject("payload_checksum", "the tensor bytes do not match their checksum")
    return arrays


def decode(layout: dict[str, Any], arrays: dict[str, mx.array]) -> list[Any]:
    """Rebuild the cache objects a layout describes.

    Raises:
        DiskReject: ``bad_payload`` when the layout is not one this version writes, names an
            unknown class, or the state does not fit it.
    """
    if layout.get("version") != LAYOUT_VERSION:
        raise DiskReject("bad_payload", f"layout version {layout.get('version')!r}")

    def dec(node: Any) -> Any:
        if "t" in node:
            return arrays[node["t"]]
        if "tuple" in node:
            return tuple(dec(v) for v in node["tuple"])
        if "list" in node:
            return [dec(v) for v in node["list"]]
        return node["v"]

    try:
        cache = []
        for layer in layout["layers"]:
            cls = getattr(mlx_cache, layer["class"], None)
            if not (isinstance(cls, type) and issubclass(cls, mlx_cache._BaseCache)):
                raise DiskReject("bad_payload", f"unknown cache class {layer['class']!r}")
            cache.append(cls.from_state(dec(layer["state"])))
        return cache
    except DiskReject:
        raise
    except Exception as exc:
        raise DiskReject("bad_payload", f"the state does not rebuild the cache: {type(exc).__name__}: {exc}") from None
