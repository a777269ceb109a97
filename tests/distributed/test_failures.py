"""When a rank fails, the others raise at once, and name the rank that failed first."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from .._system import starts_processes
from . import _ranks
from ._ranks import run_ranks

pytestmark = starts_processes


def test_a_rank_that_stopped_after_another_failed_is_not_blamed(tmp_path: Path) -> None:
    # Rank 2 dies; rank 0 finds it gone and leaves; rank 1 then finds rank 0 gone. Rank 0 is
    # the peer rank 1 sees fail, but rank 2 failed first: rank 1 must say so.
    results = run_ranks(
        3,
        _ranks.failure_after_a_failure,
        may_die=True,
        parent_store=True,  # as under torchrun: the store outlives the ranks that leave
        # Epoch 1's first step: rank 0 sends to rank 2 first, rank 1 trades with rank 0 only.
        count=36,
        batch_size=3,
        seed=4,
        timeout=60.0,
        marks=str(tmp_path),
    )
    assert results[2] is None  # it died
    first, then = results[0], results[1]
    assert first["error"] == then["error"] == "ExchangeTimeout", results
    assert "to rank 2 failed (epoch 1, step 0)" in first["message"]
    assert "Rank 2 failed first: rank 2's connection closed" in first["message"]
    assert " rank 0 failed (epoch 1, step 0)" in then["message"]  # what broke: rank 0's
    assert "Rank 0 stopped after rank 2 failed first" in then["message"], then
    assert "probably died" not in then["message"]


def test_a_rank_that_never_makes_its_loader_is_waited_for_within_the_timeout() -> None:
    # The loader's group is made with the loader's timeout (torch's default is 30 minutes).
    results = run_ranks(
        3,
        _ranks.die_before_making_the_loader,
        may_die=True,
        count=12,
        victim=2,
        loader_timeout=3.0,
    )
    assert results[2] is None
    for found in results[:2]:
        assert found["error"] == "ExchangeTimeout", found
        assert "not every rank of 3 made its DistributedLoader" in found["message"]
        assert found["seconds"] < 20


def test_a_loader_dropped_without_close_leaves_no_descriptor_or_thread() -> None:
    results = run_ranks(2, _ranks.loaders_dropped_without_close, count=8)
    for found in results:
        counts = found["counts"]
        # Flat after the first loader's (a descriptor may close late: it may fall by one);
        # a group kept per loader added 7 descriptors and 3 threads each.
        assert counts[-1][0] <= counts[1][0], counts
        assert counts[-1][1] <= counts[1][1], counts


def test_a_rank_that_left_its_loop_later_says_what_it_waits_for() -> None:
    # Leaving the loop, a rank exchanges the steps its peers may have begun; a peer that
    # left earlier never does: the wait (until the timeout) is reported, with its reason.
    results = run_ranks(3, _ranks.uneven_breaks, count=60, stops=[2, 3, 2])
    said = "\n".join(results[1]["said"])
    assert "leaving the loop: exchanging up to step" in said, results
    assert "every rank must leave its loop after the same step" in said
