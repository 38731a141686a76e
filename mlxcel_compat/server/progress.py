"""``return_progress``: llama-server's ``prompt_progress`` reports, for every streaming API.

llama-server reports a slot's prompt progress at two kinds of moments (``server-context.cpp``):

- once when the slot starts the prompt, after the cache lookup: ``processed`` = ``cache`` = the
  reused prefix (at most the prompt minus one token: the last one is always evaluated);
- after each ``llama_decode`` of a logical batch: ``-b`` (``n_batch``) prompt tokens from where
  the previous batch ended, the last prompt token included, so the last report has
  ``processed == total``.

``processed`` counts the cached tokens too, ``time_ms`` is whole milliseconds since the slot
started the prompt, and with ``timings_per_token`` each report also carries the running
``timings`` (``prompt_n`` the tokens evaluated so far, nothing predicted yet).

This engine evaluates the prompt in its own steps: chunks of ``min(-b, -ub)`` aligned on
absolute multiples of it, then the last prompt token alone, and emits a ``ProgressEvent`` at each.
:class:`PromptProgress` turns those into llama-server's reports: it sends each point of
llama-server's schedule once the engine has passed it, so a client sees the same counts, in the
same number of reports, for the same prompt and ``-b``. Every API formats the reports in its own
shape (native and OpenAI chunks, Responses ``response.in_progress`` events).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxcel_compat.engine.request import ProgressEvent, TokenEvent
from mlxcel_compat.server import formats as fmt


@dataclass
class ProgressReport:
    """One llama-server progress report: the ``prompt_progress`` object and, with
    ``timings_per_token``, the running ``timings``."""

    prompt_progress: dict[str, int]
    timings: dict[str, Any] | None = None

    def attach(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` with ``timings`` (if any) and ``prompt_progress`` added, in llama-server's order."""
        if self.timings is not None:
            payload["timings"] = self.timings
        payload["prompt_progress"] = self.prompt_progress
        return payload


@dataclass
class _Schedule:
    total: int
    cache: int
    next: int  # the next ``processed`` count to report; > total once the last one went out


@dataclass
class PromptProgress:
    """llama-server's progress schedule for the sequences of one response (keyed by index)."""

    batch: int  # llama-server's n_batch: -b, at most the whole context
    timings: bool = False  # timings_per_token
    _schedules: dict[int, _Schedule] = field(default_factory=dict)

    @classmethod
    def for_request(cls, ctx: Any, timings_per_token: bool) -> "PromptProgress":
        batch = int(ctx.settings.batch_size)
        n_ctx_total = int(getattr(ctx.engine, "n_ctx_total", 0) or 0)
        if n_ctx_total > 0:  # llama.cpp caps a causal model's n_batch at the context size
            batch = min(batch, n_ctx_total)
        return cls(batch=max(1, batch), timings=timings_per_token)

    def feed(self, index: int, event: ProgressEvent) -> list[ProgressReport]:
        """The reports llama-server would have sent by the time the engine reached ``event``."""
        schedule = self._schedules.get(index)
        if schedule is None:
            # The first event fixes the reused prefix; its report is llama-server's first one.
            schedule = self._schedules[index] = _Schedule(event.total, event.cache, event.cache)
        reports = []
        while schedule.next <= min(event.processed, schedule.total):
            processed = schedule.next
            reports.append(self._report(schedule, processed, event))
            step = min(processed + self.batch, schedule.total) if processed < schedule.total else schedule.total + 1
            schedule.next = step
        return reports

    def _report(self, schedule: _Schedule, processed: int, event: ProgressEvent) -> ProgressReport:
        started = processed == schedule.cache  # the start report: nothing evaluated yet
        progress = {"total": schedule.total, "cache": schedule.cache, "processed": processed, "time_ms": int(event.time_ms)}
        if not self.timings:
            return ProgressReport(progress)
        # Rendered by the same code as the running timings of token events: a TokenEvent with
        # nothing predicted yet (llama-server's progress partials carry token 0 too).
        running = TokenEvent(
            token=0,
            text="",
            n_decoded=0,
            id_slot=event.id_slot,
            n_prompt=processed,
            n_cached=schedule.cache,
            prompt_ms=0.0 if started else event.time_ms,
            predicted_ms=0.0,
        )
        return ProgressReport(progress, fmt.timings_json(running))
