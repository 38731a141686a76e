"""Slots: llama-server's unit of concurrency, as seen by ``/slots`` and ``id_slot``, and how much
context each one gets."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxcel_compat.engine.kept_state import KeptState

if TYPE_CHECKING:
    from mlxcel_compat.engine.sequence import Sequence


CTX_PAD = 256  # llama.cpp pads the context (and each sequence's share) to a multiple of this


def _pad(n: int) -> int:
    return -(-n // CTX_PAD) * CTX_PAD


def slot_context(ctx_size: int, n_parallel: int, kv_unified: bool, n_ctx_train: int) -> tuple[int, int]:
    """``(n_ctx_total, n_ctx_slot)`` as llama.cpp computes them (llama_context + server slots).

    ``-c N`` (0: the model's training context) is padded to a multiple of 256. With one unified
    KV buffer every slot may use all of it; otherwise each slot gets ``N / n_parallel``, itself
    padded to 256 (so the total is rounded to ``n_slot * n_parallel``). A slot never gets more
    than the model was trained for.
    """
    n_ctx = _pad(ctx_size or n_ctx_train)
    if kv_unified or n_parallel <= 1:
        n_slot = n_ctx
    else:
        n_slot = _pad(n_ctx // n_parallel)
        n_ctx = n_slot * n_parallel
    return n_ctx, min(n_slot, n_ctx_train)


@dataclass
class SlotTask:
    """What ``/slots`` reports about the slot's current or last task (plain Python values)."""

    id_task: int
    params: dict[str, Any]
    n_predict: int
    # Filled in when the task ends: the tokens the slot keeps, and whether it stopped before
    # its end (cancelled or failed), which llama-server's idle slot still shows as has_next_token.
    n_tokens_in_slot: int = 0
    has_next_token: bool = False
    # Image tokens in the task's prompt (a vision model); /slots shows them only when there are some.
    n_media_tokens: int = 0


@dataclass
class Slot:
    id: int
    n_ctx: int = 0
    sequence: "Sequence | None" = None
    task: SlotTask | None = None
    t_last_used: float = field(default=0.0)
    kept: KeptState | None = None  # only while slot files are enabled
    speculative: bool = False  # the server decodes speculatively (llama-server's can_speculate)

    def begin(self, sequence: "Sequence") -> None:
        self.sequence = sequence
        req = sequence.request
        params = dict(req.slot_params) if req.slot_params else req.sampling.to_json()
        params["seed"] = sequence.chain.seed
        self.task = SlotTask(
            id_task=req.task_id,
            params=params,
            n_predict=req.n_predict,
            n_media_tokens=sum(end - start for start, end in req.media.spans) if req.media is not None else 0,
        )

    @property
    def is_processing(self) -> bool:
        """Busy with a task that has not finished. (A finished sequence keeps its slot for the rest
        of the engine step, for donation; a client that saw the finish must see the slot idle.)"""
        return self.sequence is not None and self.sequence.finished is None

    def end(self) -> None:
        seq = self.sequence
        if seq is not None and self.task is not None:
            self.task.n_tokens_in_slot = len(seq.cache_tokens)
            self.task.has_next_token = seq.finished is None or seq.finished.cancelled
        self.sequence = None
        self.t_last_used = time.monotonic()

    def to_json(self) -> dict[str, Any]:
        """llama-server's ``/slots`` element; read from the HTTP side (benign races only).

        A slot that has run a task shows it; once the task ends, llama-server resets the slot's
        counts (``server_slot::reset``): its tokens stay, processed/cached/decoded are 0, the
        budget is unlimited (``n_remain`` -1) and no newline is pending.
        """
        seq = self.sequence
        out: dict[str, Any] = {"id": self.id, "n_ctx": self.n_ctx, "speculative": self.speculative,
                               "is_processing": self.is_processing}
        task = self.task
        if task is None:
            return out
        if seq is not None and seq.finished is None:
            n_decoded = len(seq.generated)
            in_slot, processed, cached = len(seq.cache_tokens), seq.stats.n_prompt_processed, seq.stats.n_cached
            n_remain = -1 if task.n_predict < 0 else max(task.n_predict - n_decoded, 0)
            has_next, has_new_line = True, seq.lines.has_new_line
        else:
            in_slot = len(seq.cache_tokens) if seq is not None else task.n_tokens_in_slot
            n_decoded = processed = cached = 0
            n_remain, has_new_line = -1, False
            has_next = seq.finished.cancelled if seq is not None and seq.finished is not None else task.has_next_token
        out.update(
            id_task=task.id_task,
            n_prompt_tokens=in_slot,  # llama-server: tokens currently held in the slot
            n_prompt_tokens_processed=processed,
            n_prompt_tokens_cache=cached,
            params=task.params,
            next_token=[{"has_next_token": has_next, "has_new_line": has_new_line, "n_remain": n_remain, "n_decoded": n_decoded}],
        )
        if task.n_media_tokens:
            out["n_media_tokens"] = task.n_media_tokens  # (mlxcel: llama-server has no such field)
        return out
