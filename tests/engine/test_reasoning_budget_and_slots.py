"""The per-slot context arithmetic and the thinking-budget state machine (pure Python)."""

from __future__ import annotations

import pytest

from mlxcel_compat.engine.reasoning_budget import COUNTING, DONE, FORCING, IDLE, WAITING_UTF8, ReasoningBudget, ReasoningBudgetSpec, opens_block
from mlxcel_compat.engine.slots import slot_context


@pytest.mark.parametrize(
    ("ctx", "n_parallel", "unified", "train", "expected"),
    [
        (512, 2, False, 32768, (512, 256)),  # -c 512 -np 2: 256 per slot
        (512, 2, True, 32768, (512, 512)),  # --kv-unified: every slot may use all of it
        (512, 3, False, 32768, (768, 256)),  # 170 per slot, padded to 256; the total follows
        (128, 1, False, 32768, (256, 256)),  # -c is padded to a multiple of 256
        (0, 4, True, 4096, (4096, 4096)),  # -c 0: the model's training context
        (8192, 1, False, 4096, (8192, 4096)),  # a slot never exceeds the training context
    ],
)
def test_slot_context(ctx, n_parallel, unified, train, expected) -> None:
    assert slot_context(ctx, n_parallel, unified, train) == expected


START, END, FORCED = (1, 2), (3,), (9, 3)


def budget(n: int, open_at_start: bool = False, complete=None) -> ReasoningBudget:
    return ReasoningBudget(ReasoningBudgetSpec(budget=n, start=START, end=END, forced=FORCED, open_at_start=open_at_start), complete)


def test_counts_after_the_start_tag_then_forces_the_end() -> None:
    b = budget(2)
    for token in (5, 1, 2):
        assert b.forced_token() is None
        b.accept(token)
    assert b.state == COUNTING
    b.accept(7)
    b.accept(8)
    assert b.state == FORCING and b.forced_token() == 9
    b.accept(9)
    assert b.forced_token() == 3
    b.accept(3)
    assert b.state == DONE and b.forced_token() is None


def test_the_model_closing_the_block_ends_the_count() -> None:
    b = budget(5, open_at_start=True)
    b.accept(7)
    b.accept(3)
    assert b.state == DONE
    b.accept(1)
    b.accept(2)  # a new block gets a fresh budget
    assert b.state == COUNTING and b.remaining == 5


def test_zero_budget_forces_at_once_and_utf8_waits() -> None:
    assert budget(0, open_at_start=True).forced_token() == 9
    b = budget(1, open_at_start=True, complete=lambda token: token != 50)
    b.accept(50)  # the budget is spent mid-character
    assert b.state == WAITING_UTF8 and b.forced_token() is None
    b.accept(51)
    assert b.state == FORCING and b.forced_token() == 9
    assert budget(3).state == IDLE


def test_opens_block() -> None:
    assert opens_block([4, 1, 2], START, END)
    assert opens_block([4, 1, 2, 6, 6], START, END)
    assert not opens_block([1, 2, 6, 3], START, END)
    assert not opens_block([4, 5], START, END)


def test_force_ends_an_open_block_on_request_and_a_token_in_flight_does_not_count() -> None:
    b = budget(2**31 - 1)
    assert not b.force()  # no block open: nothing to end (llama.cpp's force answers the same)
    b.accept(1)
    b.accept(2)
    b.accept(7)
    assert b.force() and b.state == FORCING and b.forced_token() == 9
    b.accept(8)  # sampled before the force took effect (a pipelined step): still forcing 9
    assert b.forced_token() == 9
    b.accept(9)
    b.accept(3)
    assert b.state == DONE and not b.force()


def test_end_reasoning_forces_only_the_armed_sequences_of_the_task() -> None:
    from types import SimpleNamespace

    from mlxcel_compat.engine.reasoning_budget import end_reasoning

    def slot(task_id: int, control: bool) -> SimpleNamespace:
        spec = ReasoningBudgetSpec(budget=100, start=START, end=END, forced=FORCED, open_at_start=True, control=control)
        return SimpleNamespace(sequence=SimpleNamespace(request=SimpleNamespace(task_id=task_id), budget=ReasoningBudget(spec)))

    slots = [slot(1, True), slot(2, True), slot(3, False), SimpleNamespace(sequence=None)]
    assert end_reasoning(slots, [1, 3]) == 1
    assert [s.sequence.budget.state for s in slots[:3]] == [FORCING, COUNTING, COUNTING]
