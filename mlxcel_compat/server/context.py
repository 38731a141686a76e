"""Long-lived server state handed to every handler (through ``request.app.state.ctx``).

It is filled in two steps: the listener starts right away (so ``/health`` can say "Loading model"),
and :meth:`ServerContext.on_model_loaded` fills in the model-derived parts once the engine is ready.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from mlxcel_compat.engine.client import EngineClient
from mlxcel_compat.engine.core import Engine
from mlxcel_compat.engine.request import EngineEvent, ErrorEvent, FinishEvent, GenerationRequest
from mlxcel_compat.tokenizer.fim import FimTokens
from mlxcel_compat.lora.adapters import AdapterSet
from mlxcel_compat.server.controls import RunningCompletions
from mlxcel_compat.server.prompts import PromptBound
from mlxcel_compat.server.streams import StreamSessions
from mlxcel_compat.server.workers import WorkerPool, pool_size


BODY_BYTES_PER_TOKEN = 64  # the default body cap per context token (see max_body_bytes)


@dataclass
class ModelInfo:
    """Model facts the HTTP side needs; plain Python, safe to read from any thread."""

    model_id: str
    aliases: list[str]
    path: str
    tokenizer: Any
    vocab_size: int
    n_ctx: int
    n_ctx_train: int
    n_embd: int
    n_params: int
    size_bytes: int
    eog_ids: list[int]
    bos_id: int | None  # set when the tokenizer adds a BOS to plain text
    bos_token: str
    eos_token: str
    chat_template: Any  # mlxcel_compat.chat.template.ChatTemplate | None
    tags: list[str] = field(default_factory=list)  # --tags, sorted
    file_type: str = "F32"  # llama.cpp's file type name for a GGUF ("Q4_K - Medium"); F32 otherwise
    format: str = "safetensors"  # "gguf" or "safetensors"
    chars_per_token: int | None = None  # proven bound (server.prompts.max_chars_per_token)
    fim: FimTokens = field(default_factory=FimTokens)  # fill-in-the-middle tokens (/infill)
    pooling: str = "none"  # embeddings: --pooling, --rerank's rank, else the model's own (encoders/pooling.py)
    rank_head: Any = None  # model.rerank.RankHead of a reranker served with pooling rank
    kind: str = "decoder"  # "encoder": a BERT-family model, embeddings and rerank only (no generation)


@dataclass
class ServerContext:
    settings: Any
    engine: Engine
    api_keys: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    model: ModelInfo | None = None
    metrics: Any = None  # server.metrics.Metrics
    cache_hooks: Any = None  # prompt-cache request preparation (session key, template signature)
    draining: bool = False  # SIGTERM/SIGINT received: new requests get 503
    structured: Any = None  # server.structured.StructuredOutput: grammars, schemas, tool calls
    adapters: AdapterSet = field(default_factory=AdapterSet)  # LoRA adapters and their global scales
    media: Any = None  # server.media.ImageInput when the served model takes images or audio, else None
    streams: StreamSessions = field(default_factory=StreamSessions)  # resumable streams (X-Conversation-Id)
    completions: RunningCompletions = field(default_factory=RunningCompletions)  # streamed chats, for /control
    # Called (on a thread) when a shutdown begins: what would hold a running request past it, such as
    # an MCP tool call, is ended at once, as llama-server's shutdown ends them.
    on_drain: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.streams.max_bytes = getattr(self.settings, "stream_buffer_bytes", self.streams.max_bytes)
        self.client = EngineClient(self.engine)
        self.workers = WorkerPool(pool_size(self.settings.threads_http))

    @property
    def ready(self) -> bool:
        return self.model is not None and self.engine.state == "ready"

    @property
    def max_body_bytes(self) -> int:
        """``--max-body-bytes``, by default ``max(1 MiB, 64 bytes x context size)``: room for any
        prompt that fits the context (text or token ids, JSON-escaped), and no more; a vision model
        adds one base64 image at ``--media-max-bytes``."""
        if self.settings.max_body_bytes is not None:
            return self.settings.max_body_bytes
        text = max(1 << 20, BODY_BYTES_PER_TOKEN * self.engine.n_ctx)
        if self.media is not None:  # a vision model: room for one image at --media-max-bytes, base64-encoded
            return text + -(-4 * self.media.limits.max_bytes // 3)
        return text

    @property
    def prompt_bound(self) -> PromptBound:
        assert self.model is not None
        return PromptBound(self.model.n_ctx, self.model.chars_per_token)

    @functools.cached_property
    def ui_settings(self) -> dict[str, Any]:
        """The chat page's default settings (``--ui-config-file``, then ``--ui-config`` over it),
        read once; /props returns them. Both were checked to be JSON objects at start-up."""
        values: dict[str, Any] = {}
        if self.settings.ui_config_file:
            with open(os.path.expanduser(self.settings.ui_config_file), encoding="utf-8") as f:
                values.update(json.load(f))
        values.update(self.settings.ui_config or {})
        return values

    @property
    def cache_isolation(self) -> str:
        """``--prompt-cache-isolation``, defaulting to api-key with more than one key, else none."""
        chosen = self.settings.prompt_cache_isolation
        return chosen if chosen else ("api-key" if len(self.api_keys) > 1 else "none")

    def tokenize(self, text: str) -> list[int]:
        """Plain text to tokens, no special tokens added (logit_bias keys, /tokenize)."""
        assert self.model is not None
        return list(self.model.tokenizer.encode(text, add_special_tokens=False))

    def tokenize_rendered(self, text: str) -> list[int]:
        """A rendered chat prompt to tokens: special tokens parsed; BOS added once if the model wants one."""
        assert self.model is not None
        tokens = self.tokenize(text)
        bos = self.model.bos_id
        if bos is not None and (not tokens or tokens[0] != bos):
            tokens.insert(0, bos)
        return tokens

    async def run(self, requests: list[GenerationRequest], incremental: bool = True
                  ) -> AsyncIterator[tuple[int, EngineEvent]]:
        """Run several sequences concurrently; yield ``(index in requests, event)`` as they come
        (``incremental=False``: each sequence's events once it has finished, EngineClient.generate).

        Leaving the iteration early cancels every sequence that has not finished.
        """
        if len(requests) == 1:
            async for event in self.client.generate(requests[0], incremental):
                yield 0, event
            return
        merged: asyncio.Queue[tuple[int, EngineEvent]] = asyncio.Queue()

        async def pump(i: int, req: GenerationRequest) -> None:
            async for event in self.client.generate(req, incremental):
                await merged.put((i, event))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        remaining = len(requests)
        try:
            while remaining:
                i, event = await merged.get()
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    remaining -= 1
                yield i, event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
