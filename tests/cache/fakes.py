"""Shared stand-ins for the cache bookkeeping tests (no MLX)."""

from __future__ import annotations

from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, Bucket


class FakeClock:
    """An injectable clock that only moves when told to (TTL tests)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_bucket(model_id: str = "tiny", mm_digest: bytes = TEXT_ONLY_MM_DIGEST, namespace: str = "") -> Bucket:
    return Bucket(
        model_id=model_id, lora_id="", template_sig=RAW_PROMPT_TEMPLATE_SIG, rope_regime=None, mm_digest=mm_digest, namespace=namespace
    )
