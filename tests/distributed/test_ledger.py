"""The DistributedLoader's epoch ledger: each sample of the global batches handed out once,
by one rank, on real gloo ranks; and the defects it must catch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from .._system import starts_processes
from . import _ranks
from ._ranks import run_ranks

pytestmark = [starts_processes]


def _counts(result: dict[str, Any], epoch: int) -> tuple[Any, ...]:
    ledger = result["ledger"][epoch]
    return tuple(ledger[k] for k in ("planned", "delivered", "failed", "repeated", "missing"))


@pytest.mark.parametrize(
    "options",
    [
        # 44 over 3 ranks: the order pads one sample; 15 each, the last step of 3.
        {"count": 44, "drop_last": False, "share": 15},
        # 46: 45 for 3 ranks, 3 steps of 4 each (the rest is read into the caches only).
        {"count": 46, "drop_last": True, "replicas": 2.0, "share": 12},
    ],
    ids=["padded", "drop_last_replicas"],
)
def test_whole_epochs_pass_and_the_stats_count_each_ranks_share(options: dict[str, Any]) -> None:
    share = options.pop("share")
    results = run_ranks(3, _ranks.ledger_epochs, epochs=2, batch_size=4, seed=3, **options)
    for r in results:
        for epoch in range(2):
            assert _counts(r, epoch) == (share, share, 0, 0, 0)
            assert r["samples"][epoch] == share
        assert r["checked"] == [1, 2]


def test_a_sample_that_fails_within_the_budget_is_counted_failed_not_missing() -> None:
    results = run_ranks(
        3, _ranks.ledger_epochs, count=45, epochs=2, broken=7, max_failures=1, batch_size=4
    )
    for epoch in range(2):  # each epoch, one rank's batch comes without sample 7
        assert sorted(_counts(r, epoch)[1:3] for r in results) == [(14, 1), (15, 0), (15, 0)]
        assert {_counts(r, epoch)[4] for r in results} == {0}
    assert all(r["checked"] == [1, 2] for r in results)


def test_the_ledger_catches_an_iteration_after_a_break_that_resumes_mid_epoch() -> None:
    # The defect put back: after a break, the old _iteration_start resumed the epoch where
    # the loop left it, not from its start as DistributedSampler's DataLoader does. An
    # iteration that resumes no loaded state is a new pass over the epoch: the ledger
    # refuses to start it at step 2, on every rank, before anything is trained on.
    results = run_ranks(3, _ranks.break_then_iterate_with_the_old_restart, count=60, batch_size=4)
    for r in results:
        assert r["error"] == "LedgerError", r
        lost = "2 step(s) passed over by a new iteration but never handed out (first: step 0)"
        assert lost in r["message"]


def test_a_tampered_saved_position_is_refused_and_the_saved_one_resumes(tmp_path: Path) -> None:
    options = {"count": 60, "batch_size": 4, "seed": 2}
    run_ranks(3, _ranks.break_and_save, epoch=1, stop_after=2, state_dir=str(tmp_path), **options)
    states = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [s["ledger"]["rank"] for s in states] == [0, 1, 2]  # each rank's own ledger
    assert {json.dumps({k: v for k, v in s.items() if k != "ledger"}) for s in states} == {
        json.dumps({k: v for k, v in states[0].items() if k != "ledger"})
    }
    results = run_ranks(3, _ranks.tampered_positions, state_dir=str(tmp_path), **options)
    for r in results:
        assert (
            "1 step(s) passed over by the saved position but never handed out (first: step 2)"
            in (r["a step ahead"]["message"])
        )
        assert (
            "resumes at step 1 but 1 step(s) it does not pass over were handed out already"
            in (r["a step back"]["message"])
        )
        assert (
            "says 25 samples of the epoch's order were consumed, its ledger's 2 steps hand "
            in (r["consumed"]["message"])
        )
        assert "the saved position is in epoch 2" in r["epoch"]["message"]
        assert r["rest"] == r["rest of rank 0's"] == 3  # steps 2 to 4 of 5
        # Its own state: the whole epoch checked across the ranks. Rank 0's state on every
        # rank: the other ranks do not know their places before it, so the end checks the
        # rest only (and does not count as a whole epoch checked).
        assert (r["checked"], r["checked after rank 0's"]) == (1, 1)


def test_the_ranks_together_catch_a_sample_two_ranks_both_trained_on() -> None:
    results = run_ranks(3, _ranks.two_ranks_train_on_one_sample, count=60, batch_size=4)
    for r in results:
        assert r["error"] == "LedgerError", r
        message = r["message"]
        assert "DistributedLoader epoch 0, across 3 rank(s): 1 place(s) handed out by more " in (
            message
        )
        assert "by 2 of 3)" in message
        assert "found their own part wrong" not in message  # no rank alone could see it
        assert r["repeated"] == 1
    assert len({r["message"] for r in results}) == 1  # the same error on every rank


def test_a_rank_that_dies_before_the_epochs_check_makes_the_others_raise_not_hang() -> None:
    results = run_ranks(
        3, _ranks.die_before_the_epochs_end, may_die=True, count=60, batch_size=4, victim=2
    )
    assert results[2] is None
    for r in results[:2]:
        assert r["error"] == "ExchangeTimeout", r
        assert "the epoch's ledger check failed (end of epoch 0)" in r["message"]
        assert "A rank has gone" in r["message"]  # gloo does not say which: no rank blamed
        assert r["seconds"] < 20  # not the 30 minutes of the timeout


def test_a_ledger_switched_off_on_one_rank_only_is_refused() -> None:
    results = run_ranks(2, _ranks.ledger_switched_off_on_one_rank, count=8)
    for r in results:
        assert r["error"] == "ConfigurationError", r
        assert "ledger (FEEDLINE_LEDGER)" in r["message"]
