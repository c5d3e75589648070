"""The step ledger alone (`flowmesh.steps.StepLedger`): the one rule of step order and replay
that the broker and the worker both keep, with exact expectations."""

from __future__ import annotations

import pytest

from flowmesh.steps import StepLedger


def test_seqs_are_taken_in_increasing_order_with_gaps_and_never_again() -> None:
    ledger: StepLedger[str] = StepLedger(keep=4)
    assert [ledger.taken(s) for s in (0, 1)] == [True, False]  # seqs start at 1
    ledger.take(1)
    ledger.take(5)  # a gap: 2..4 were never sent, nothing waits for them
    assert ledger.last == 5
    assert [ledger.taken(s) for s in (1, 3, 5, 6)] == [True, True, True, False]
    for seq in (5, 3):
        with pytest.raises(ValueError, match=f"step seq {seq} was already taken \\(last 5\\)"):
            ledger.take(seq)
    assert ledger.last == 5


def test_a_step_runs_until_settled_and_its_answer_is_replayed_while_kept() -> None:
    ledger: StepLedger[str] = StepLedger(keep=2)
    for seq in (1, 2, 3):
        ledger.take(seq)
        ledger.start(seq)
    assert ledger.running == {1, 2, 3} and ledger.answer(1) is None
    ledger.settle(2, "two")  # out of order: answers are kept as steps finish
    ledger.settle(1, "one")
    assert ledger.running == {3}
    assert (ledger.answer(1), ledger.answer(2), ledger.answer(3)) == ("one", "two", None)
    ledger.settle(3, "three")  # over `keep`: the oldest answer kept goes
    assert list(ledger.answers.items()) == [(1, "one"), (3, "three")]
    assert ledger.answer(2) is None and ledger.running == set()
    ledger.settle(1, "one, again")  # recorded again: keeps its place
    assert list(ledger.answers.items()) == [(1, "one, again"), (3, "three")]


def test_a_ledger_taken_up_after_a_restart_starts_where_it_was() -> None:
    ledger: StepLedger[str] = StepLedger(keep=8, last=7)
    assert ledger.taken(7) and not ledger.taken(8)
    with pytest.raises(ValueError, match="at least one answer"):
        StepLedger(keep=0)
