"""An in-process engine on a generated model, driven the way the HTTP side drives it."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST
from mlxcel_compat.engine.core import Engine, EngineConfig
from mlxcel_compat.engine.prefix_cache import PrefixCache
from mlxcel_compat.engine.prefix_cache_config import PrefixCacheConfig
from mlxcel_compat.engine.request import CacheContext, ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
from mlxcel_compat.engine.sampling.params import SamplingParams


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # top-n of each step
    finish: FinishEvent | None = None


class EngineHarness:
    def __init__(self, model_dir: Path, batch_size: int = 16, n_parallel: int = 2, speculative: Any = None,
                 ctx_size: int = 4096, context_shift: bool = False, load_options: Any = None,
                 **cache_config: Any) -> None:
        config = PrefixCacheConfig(**{"min_prefix": 8, "capacity_bytes": 1 << 30, **cache_config})
        self.engine = Engine(
            EngineConfig(model=str(model_dir), ctx_size=ctx_size, n_parallel=n_parallel, batch_size=batch_size,
                         speculative=speculative, context_shift=context_shift, load_options=load_options),
            prefix_cache_factory=lambda engine: PrefixCache(engine, config),
        )
        self.engine.start()
        assert self.engine.wait_ready(180), self.engine.load_error

    @property
    def tokenizer(self) -> Any:
        return self.engine.loaded.tokenizer

    def request(
        self,
        prompt: list[int],
        n_predict: int = 8,
        cache: bool = True,
        session: str = "s",
        n_probs: int = 0,
        ignore_eos: bool = False,
        boundary: int | None = None,
        n_keep: int = 0,
        n_discard: int = 0,
    ) -> GenerationRequest:
        return GenerationRequest(
            prompt_tokens=list(prompt),
            sampling=SamplingParams(temperature=0.0, seed=1234, ignore_eos=ignore_eos),
            n_predict=n_predict,
            n_probs=n_probs,
            n_keep=n_keep,
            n_discard=n_discard,
            cache=CacheContext(
                enabled=cache, session_key=session, template_sig=RAW_PROMPT_TEMPLATE_SIG, mm_digest=TEXT_ONLY_MM_DIGEST, history_boundary=boundary
            ),
        )

    def submit(self, prompt: list[int], sink: Any, **kwargs: Any) -> GenerationRequest:
        request = self.request(prompt, **kwargs)
        self.engine.submit(request, sink)
        return request

    def run(self, prompt: list[int], **kwargs: Any) -> Run:
        events: queue.Queue = queue.Queue()
        self.submit(prompt, events.put, **kwargs)
        return collect(events)

    def on_engine(self, fn: Any) -> Any:
        """Run ``fn`` on the engine thread (the owner of every MLX object and of the store)."""
        return self.engine.call(fn).result(timeout=60)

    def stats(self) -> dict[str, Any]:
        return self.on_engine(self.engine.prefix_cache.stats)

    def reset(self) -> None:
        self.on_engine(self.engine.prefix_cache.reset)

    def close(self) -> None:
        self.engine.stop()


def disk_tier_harness(model_dir: Path, disk_dir: Path) -> EngineHarness:
    """The media tests' engine: two slots, 16-token chunks, a small minimum prefix, and a
    write-through disk tier, so each cache rule is checked in RAM and on disk."""
    return EngineHarness(model_dir, batch_size=16, n_parallel=2, min_prefix=4, disk_dir=str(disk_dir),
                         disk_capacity_bytes=1 << 28, disk_write_through=True)


def collect(events: queue.Queue) -> Run:
    """Read one sequence's events until it finishes."""
    out = Run()
    while True:
        event = events.get(timeout=120)
        if isinstance(event, TokenEvent):
            out.tokens.append(event.token)
            if event.top is not None:
                out.logprobs.append({tp.id: tp.logprob for tp in event.top})
        elif isinstance(event, FinishEvent):
            out.finish = event
            return out
        elif isinstance(event, ErrorEvent):
            raise AssertionError(event.message)
