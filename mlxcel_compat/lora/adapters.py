"""LoRA adapter files: what they are, who they are (a digest), and their factors.

Three formats are read:

- llama.cpp's GGUF LoRA (what ``convert_lora_to_gguf.py`` writes): ``general.type = adapter``,
  ``adapter.type = lora``, ``adapter.lora.alpha``, and for each adapted weight a pair of tensors
  ``<weight>.lora_a`` (ggml ``[in, r]``, NumPy ``(r, in)``) and ``<weight>.lora_b`` (``(out, r)``),
  in any tensor type the model loader decodes. llama.cpp scales each product by
  ``alpha / r`` when ``alpha`` is set (``llama-graph.cpp``), so that multiplier is kept here.
  Names are GGUF tensor names (``blk.0.attn_q.weight``); they are mapped to the model's modules
  when the adapter is installed (``lora_layers.py``).
- mlx-lm adapter directories (``mlx_lm.lora`` writes ``adapter_config.json`` with
  ``fine_tune_type: lora`` and ``lora_parameters.scale``, and ``adapters.safetensors`` with
  ``<module>.lora_a`` ``(in, r)`` and ``<module>.lora_b`` ``(r, out)``); the multiplier is
  ``lora_parameters.scale``.
- PEFT directories (``adapter_config.json`` with ``peft_type: LORA``, ``r``, ``lora_alpha``, and
  ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` ``(r, in)`` and
  ``lora_B.weight`` ``(out, r)``); the multiplier is ``lora_alpha / r`` (``/ sqrt(r)`` with
  ``use_rslora``).

Everything here but :func:`read_factors` is pure Python (no MLX): the HTTP side builds the
:class:`AdapterSet` at start-up, before the engine loads the model, and reads it afterwards
(``GET /lora-adapters``, the cache keys). The identity of an adapter is a BLAKE3 digest of its
files' bytes (adapters are small: tens of MiB), so a restarted server finds its disk-tier
entries again only for the very same adapter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

DIGEST_DOMAIN = b"mlxcel:lora-id:v1"
IDENTITY_DOMAIN = b"mlxcel:lora-adapter:v1"
MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file or the tensor."""


@dataclass(frozen=True)
class AdapterSpec:
    """One ``--lora FILE`` or ``--lora-scaled FILE:SCALE``: the path and its initial scale."""

    path: str
    scale: float = 1.0


@dataclass(frozen=True)
class AdapterFile:
    """One adapter as the server lists it (``GET /lora-adapters``), known before the model loads."""

    id: int
    path: str  # as given on the command line (llama-server reports it so)
    kind: str  # "gguf", "mlx" or "peft"
    identity: str  # 64 hex chars: BLAKE3 of the files' bytes
    architecture: str = ""  # a GGUF adapter's general.architecture
    alpha: float = 0.0  # a GGUF adapter's adapter.lora.alpha (0: none)
    task_name: str = ""
    prompt_prefix: str = ""


@dataclass
class LoraFactor:
    """One adapted weight: ``out += scale * multiplier * B (A x)``.

    ``target`` is the name the file gives it (a GGUF tensor or a module path), ``module`` the
    model module it adapts once known (``None`` for GGUF names until they are mapped)."""

    target: str
    module: str | None
    a: np.ndarray  # (r, in) float32
    b: np.ndarray  # (out, r) float32
    multiplier: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


# --------------------------------------------------------------------------- inspecting files


def _digest(paths: Iterable[Path]) -> str:
    from blake3 import blake3

    h = blake3(IDENTITY_DOMAIN)
    for path in paths:
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def _read_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter '{directory}': cannot read adapter_config.json: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter '{directory}': adapter_config.json is not a JSON object")
    return config


def _directory_kind(directory: Path, config: Mapping[str, Any]) -> tuple[str, Path]:
    if (directory / MLX_WEIGHTS).is_file() and "peft_type" not in config:
        kind = str(config.get("fine_tune_type", "lora")).lower()
        if kind != "lora":
            raise AdapterError(f"LoRA adapter '{directory}': fine_tune_type '{kind}' is not supported (only lora)")
        return "mlx", directory / MLX_WEIGHTS
    if (directory / PEFT_WEIGHTS).is_file():
        kind = str(config.get("peft_type", "LORA")).upper()
        if kind != "LORA" or config.get("use_dora"):
            raise AdapterError(f"LoRA adapter '{directory}': PEFT type {'DoRA' if config.get('use_dora') else kind} "
                               "is not supported (only LORA)")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise AdapterError(f"LoRA adapter '{directory}': per-module rank_pattern / alpha_pattern is not supported")
        return "peft", directory / PEFT_WEIGHTS
    raise AdapterError(f"LoRA adapter '{directory}': a directory needs adapter_config.json and "
                       f"{MLX_WEIGHTS} (mlx-lm) or {PEFT_WEIGHTS} (PEFT)")


def inspect_adapter(adapter_id: int, path: str) -> AdapterFile:
    """What the server needs to know about ``path`` before the model loads (no MLX)."""
    from mlxcel_compat.gguf.reader import GGUFError, is_gguf_path, open_gguf

    p = Path(path).expanduser()
    if p.is_dir():
        config = _read_config(p)
        kind, weights = _directory_kind(p, config)
        return AdapterFile(adapter_id, path, kind, _digest([p / "adapter_config.json", weights]))
    if not p.is_file():
        raise AdapterError(f"LoRA adapter '{path}' does not exist")
    if not is_gguf_path(p):
        raise AdapterError(f"LoRA adapter '{path}' is neither a .gguf file nor an adapter directory")
    try:
        file = open_gguf(p)
    except GGUFError as exc:
        raise AdapterError(f"LoRA adapter '{path}': {exc}") from exc
    meta = file.metadata
    if meta.get("general.type") != "adapter":
        raise AdapterError(f"LoRA adapter '{path}': general.type is {meta.get('general.type')!r}, expected 'adapter'")
    if meta.get("adapter.type") != "lora":
        raise AdapterError(f"LoRA adapter '{path}': adapter.type is {meta.get('adapter.type')!r}, expected 'lora'")
    if meta.get("adapter.alora.invocation_tokens"):
        raise AdapterError(f"LoRA adapter '{path}': activated LoRA (aLoRA) adapters are not supported")
    return AdapterFile(
        adapter_id, path, "gguf", _digest(file.parts), architecture=file.architecture,
        alpha=float(meta.get("adapter.lora.alpha", 0.0) or 0.0),
        task_name=str(meta.get("adapter.lora.task_name", "") or ""),
        prompt_prefix=str(meta.get("adapter.lora.prompt_prefix", "") or ""),
    )


# --------------------------------------------------------------------------- reading factors


def _pairs(names: Iterable[str], a_suffix: str, b_suffix: str, where: str) -> list[tuple[str, str, str]]:
    """(target, A name, B name) for every A/B pair; a lone half is an error naming it."""
    names = set(names)
    out = []
    for name in sorted(names):
        if name.endswith(a_suffix):
            target = name[: -len(a_suffix)]
            if target + b_suffix not in names:
                raise AdapterError(f"LoRA adapter '{where}': tensor '{name}' has no matching '{target + b_suffix}'")
            out.append((target, name, target + b_suffix))
        elif name.endswith(b_suffix) and name[: -len(b_suffix)] + a_suffix not in names:
            raise AdapterError(f"LoRA adapter '{where}': tensor '{name}' has no matching "
                               f"'{name[: -len(b_suffix)] + a_suffix}'")
    if not out:
        raise AdapterError(f"LoRA adapter '{where}' holds no {a_suffix} / {b_suffix} tensor pairs")
    return out


def _check_pair(where: str, a_name: str, b_name: str, a: np.ndarray, b: np.ndarray) -> None:
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(f"LoRA adapter '{where}': tensors '{a_name}' {tuple(a.shape)} and '{b_name}' "
                           f"{tuple(b.shape)} do not form a rank-r pair")


def _gguf_factors(adapter: AdapterFile) -> list[LoraFactor]:
    from mlxcel_compat.gguf.reader import open_gguf, read_tensor
    from mlxcel_compat.gguf.quants import UnsupportedTensorType, dequantize

    file = open_gguf(Path(adapter.path).expanduser())

    def values(name: str) -> np.ndarray:
        info = file.tensors[name]
        try:
            flat = dequantize(read_tensor(info), info.ggml_type, info.n_values, name=name)
        except (UnsupportedTensorType, ValueError) as exc:
            raise AdapterError(f"LoRA adapter '{adapter.path}': {exc}") from exc
        return np.ascontiguousarray(flat.reshape(info.shape), dtype=np.float32)

    factors = []
    for target, a_name, b_name in _pairs(file.tensors, ".lora_a", ".lora_b", adapter.path):
        a, b = values(a_name), values(b_name)
        _check_pair(adapter.path, a_name, b_name, a, b)
        multiplier = adapter.alpha / a.shape[0] if adapter.alpha else 1.0
        factors.append(LoraFactor(target, None, a, b, multiplier))
    return factors


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    """float32 NumPy copies of every tensor (MLX reads bfloat16, which NumPy cannot)."""
    import mlx.core as mx

    arrays = mx.load(str(path))
    return {name: np.array(value.astype(mx.float32)) for name, value in arrays.items()}


def _directory_factors(adapter: AdapterFile) -> list[LoraFactor]:
    directory = Path(adapter.path).expanduser()
    config = _read_config(directory)
    kind, weights = _directory_kind(directory, config)
    tensors = _safetensors(weights)
    factors = []
    if kind == "mlx":
        params = config.get("lora_parameters") or {}
        multiplier = float(params.get("scale", 20.0))  # mlx-lm's default LoRA scale
        for target, a_name, b_name in _pairs(tensors, ".lora_a", ".lora_b", adapter.path):
            a, b = tensors[a_name].T, tensors[b_name].T  # stored (in, r) and (r, out)
            _check_pair(adapter.path, a_name, b_name, a, b)
            factors.append(LoraFactor(target, target, np.ascontiguousarray(a), np.ascontiguousarray(b), multiplier))
        return factors
    r = float(config.get("r", 8))
    alpha = float(config.get("lora_alpha", r))
    multiplier = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    for target, a_name, b_name in _pairs(tensors, ".lora_A.weight", ".lora_B.weight", adapter.path):
        a, b = tensors[a_name], tensors[b_name]
        _check_pair(adapter.path, a_name, b_name, a, b)
        module = target.removeprefix("base_model.model.")
        factors.append(LoraFactor(target, module, np.ascontiguousarray(a), np.ascontiguousarray(b), multiplier))
    return factors


def read_factors(adapter: AdapterFile) -> list[LoraFactor]:
    """Every A/B pair of ``adapter``, as float32 (engine thread: directories are read by MLX)."""
    return _gguf_factors(adapter) if adapter.kind == "gguf" else _directory_factors(adapter)


# --------------------------------------------------------------------------- the served set


def as_scale(value: float) -> float:
    """A scale as the model applies it: float32, as llama.cpp stores it."""
    return float(np.float32(value))


@dataclass
class AdapterSet:
    """The loaded adapters and their global scales (``POST /lora-adapters`` sets them).

    Read from every thread; written by the HTTP side only. ``scales`` is replaced whole, never
    changed in place, so a reader sees either the old tuple or the new one.
    """

    adapters: list[AdapterFile] = field(default_factory=list)
    scales: tuple[float, ...] = ()

    @classmethod
    def from_specs(cls, specs: Sequence[AdapterSpec], init_without_apply: bool = False) -> "AdapterSet":
        adapters = [inspect_adapter(i, spec.path) for i, spec in enumerate(specs)]
        scales = tuple(0.0 if init_without_apply else as_scale(spec.scale) for spec in specs)
        return cls(adapters, scales)

    def __len__(self) -> int:
        return len(self.adapters)

    def from_entries(self, entries: Sequence[Any]) -> tuple[float, ...]:
        """llama-server's ``parse_lora_request`` + ``construct_lora_list``: listed ids take
        their scale, the others 0. As there, a field of the wrong type reads as its default
        (``id`` -1, ``scale`` 0) and an entry whose id is out of range is ignored. Raises
        ValueError for a non-finite scale (Python's JSON reader accepts ``NaN``)."""
        scales = [0.0] * len(self.adapters)
        for entry in entries:
            if not isinstance(entry, Mapping):
                continue
            adapter_id, scale = entry.get("id", -1), entry.get("scale", 0.0)
            if isinstance(adapter_id, bool) or not isinstance(adapter_id, int):
                adapter_id = -1
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                scale = 0.0
            if not math.isfinite(scale):
                raise ValueError("'scale' must be a finite number")
            if 0 <= adapter_id < len(scales):
                scales[adapter_id] = as_scale(scale)
        return tuple(scales)

    def for_request(self, field_value: Any) -> tuple[float, ...]:
        """The effective scales of a request: its ``lora`` list, or the global scales when the
        field is absent or empty (llama-server applies the global ones to an empty list too)."""
        if not field_value:
            return self.scales
        return self.from_entries(field_value)

    def lora_id(self, scales: Sequence[float]) -> str:
        """The prompt cache's ``lora_id``: empty when no adapter applies (the base model's
        entries), else a digest of (identity, scale) for every non-zero scale, in id order."""
        active = [(a.identity, s) for a, s in zip(self.adapters, scales) if s != 0.0]
        if not active:
            return ""
        from blake3 import blake3

        h = blake3(DIGEST_DOMAIN)
        for identity, scale in active:
            h.update(bytes.fromhex(identity) + np.float32(scale).tobytes())
        return "lora:" + h.hexdigest()

    def listing(self) -> list[dict[str, Any]]:
        """``GET /lora-adapters``."""
        return [{"id": a.id, "path": a.path, "scale": s, "task_name": a.task_name, "prompt_prefix": a.prompt_prefix}
                for a, s in zip(self.adapters, self.scales)]


def parse_scaled(item: str) -> AdapterSpec:
    """``FNAME:SCALE`` as llama-server splits it (exactly one ``:``)."""
    parts = item.split(":")
    if len(parts) != 2:
        raise ValueError("lora-scaled format: FNAME:SCALE")
    scale = float(parts[1])
    if not math.isfinite(scale):
        raise ValueError("lora-scaled format: FNAME:SCALE")
    return AdapterSpec(parts[0], scale)


def adapter_specs(settings: Any) -> list[AdapterSpec]:
    """``--lora`` and ``--lora-scaled`` in command-line order (llama-server appends both to one
    list, which gives the ids); from the environment, ``--lora`` items first."""
    positions = getattr(settings, "positions", {}) or {}
    items: list[tuple[int, int, AdapterSpec]] = []
    for name, parse in (("lora", lambda v: AdapterSpec(v, 1.0)), ("lora_scaled", parse_scaled)):
        values = tuple(getattr(settings, name, None) or ())
        where = positions.get(name, ())
        for i, value in enumerate(values):
            order = where[i] if len(where) == len(values) else (1 << 30) + (0 if name == "lora" else 1 << 20) + i
            items.append((order, i, parse(value)))
    return [spec for _, _, spec in sorted(items, key=lambda t: (t[0], t[1]))]


__all__ = ["AdapterError", "adapter_specs", "AdapterFile", "AdapterSet", "AdapterSpec", "LoraFactor", "as_scale", "inspect_adapter",
           "parse_scaled", "read_factors"]
