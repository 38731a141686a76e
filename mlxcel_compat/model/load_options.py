"""How llama-server's loading flags reach the loader: the RoPE/YaRN overrides, ``--override-kv``,
``--mmap``/``--no-mmap`` and ``--mlock``, read once from the settings.

The RoPE flags are applied to the model's config (a directory's ``config.json`` or the config
synthesised from a GGUF's metadata) before the model is built, as llama.cpp's context parameters
override the file's hyperparameters, in the config's own terms (mlx-lm's ``rope_theta`` and
``rope_scaling``):

- ``--rope-freq-base N``: ``rope_theta = N``;
- ``--rope-freq-scale S`` or ``--rope-scale N`` (``S = 1/N``; ``--rope-freq-scale`` wins where both
  are given): the scaling factor ``1/S``, with the model's scaling type, else linear;
- ``--rope-scaling none|linear|yarn``: that type (``none`` drops the model's scaling and any factor);
- ``--yarn-orig-ctx N`` (else the model's, else its training context), ``--yarn-beta-fast``,
  ``--yarn-beta-slow``: the YaRN parameters (yarn only).

A value of 0 (llama.cpp's default for the base, the scales and the original context) means "the
model's". A model whose scaling is of another kind (Llama 3's, LongRoPE) takes only the base.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlxcel_compat.gguf.overrides import KvOverride, overrides_json, parse_kv_overrides
from mlxcel_compat.runtime.kv_precision import KvTypes

SCALING_TYPES = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeOverrides:
    """The RoPE/YaRN flags; ``None`` (or 0) = the model's value."""

    scaling: str | None = None
    scale: float | None = None
    freq_base: float | None = None
    freq_scale: float | None = None
    yarn_orig_ctx: int | None = None
    yarn_beta_fast: float | None = None
    yarn_beta_slow: float | None = None

    def __bool__(self) -> bool:
        return any(v not in (None, 0) for v in (self.scaling, self.scale, self.freq_base, self.freq_scale,
                                                 self.yarn_orig_ctx, self.yarn_beta_fast, self.yarn_beta_slow))

    def factor(self) -> float | None:
        """The context scaling factor the flags ask for (``1 / freq_scale``), or None."""
        if self.freq_scale:
            return 1.0 / self.freq_scale
        return float(self.scale) if self.scale else None

    def apply(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with the overrides applied (a new dict); ``ValueError`` for a combination the
        model's RoPE cannot take."""
        out = dict(config)
        if self.freq_base:
            out["rope_theta"] = float(self.freq_base)
        current = out.get("rope_scaling") or None
        current_kind = None if current is None else (current.get("type") or current.get("rope_type"))
        factor = self.factor()
        yarn_params = any((self.yarn_orig_ctx, self.yarn_beta_fast, self.yarn_beta_slow))
        if self.scaling == "none":
            out["rope_scaling"] = None
            return out
        if not (self.scaling or factor or yarn_params):
            return out
        kind = self.scaling or current_kind or ("yarn" if yarn_params else "linear")
        if kind not in ("linear", "yarn"):
            raise ValueError(f"the model's RoPE scaling is '{kind}': --rope-scale/--rope-freq-scale and the "
                             "YaRN flags apply to linear or yarn scaling only (--rope-scaling picks one)")
        base = dict(current) if current is not None and current_kind == kind else {}
        scaling = {**base, "type": kind, "rope_type": kind,
                   "factor": float(factor if factor is not None else base.get("factor", 1.0))}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = int(
                self.yarn_orig_ctx or base.get("original_max_position_embeddings")
                or out.get("max_position_embeddings") or 4096)
            if self.yarn_beta_fast:
                scaling["beta_fast"] = float(self.yarn_beta_fast)
            if self.yarn_beta_slow:
                scaling["beta_slow"] = float(self.yarn_beta_slow)
        out["rope_scaling"] = scaling
        return out

    def describe(self) -> str:
        parts = [f"{name}={value}" for name, value in vars(self).items() if value not in (None, 0)]
        return ", ".join(parts)


@dataclass(frozen=True)
class LoadOptions:
    """Everything the flags change about loading a model (defaults: the file as it is)."""

    rope: RopeOverrides = field(default_factory=RopeOverrides)
    kv_overrides: tuple[KvOverride, ...] = ()
    use_mmap: bool = True
    mlock: bool = False
    kv_types: KvTypes = field(default_factory=KvTypes)  # -ctk/-ctv: what the KV cache stores

    def mark(self, fingerprint: str) -> str:
        """The model fingerprint as these options change it: KV computed under other RoPE
        parameters or metadata must never be adopted by the prompt cache or its disk tier."""
        if not self.rope and not self.kv_overrides:
            return fingerprint
        from blake3 import blake3

        changes = json.dumps({"rope": vars(self.rope), "kv": overrides_json(self.kv_overrides)}, sort_keys=True)
        return blake3(f"{fingerprint}\0{changes}".encode()).hexdigest()

    @classmethod
    def from_settings(cls, s: Any) -> "LoadOptions":
        """From the resolved settings; ``ValueError`` names a malformed ``--override-kv`` item."""
        rope = RopeOverrides(
            scaling=s.rope_scaling or None, scale=s.rope_scale, freq_base=s.rope_freq_base,
            freq_scale=s.rope_freq_scale, yarn_orig_ctx=s.yarn_orig_ctx, yarn_beta_fast=s.yarn_beta_fast,
            yarn_beta_slow=s.yarn_beta_slow,
        )
        return cls(rope=rope, kv_overrides=parse_kv_overrides(s.override_kv or ()),
                   use_mmap=s.mmap is not False, mlock=bool(s.mlock),
                   kv_types=KvTypes(s.cache_type_k or "f16", s.cache_type_v or "f16"))


__all__ = ["LoadOptions", "RopeOverrides", "SCALING_TYPES"]
