"""Which model families get APC: recognising recurrent and hybrid models from ``config.json``.

APC cuts a stored entry to a shorter prefix. That is only sound for state that is a
token-indexed KV table. Recurrent (SSM, linear-attention, RWKV) and hybrid families fold
every token into a fixed-size state that cannot give tokens back, so APC is turned off for
them at start-up. Whole-prefix reuse keeps working.

The spec's list is matched against three places, because wrappers and converted
checkpoints put the family name in different spots:

- ``model_type`` (exact, case-insensitive),
- ``text_config.model_type`` (multimodal wrappers around a recurrent text model),
- ``architectures`` (class names such as ``Qwen3NextForCausalLM``: matched after lower-casing
  and dropping ``_`` and ``-``, so ``qwen3_next`` is found in ``qwen3nextforcausallm``).

Nothing here imports mlx; the engine adds a probe of the real cache objects on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

RECURRENT_MODEL_TYPES: tuple[str, ...] = (
    "jamba",
    "mamba",
    "mamba2",
    "nemotron_h",
    "gated_delta",
    "kimi_linear",
    "kimi_k3",
    "qwen3_next",
    "falcon_mamba",
    "longcat_flash",
    "longcat_flash_ngram",
    "rwkv7",
    "recurrent_gemma",
    "baichuan_m1",
)


@dataclass(frozen=True, slots=True)
class FamilyMatch:
    """Where a recurrent family name was found."""

    family: str  # the entry of RECURRENT_MODEL_TYPES that matched
    field: str  # "model_type", "text_config.model_type" or "architectures"
    value: str  # the config value that contained it

    def describe(self) -> str:
        return f"{self.field}={self.value!r} matches {self.family}"


def _squash(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


_SQUASHED = tuple((_squash(name), name) for name in RECURRENT_MODEL_TYPES)


def _match_type(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    lowered = value.strip().lower()
    return lowered if lowered in RECURRENT_MODEL_TYPES else None


def _match_architecture(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    squashed = _squash(value)
    # Longest name first, so "falconmamba..." reports falcon_mamba rather than mamba.
    for key, name in sorted(_SQUASHED, key=lambda pair: -len(pair[0])):
        if key in squashed:
            return name
    return None


def recurrent_family(config: Mapping[str, object]) -> FamilyMatch | None:
    """The recurrent/hybrid family a model belongs to, or None for attention-only models.

    Args:
        config: the model's parsed ``config.json``.

    Returns:
        The first match in the order model_type, text_config.model_type, architectures.
    """
    family = _match_type(config.get("model_type"))
    if family is not None:
        return FamilyMatch(family, "model_type", str(config["model_type"]))
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping):
        family = _match_type(text_config.get("model_type"))
        if family is not None:
            return FamilyMatch(family, "text_config.model_type", str(text_config["model_type"]))
    architectures = config.get("architectures")
    if isinstance(architectures, (list, tuple)):
        for arch in architectures:
            family = _match_architecture(arch)
            if family is not None:
                return FamilyMatch(family, "architectures", str(arch))
    return None
