"""What other threads put on the engine thread's command queue (``Engine.submit``, ``cancel``,
``warmup``, ``call``, ``call_on_slot``, ``shutdown``): plain records, drained between steps."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from mlxcel_compat.engine.request import GenerationRequest, Sink, WarmupJob
from mlxcel_compat.engine.slots import Slot


@dataclass
class Submit:
    """A request to run; its events go to ``sink``."""

    request: GenerationRequest
    sink: Sink


@dataclass
class Cancel:
    """Stop a waiting or running request (the client went away)."""

    task_id: int


@dataclass
class Warmup:
    """A background warm-up of a session's next turn (snapshot families only)."""

    job: WarmupJob


@dataclass
class Call:
    """Run ``fn`` on the engine thread between steps; its result or exception goes to ``future``."""

    fn: Callable[[], Any]
    future: Future
    wake: bool = False  # reload a sleeping model first (fn uses the weights)


@dataclass
class Shutdown:
    """Begin a shutdown: refuse new and waiting requests (and the running ones too)."""

    running_too: bool  # False: refuse new and waiting requests only


@dataclass
class SlotCall:
    """Run ``fn(slot)`` once the slot is idle (slot save/restore/erase)."""

    slot_id: int
    fn: Callable[[Slot], Any]
    future: Future
