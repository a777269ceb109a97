"""The epoch ledger on its own: repeats, losses, resumes, and its saved form."""

from __future__ import annotations

import dataclasses
import json

import pytest

from feedline import LedgerError
from feedline._ledger import Ledger


def test_an_epoch_delivered_once_passes_and_counts() -> None:
    ledger = Ledger("epoch 0")
    ledger.deliver_range(0, 100)
    ledger.deliver(100)
    ledger.fail(101)
    ledger.plan(102)
    ledger.check_end()
    stats = ledger.stats()
    assert (stats.planned, stats.delivered, stats.failed, stats.repeated, stats.missing) == (
        102,
        101,
        1,
        0,
        0,
    )


@pytest.mark.parametrize(("start", "stop"), [(0, 5), (3, 61), (8, 64), (13, 200)])
def test_a_range_delivered_twice_names_its_first_slot(start: int, stop: int) -> None:
    ledger = Ledger("epoch 1", unit="batch", describe=lambda s: f"indices of {s}")
    ledger.deliver_range(0, 300)
    ledger.deliver_range(start, stop)
    ledger.plan(300)
    assert ledger.stats().repeated == stop - start
    with pytest.raises(
        LedgerError,
        match=rf"{stop - start} batch\(s\) handed out twice "
        rf"\(first: batch {start} \(indices of {start}\)\)",
    ) as info:
        ledger.check_end()
    assert info.value.repeated == stop - start


def test_a_slot_never_handed_out_is_named_with_the_count() -> None:
    ledger = Ledger("epoch 2")
    ledger.deliver_range(0, 40)
    ledger.deliver_range(44, 90)
    ledger.fail(40)
    ledger.plan(90)
    with pytest.raises(LedgerError, match=r"3 sample\(s\) never handed out .*first: sample 41"):
        ledger.check_end()


def test_a_failed_slot_delivered_later_is_a_retry_not_a_repeat() -> None:
    ledger = Ledger("epoch 3")
    ledger.fail(2)
    ledger.deliver_range(0, 5)
    ledger.plan(5)
    ledger.check_end()
    assert ledger.stats().failed == 0


def test_resume_positions_are_checked_against_what_was_done() -> None:
    ledger = Ledger("epoch 4", unit="batch")
    ledger.deliver_range(0, 10)
    ledger.deliver(12)
    ledger.check_resume(10, [12])  # the right position
    with pytest.raises(LedgerError, match=r"2 batch\(s\) passed over .*first: batch 10"):
        ledger.check_resume(12, [12])  # passes over 10 and 11, never handed out
    with pytest.raises(LedgerError, match=r"resumes at batch 8 .*3 batch\(s\).*first: batch 8"):
        ledger.check_resume(8, [])  # 8, 9 and 12 would come twice


def test_the_saved_form_is_plain_data_and_small() -> None:
    ledger = Ledger("epoch 5")
    ledger.deliver_range(0, 2_000_000)
    ledger.deliver(2_000_000)
    ledger.fail(2_000_005)
    state = json.loads(json.dumps(ledger.state_dict()))
    assert len(json.dumps(state)) < 200  # a run of set bits is kept as its length
    again = Ledger("epoch 5")
    again.load_state_dict(state)
    assert again.stats() == ledger.stats()
    assert again.delivered(1_999_999)
    assert not again.delivered(2_000_001)
    assert again.done(2_000_005)
    with pytest.raises(ValueError, match="damaged ledger"):
        again.load_state_dict({"delivered": "not base64!"})


@pytest.mark.parametrize(
    "slots",
    [[], [0], list(range(13)), list(range(64)), [*range(20), 21], [3, 5], [*range(16), 15]],
)
def test_the_saved_form_keeps_the_bits_in_order_or_not(slots: list[int]) -> None:
    # In order (the first ``count`` slots) the bits are packed without a scan; any other
    # pattern by one; both read back the same.
    ledger = Ledger("epoch 6")
    for slot in slots:
        ledger.deliver(slot)
    again = Ledger("epoch 6")
    again.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert [s for s in range(80) if again.delivered(s)] == sorted(set(slots))
    assert again.stats() == ledger.stats()


def test_many_slots_at_once_count_and_repeat_as_one_at_a_time() -> None:
    one, many = Ledger("epoch 6"), Ledger("epoch 6")
    slots = [3, 70, 4, 3, 1000, 70]
    for slot in slots:
        one.deliver(slot)
    many.deliver_many(slots)
    many.fail(5)
    assert (many.stats().delivered, many.stats().repeated) == (4, 2)
    assert many.stats() == dataclasses.replace(one.stats(), failed=1)
    bits = int.from_bytes(many.done_bits(), "little")
    assert [k for k in range(1001) if bits >> k & 1] == [3, 4, 5, 70, 1000]
    assert many.end_findings() == ["2 sample(s) handed out twice (first: sample 3)"]


def test_messages_name_the_position_and_the_suspects_asked_for() -> None:
    ledger = Ledger("loader epoch 7", unit="step", suspects="a bug in the planner")
    ledger.deliver_range(0, 2)
    with pytest.raises(
        LedgerError,
        match=r"1 step\(s\) passed over by a new iteration but never handed out .*: a bug in "
        r"the planner; please report it",
    ):
        ledger.check_resume(3, position="a new iteration")
