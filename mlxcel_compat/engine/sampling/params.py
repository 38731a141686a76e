"""A request's sampling parameters (``SamplingParams``), named and defaulted as in llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: the chain draws a random seed instead

DEFAULT_SAMPLERS: tuple[str, ...] = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)

DEFAULT_DRY_SEQUENCE_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")


@dataclass
class SamplingParams:
    """Per-request sampling settings, named and defaulted as in llama.cpp."""

    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(
        default_factory=lambda: list(DEFAULT_DRY_SEQUENCE_BREAKERS)
    )
    min_keep: int = 0
    seed: int = DEFAULT_SEED
    samplers: list[str] = field(default_factory=lambda: list(DEFAULT_SAMPLERS))
    logit_bias: dict[int, float] = field(default_factory=dict)
    ignore_eos: bool = False
    n_probs: int = 0
    post_sampling_probs: bool = False
    # Not in the default chain; mirostat replaces it when set to 1 or 2.
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9

    def to_json(self, seed: int | None = None) -> dict[str, Any]:
        """The sampling keys of llama.cpp's ``generation_settings``, in its order.

        Pass ``seed=chain.seed`` to report the seed actually drawn for a random one.
        """
        return {
            "seed": self.seed if seed is None else seed,
            "temperature": self.temperature,
            "dynatemp_range": self.dynatemp_range,
            "dynatemp_exponent": self.dynatemp_exponent,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "top_n_sigma": self.top_n_sigma,
            "xtc_probability": self.xtc_probability,
            "xtc_threshold": self.xtc_threshold,
            "typical_p": self.typical_p,
            "repeat_last_n": self.repeat_last_n,
            "repeat_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "dry_multiplier": self.dry_multiplier,
            "dry_base": self.dry_base,
            "dry_allowed_length": self.dry_allowed_length,
            "dry_penalty_last_n": self.dry_penalty_last_n,
            "dry_sequence_breakers": list(self.dry_sequence_breakers),
            "samplers": list(self.samplers),
        }
