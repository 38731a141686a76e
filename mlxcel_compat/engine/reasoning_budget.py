"""The thinking budget (``reasoning_budget_tokens``): end a ``<think>`` block after N tokens.

llama.cpp runs this as a sampler (``common/reasoning-budget.cpp``); the state machine here follows
it, token by token:

    IDLE --start tag--> COUNTING --N tokens--> FORCING --forced tokens done--> DONE
                           |  \\--budget spent mid UTF-8 character--> WAITING_UTF8 --> FORCING
                           \\--end tag (the model closed the block itself)--> DONE
    DONE --start tag--> COUNTING (a new block gets a fresh budget)
    COUNTING --force() (POST /v1/chat/completions/control, reasoning_end)--> FORCING

While FORCING, the only token allowed is the next one of ``forced`` (the optional
``reasoning_budget_message`` followed by the end tag): the sequence masks every other logit to
-inf before its sampler chain runs. A prompt that already opens the block (a template that
starts thinking for the model) starts in COUNTING. Pure Python: the engine applies the mask.

``reasoning_control: true`` arms the same machine with no budget (``control``): the block runs
until the model closes it, or until :meth:`ReasoningBudget.force` ends it on request, as
llama.cpp's ``common_reasoning_budget_force`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

IDLE, COUNTING, WAITING_UTF8, FORCING, DONE = "idle", "counting", "waiting_utf8", "forcing", "done"
IN_FLIGHT_STEPS = 2  # decode steps sampled ahead of the engine's commands at most (pipelining, a batch)


@dataclass(frozen=True)
class ReasoningBudgetSpec:
    """What a request asks for, tokenized by the HTTP side (plain ints, safe to send to the engine)."""

    budget: int  # tokens allowed inside one thinking block (0: close it at once)
    start: tuple[int, ...]  # the start tag's tokens ("<think>")
    end: tuple[int, ...]  # the end tag's tokens ("</think>")
    forced: tuple[int, ...]  # reasoning_budget_message + end tag, forced when the budget is spent
    open_at_start: bool = False  # the prompt ends inside an open thinking block
    control: bool = False  # reasoning_control: the block may be ended on request (force)


def opens_block(prompt: Sequence[int], start: Sequence[int], end: Sequence[int]) -> bool:
    """True when the last start tag in ``prompt`` comes after the last end tag."""

    def last(seq: Sequence[int]) -> int:
        n = len(seq)
        for i in range(len(prompt) - n, -1, -1):
            if n and list(prompt[i : i + n]) == list(seq):
                return i
        return -1

    return bool(start) and last(start) > last(end)


class _Matcher:
    """Finds a token sequence in a token stream, one token at a time (as llama.cpp's matcher)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.pos = 0

    def advance(self, token: int) -> bool:
        if not self.tokens:
            return False
        if token == self.tokens[self.pos]:
            self.pos += 1
            if self.pos == len(self.tokens):
                self.pos = 0
                return True
            return False
        self.pos = 1 if token == self.tokens[0] else 0
        return False

    def reset(self) -> None:
        self.pos = 0


class ReasoningBudget:
    """One sequence's budget state. ``accept`` every generated token, in order; ``forced_token``
    says which token the next step must produce (None: sample freely)."""

    def __init__(self, spec: ReasoningBudgetSpec, utf8_complete: Callable[[int], bool] | None = None) -> None:
        self.spec = spec
        self._start = _Matcher(spec.start)
        self._end = _Matcher(spec.end)
        self._utf8_complete = utf8_complete or (lambda token: True)
        self.state = IDLE
        self.remaining = spec.budget
        self._force_pos = 0
        self._in_flight = 0  # tokens a force() on request may still see sampled before it
        if spec.open_at_start:
            self._open()

    def forced_token(self) -> int | None:
        if self.state == FORCING and self._force_pos < len(self.spec.forced):
            return self.spec.forced[self._force_pos]
        return None

    def accept(self, token: int) -> None:
        state = self.state
        if state in (IDLE, DONE):
            if self._start.advance(token):
                self._end.reset()
                self._open()
        elif state in (COUNTING, WAITING_UTF8):
            if self._end.advance(token):
                self.state = DONE  # the model closed the block itself
                return
            complete = self._utf8_complete(token)
            if state == WAITING_UTF8:
                if complete:
                    self._force()
            else:
                self.remaining -= 1
                if self.remaining <= 0:
                    if complete:
                        self._force()
                    else:
                        self.state = WAITING_UTF8
                        self._end.reset()
        elif state == FORCING:
            if self._in_flight and token != self.spec.forced[self._force_pos]:
                # Sampled before a force() on request took effect (a pipelined step already in
                # flight): not part of the forced sequence.
                self._in_flight -= 1
                return
            self._in_flight = 0
            self._force_pos += 1
            if self._force_pos >= len(self.spec.forced):
                self.state = DONE

    def force(self) -> bool:
        """End the open block now (llama.cpp's ``common_reasoning_budget_force``): only a block
        being counted is forced; in any other state nothing changes. Whether it was forced."""
        if self.state != COUNTING:
            return False
        self._force()
        self._in_flight = IN_FLIGHT_STEPS
        return True

    def _open(self) -> None:
        self.state = COUNTING
        self.remaining = self.spec.budget
        if self.remaining <= 0:
            self._force()

    def _force(self) -> None:
        self.state = FORCING if self.spec.forced else DONE
        self._force_pos = 0
        self._end.reset()


def end_reasoning(slots: Sequence[object], task_ids: Sequence[int]) -> int:
    """On the engine thread: force the end of the reasoning block of the running sequences of
    ``task_ids`` that armed ``reasoning_control``; how many were forced. A sequence still waiting
    for a slot has no block to end (llama-server answers the same)."""
    forced = 0
    wanted = set(task_ids)
    for slot in slots:
        seq = getattr(slot, "sequence", None)
        budget = getattr(seq, "budget", None)
        if seq is not None and seq.request.task_id in wanted and budget is not None and budget.spec.control:
            forced += budget.force()
    return forced
