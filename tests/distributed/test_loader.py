"""DistributedLoader on real gloo groups: the regular global batches, from each rank's cache."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from .._system import starts_processes  # noqa: E402
from . import _ranks  # noqa: E402
from ._ranks import counting_s3, run_ranks  # noqa: E402

pytestmark = starts_processes


def regular(count: int, world: int, batch: int, epoch: int, **options: Any) -> list[list[int]]:
    """Each step's samples (all ranks together, sorted), as DistributedSampler + DataLoader."""
    steps: list[list[int]] = []
    for rank in range(world):
        sampler = DistributedSampler(
            range(count),
            num_replicas=world,
            rank=rank,
            shuffle=options.get("shuffle", True),
            seed=options.get("seed", 0),
            drop_last=options.get("drop_last", False),
        )
        sampler.set_epoch(epoch)
        loader = DataLoader(
            range(count),
            batch_size=batch,
            sampler=sampler,
            drop_last=options.get("drop_last", False),
        )
        for k, b in enumerate(loader):
            if k == len(steps):
                steps.append([])
            steps[k] += b.tolist()
    return [sorted(s) for s in steps]


def global_steps(results: list[Any], epoch: int) -> list[list[int]]:
    """Each step's samples over all ranks, sorted; checks every rank had as many steps."""
    counts = {len(r["batches"][epoch]) for r in results}
    assert len(counts) == 1, f"ranks ran different numbers of steps: {counts}"
    steps = counts.pop()
    return [sorted(x for r in results for x in r["batches"][epoch][k]) for k in range(steps)]


def three_epochs_from_s3(
    count: int, world: int, batch: int, **options: Any
) -> tuple[list[Any], int]:
    """Each rank's results of 3 epochs (seed 7) from the counting S3 server, and its GETs."""
    with counting_s3(count) as (endpoint, served):
        served["GET"] = 0
        results = run_ranks(
            world,
            _ranks.epochs_from_s3,
            endpoint=endpoint,
            count=count,
            epochs=3,
            batch_size=batch,
            seed=7,
            **options,
        )
        return results, served["GET"]


def test_three_epochs_from_s3_are_the_regular_batches_and_read_storage_once() -> None:
    count, world, batch = 45, 3, 4
    results, gets = three_epochs_from_s3(count, world, batch)
    for epoch in range(3):
        assert global_steps(results, epoch) == regular(count, world, batch, epoch, seed=7)
        for r in results:
            assert all(
                len(b) == batch or k == len(r["batches"][epoch]) - 1
                for k, b in enumerate(r["batches"][epoch])
            )
    # Epoch 0 reads every sample once (padding repeats some of the order, not the reads);
    # the later epochs read nothing: every sample is in its holder's cache.
    assert [sum(r["reads"][e] for r in results) for e in range(3)] == [count, 0, 0]
    assert gets == count
    # Samples do travel between ranks (the plan balances each step) but not all of them.
    sent = sum(r["sent"][1] for r in results)
    trained = sum(len(b) for r in results for b in r["batches"][1])
    assert 0 < sent < trained


def test_replicas_lower_the_exchanged_share_and_still_read_storage_once() -> None:
    # Every sample cached on two ranks: either may train on it, so few samples travel
    # after the first epoch, in which the reading holder also sends each sample's copy.
    count, world, batch = 96, 4, 4
    found = {}
    for replicas in (1.0, 2.0):
        results, gets = three_epochs_from_s3(count, world, batch, replicas=replicas)
        for epoch in range(3):
            assert global_steps(results, epoch) == regular(count, world, batch, epoch, seed=7)
        assert [sum(r["reads"][e] for r in results) for e in range(3)] == [count, 0, 0]
        assert gets == count
        found[replicas] = results
    # Each sample's second holder got its copy in epoch 0 (none has two copies elsewhere).
    assert sum(r["copies"] for r in found[2.0]) == count
    assert sum(r["copies"] for r in found[1.0]) == 0

    def beta(results: list[Any]) -> float:
        return sum(r["betas"][e] for r in results for e in (1, 2)) / (2 * len(results))

    assert beta(found[2.0]) < beta(found[1.0]) / 4, (beta(found[2.0]), beta(found[1.0]))
    assert sum(r["sent"][e] for r in found[2.0] for e in (1, 2)) < sum(
        r["sent"][e] for r in found[1.0] for e in (1, 2)
    )


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("count", "world", "batch"), [(23, 4, 3), (10, 3, 4), (7, 2, 5)])
def test_sizes_not_divisible_give_equal_steps_and_the_regular_batches(
    count: int, world: int, batch: int, drop_last: bool
) -> None:
    results = run_ranks(
        world,
        _ranks.epochs_in_memory,
        count=count,
        epochs=2,
        batch_size=batch,
        drop_last=drop_last,
        seed=3,
    )
    assert len({r["steps"] for r in results}) == 1
    # Each sample is read once, by its holder, even where padding repeats it in a step, or
    # drop_last leaves it out of the first epoch; the second epoch comes from the caches.
    # (With drop_last, an epoch of 0 steps reads nothing.)
    assert sum(r["reads"] for r in results) == (count if results[0]["steps"] else 0)
    for epoch in range(2):
        assert global_steps(results, epoch) == regular(
            count, world, batch, epoch, drop_last=drop_last, seed=3
        )


@pytest.mark.parametrize(("shuffle", "replicas"), [(True, 1.0), (True, 2.0), (False, 1.0)])
def test_drop_last_reads_storage_in_the_first_epoch_only(shuffle: bool, replicas: float) -> None:
    # 45 samples, 3 ranks of 4: each epoch trains on 36 and leaves 9 out. Shuffled, the 9 are
    # others each epoch, so the first epoch reads them too (into their holders' caches, and
    # their second holders' with replicas); in order, the same 9 are never trained on.
    count, world, batch = 45, 3, 4
    results = run_ranks(
        world,
        _ranks.epochs_in_memory,
        count=count,
        epochs=3,
        batch_size=batch,
        drop_last=True,
        shuffle=shuffle,
        replicas=replicas,
        seed=7,
    )
    for epoch in range(3):
        assert global_steps(results, epoch) == regular(
            count, world, batch, epoch, drop_last=True, shuffle=shuffle, seed=7
        )
    reads = [sum(r["epoch_reads"][e] for r in results) for e in range(3)]
    assert reads == ([count, 0, 0] if shuffle else [36, 0, 0])
    assert sum(r["copies"] for r in results) == (count if replicas == 2.0 else 0)


def test_break_then_resume_with_the_same_world_continues_exactly(tmp_path: Path) -> None:
    count, world, batch = 40, 2, 4
    options = {"count": count, "batch_size": batch, "seed": 5}
    whole = run_ranks(world, _ranks.epochs_in_memory, epochs=2, **options)
    first = run_ranks(
        world, _ranks.break_and_save, epoch=1, stop_after=2, state_dir=str(tmp_path), **options
    )
    resumed = run_ranks(
        world, _ranks.resume_and_finish, state_file=str(tmp_path / "rank0.json"), **options
    )
    for r in range(world):
        assert first[r]["batches"] + resumed[r]["batches"] == whole[r]["batches"][1]
    state = json.loads((tmp_path / "rank0.json").read_text())
    assert (state["epoch"], state["step"]) == (1, 2)


def test_a_break_at_the_same_step_on_every_rank_then_the_next_epoch() -> None:
    # Leaving the loop, each rank completes the exchanges its peers may have begun (up to
    # prefetch steps), so nobody waits for a peer, and the next epoch starts clean.
    results = run_ranks(3, _ranks.break_then_next_epoch, count=90, batch_size=2, prefetch=3)
    assert global_steps(results, 1) == regular(90, 3, 2, 1)
    assert all(r["break_seconds"] < 10 for r in results)
    assert all(r["threads"] == [] for r in results)


@pytest.mark.parametrize(("before", "after"), [(4, 3), (2, 4)])
def test_an_elastic_restart_loses_and_repeats_nothing(
    tmp_path: Path, before: int, after: int
) -> None:
    count, batch = 48, 2
    options = {"count": count, "batch_size": batch, "seed": 9}
    first = run_ranks(
        before, _ranks.break_and_save, epoch=0, stop_after=3, state_dir=str(tmp_path), **options
    )
    resumed = run_ranks(
        after, _ranks.resume_and_finish, state_file=str(tmp_path / "rank0.json"), **options
    )
    trained = [x for r in first for b in r["batches"] for x in b]
    trained += [x for r in resumed for b in r["batches"] for x in b]
    assert collections.Counter(trained) == collections.Counter(range(count))
    steps = {len(r["batches"]) for r in resumed}
    assert len(steps) == 1


def test_a_rank_that_dies_makes_the_others_raise_not_hang() -> None:
    results = run_ranks(
        3,
        _ranks.stop_mid_epoch,
        may_die=True,
        # 20 steps an epoch: the others cannot have exchanged every step of the epoch
        # (each runs at most `prefetch` ahead) before the victim dies at step 2.
        count=240,
        batch_size=4,
        timeout=90.0,
        victim=1,
        how="exit",
    )
    assert results[1] is None  # it exited
    for r in (0, 2):
        assert results[r]["error"] in {"ExchangeTimeout"}, results[r]
        assert results[r]["seconds"] < 30


def test_ctrl_c_on_one_rank_stops_it_at_once_and_the_others_raise() -> None:
    results = run_ranks(
        2, _ranks.stop_mid_epoch, count=200, batch_size=4, timeout=90.0, victim=0, how="interrupt"
    )
    stopped, other = results
    assert stopped["error"] == "KeyboardInterrupt"
    assert stopped["seconds"] < 3  # not the 5 s sleep, not the exchange timeout
    assert (stopped["state"]["epoch"], stopped["state"]["step"]) == (1, 3)
    assert stopped["threads"] == []
    # The other rank's next exchange fails once rank 0 has gone: an error, not a hang.
    assert other["error"] == "ExchangeTimeout", other
    assert other["seconds"] < 30


def test_caches_on_disk_survive_a_restart_and_spare_storage(tmp_path: Path) -> None:
    # A job restarted with the same world finds each rank's disk cache: no storage read.
    options = {"count": 30, "batch_size": 3, "seed": 2, "cache_dir": str(tmp_path)}
    first = run_ranks(2, _ranks.epochs_with_disk_cache, epochs=1, **options)
    second = run_ranks(2, _ranks.epochs_with_disk_cache, epochs=1, **options)
    assert sum(r["reads"] for r in first) == 30
    assert sum(r["reads"] for r in second) == 0
    assert global_steps(first, 0) == global_steps(second, 0) == regular(30, 2, 3, 0, seed=2)
    assert all(r["threads"] == [] for r in first + second)


def test_a_cache_for_part_of_the_share_reads_the_rest_each_epoch() -> None:
    results = run_ranks(
        2, _ranks.epochs_in_memory, count=200, epochs=3, batch_size=5, cached_share=0.5, seed=4
    )
    for epoch in range(3):
        assert global_steps(results, epoch) == regular(200, 2, 5, epoch, seed=4)
    reads = sum(r["reads"] for r in results)
    # Epoch 0 reads everything once; each later epoch the half nobody keeps (a hash decides
    # which half, so about 100 samples).
    assert 200 + 2 * 70 < reads < 200 + 2 * 130


def test_a_failed_read_raises_its_own_exception_or_is_left_out_within_the_budget() -> None:
    strict = run_ranks(
        2, _ranks.failing_reads, parent_store=True, count=24, batch_size=3, max_failures=0
    )
    # The rank that read sample 7 raises its KeyError (after the step's exchange, so that
    # its peer is not left waiting); the peer then finds it gone, and says why it went.
    errors = sorted(r["error"] for r in strict)
    assert errors in (["KeyError", "KeyError"], ["ExchangeTimeout", "KeyError"]), strict
    assert any("sample 7" in r["notes"] for r in strict if r["error"] == "KeyError")
    for r in strict:
        if r["error"] == "ExchangeTimeout":
            assert "failed first: rank 0 raised KeyError: 'no sample 7'" in r["message"] or (
                "failed first: rank 1 raised KeyError: 'no sample 7'" in r["message"]
            ), r
    lenient = run_ranks(2, _ranks.failing_reads, count=24, batch_size=3, max_failures=1)
    assert all(r["error"] is None for r in lenient)
    trained = sorted(x for r in lenient for b in r["batches"] for x in b)
    assert trained == [i for i in range(24) if i != 7]


def test_ranks_built_with_different_settings_are_refused() -> None:
    results = run_ranks(2, _ranks.mismatched_settings, count=20, batch_size=2)
    for r in results:
        assert r["error"] == "ConfigurationError"
        assert "seed 0 here, 1 there" in r["message"] or "seed 1 here, 0 there" in r["message"]


def test_measure_exchange_gives_every_rank_the_same_terms_and_bigger_samples_a_lower_rate() -> None:
    import math

    small, large = 1_000, 1_000_000
    results = run_ranks(3, _ranks.exchange_costs, sizes=[small, large])
    assert results[0] == results[1] == results[2]  # the slowest rank's, everywhere
    (l_small, r_small, size_small, world), (l_large, r_large, size_large, _) = results[0]
    assert (size_small, size_large, world) == (small, large, 3)
    assert 0 < l_small < 1  # a round trip of headers, beyond 3 kB
    assert 0 <= l_large < 1
    assert 0 < r_large < math.inf
    assert 0 < r_small < math.inf
    # 1,000 times the bytes (copied and CRC-checked at both ends): far fewer samples a second
    # (30 to 60 times fewer measured on a loaded 2-core machine).
    assert r_large < r_small / 2


def test_measure_exchange_on_a_group_of_some_ranks_measures_among_them() -> None:
    results = run_ranks(3, _ranks.exchange_costs, sizes=[10_000], members=[1, 2])
    assert results[0] is None
    assert results[1] == results[2]
    (latency, rate, size, world) = results[1][0]
    assert (size, world) == (10_000, 2)
    assert latency >= 0
    assert rate > 0


def test_measure_exchange_needs_a_group_of_two_ranks_or_more() -> None:
    from feedline.distributed import measure_exchange
    from feedline.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="init_process_group"):
        measure_exchange(1000)


def test_a_step_that_keeps_the_loop_waiting_is_reported_on_each_rank() -> None:
    # Rank 1's reads each take 3 s: its loop waits on the read, rank 0's on the exchange.
    results = run_ranks(2, _ranks.stall_reported, count=8)
    assert [len(r["batches"]) for r in results] == [2, 2]
    for rank, r in enumerate(results):
        loops = [
            t for t in r["reports"] if t.startswith(f"feedline DistributedLoader (rank {rank}) ")
        ]
        assert loops, f"rank {rank}'s loop reported no stall: {r['reports']}"
        assert "steps taken by the loop:" in loops[0]
        assert all("feedline-worker" not in t for t in r["reports"])  # idle pools left out
    assert any("'feedline-exchange'" in t for t in results[0]["reports"])  # on its peer
    assert any("__getitem__(i=" in t for t in results[1]["reports"])  # the slow read


def test_the_ranks_and_their_workers_share_one_listing(tmp_path: Any) -> None:
    # 2 ranks x 4 workers: one listing for the job, rank 0's, sent over the gloo group and
    # kept in each rank's cache directory, where its workers read it.
    from tests.source._s3 import moto_bucket

    bucket = "feedline-listing-ranks"  # (moto's buckets outlive a server in this process)
    with moto_bucket(bucket, {f"data/{i}": b"x" for i in range(30)}) as (endpoint, served):
        results = run_ranks(
            2,
            _ranks.keys_for_the_job,
            endpoint=endpoint,
            directory=str(tmp_path),
            workers=4,
            bucket=bucket,
        )
        lists = served["LIST"]
    expected = sorted(f"data/{i}" for i in range(30) if str(i).endswith("7"))
    assert [r["keys"] for r in results] == [expected, expected]
    assert all(r["workers_same"] for r in results)
    assert [(r["listed"], r["reused"]) for r in results] == [(1, 0), (0, 1)]
    assert lists == 2  # the job's listing, and rank 0's of a bucket that does not exist
    missing = [r["missing"] for r in results]
    assert missing[0] is not None
    assert missing[1] == missing[0]  # the same error on the rank that waited for the keys
