"""The distributed planner, without processes: the reference split, placement, Algorithm 1."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from feedline.distributed import GlobalSequence, balance, holders, plan_step, simulate_beta

# A shuffled GlobalSequence draws DistributedSampler's order, with PyTorch's generator.
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="a shuffled order needs PyTorch"
)


@pytest.mark.parametrize(
    ("size", "world", "local", "drop_last", "shuffle"),
    [
        (103, 4, 8, False, True),
        (103, 4, 8, True, True),
        (64, 3, 5, False, False),
        (10, 4, 3, False, True),
    ],
)
def test_the_regular_split_is_distributed_samplers(
    size: int, world: int, local: int, drop_last: bool, shuffle: bool
) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, DistributedSampler

    sequence = GlobalSequence(size, world, local, seed=7, shuffle=shuffle, drop_last=drop_last)
    data = list(range(size))
    for epoch in (0, 3):
        loaders = []
        for rank in range(world):
            sampler = DistributedSampler(
                data, world, rank, shuffle=shuffle, seed=7, drop_last=drop_last
            )
            sampler.set_epoch(epoch)
            loaders.append(list(DataLoader(data, local, sampler=sampler, drop_last=drop_last)))
        assert {len(batches) for batches in loaders} == {sequence.steps}  # no rank waits
        grid = sequence.grid(epoch)
        for step in range(sequence.steps):
            mine = sequence.step(epoch, step, grid)
            for rank in range(world):
                assert mine[:, rank].tolist() == loaders[rank][step].tolist()
    assert isinstance(torch.__version__, str)


def test_an_impossible_split_says_why() -> None:
    with pytest.raises(ValueError, match="drop_last=True leaves nothing"):
        GlobalSequence(3, 4, 2, drop_last=True)
    with pytest.raises(ValueError, match="world must be a positive int"):
        GlobalSequence(3, 0, 2)


def test_holders_are_spread_and_move_little_when_the_world_changes() -> None:
    size = 200_000
    four = holders(size, 4, seed=1)[0]
    counts = np.bincount(four, minlength=4)
    assert counts.min() > 0.95 * size / 4
    # Growing to 5 ranks moves about a fifth; shrinking to 3 moves only rank 3's samples.
    five = holders(size, 5, seed=1)[0]
    assert 0.18 < np.mean(four != five) < 0.22
    assert set(five[four != five].tolist()) == {4}
    three = holders(size, 3, seed=1)[0]
    assert np.array_equal(three[four != 3], four[four != 3])
    # Another seed, another placement; the same seed, the same placement on every rank.
    assert np.mean(holders(size, 4, seed=2)[0] != four) > 0.7
    assert np.array_equal(holders(size, 4, seed=1)[0], four)


def test_replicas_go_to_other_ranks() -> None:
    placed = holders(50_000, 8, seed=3, replicas=3)
    assert placed.shape == (3, 50_000)
    for sample in range(0, 50_000, 997):
        assert len(set(placed[:, sample].tolist())) == 3
    assert np.bincount(placed[2], minlength=8).min() > 5_500
    with pytest.raises(ValueError, match="replicas"):
        holders(10, 2, seed=0, replicas=3)


def test_algorithm_1_on_the_papers_example_and_at_random() -> None:
    # Red holds 2 of a 12-sample batch, Green 6, Blue 4: Green sends Red 2.
    assert balance(np.array([2, 6, 4]), np.array([4, 4, 4])) == [(1, 0, 2)]
    rng = np.random.default_rng(0)
    for _ in range(200):
        world = int(rng.integers(2, 40))
        held = np.bincount(rng.integers(0, world, world * 16), minlength=world)
        wanted = np.full(world, 16)
        plan = balance(held, wanted)
        after = held.copy()
        for src, dst, count in plan:
            assert count > 0
            assert held[src] > wanted[src]  # only ranks with a surplus send
            after[src] -= count
            after[dst] += count
        assert np.array_equal(after, wanted)
        unsettled = int(np.count_nonzero(held != wanted))
        assert len(plan) <= max(unsettled - 1, 0)  # each message settles a rank
        assert plan == balance(held, wanted)  # every rank computes the same plan
    with pytest.raises(ValueError, match="hold 3 samples but want 4"):
        balance(np.array([1, 2]), np.array([2, 2]))


@needs_torch
def test_a_step_plan_gives_every_rank_its_batch_from_the_regular_global_batch() -> None:
    sequence = GlobalSequence(1000, 8, 16, seed=5)
    placed = holders(1000, 8, seed=5)[0]
    placed[::17] = -1  # some samples held by nobody: read from storage
    for step in range(sequence.steps):
        regular = sequence.step(1, step)
        plan = plan_step(regular, placed)
        batches = [plan.batch(rank) for rank in range(8)]
        assert [len(b) for b in batches] == [regular.shape[0]] * 8  # exactly its local size
        assert Counter(np.concatenate(batches).tolist()) == Counter(regular.ravel().tolist())
        for rank in range(8):
            assert all(placed[s] == rank for s in plan.keep[rank])  # kept: held by the rank
            assert all(placed[s] == -1 for s in plan.read[rank])  # read: held by nobody
        for src, _dst, samples in plan.sends:
            assert all(placed[s] == src for s in samples)  # sent by its holder
        deficits = np.maximum(
            regular.shape[0]
            - np.bincount(placed[regular.ravel()][placed[regular.ravel()] >= 0], minlength=8)
            - np.array([len(r) for r in plan.read]),
            0,
        ).sum()
        assert plan.exchanged == deficits  # Algorithm 1 moves exactly the deficits
        assert plan.beta == plan.exchanged / regular.size


@pytest.mark.parametrize("world", [16, 64, 256, 1024])
def test_simulated_beta_matches_the_papers_medians(world: int) -> None:
    steps = 300 if world <= 64 else 40
    for local, paper in ((32, 0.069), (64, 0.048), (128, 0.034)):
        median = float(np.median(simulate_beta(world, local, steps=steps, batches_per_epoch=40)))
        assert abs(median - paper) <= 0.003, (world, local, median)


@pytest.mark.parametrize("world", [16, 64, 256])
def test_half_the_dataset_replicated_leaves_almost_nothing_to_exchange(world: int) -> None:
    alone = float(np.median(simulate_beta(world, 32, steps=20, batches_per_epoch=40)))
    spared = float(np.median(simulate_beta(world, 32, steps=20, batches_per_epoch=40, spare=0.5)))
    assert alone > 0.06
    assert spared <= 0.001


def test_spreading_replicas_keeps_each_sample_with_a_holder_and_is_optimal() -> None:
    from feedline.distributed._replicas import spread

    # Rank 0 holds 4 samples, rank 1 none, rank 2 two; two of rank 0's are also on rank 1,
    # one of rank 2's on rank 1: each ends with 2.
    first = np.array([0, 0, 0, 0, 2, 2])
    second = np.array([1, 1, -1, -1, 1, -1])
    trainer = spread(first, second, 3, 2)
    assert np.bincount(trainer, minlength=3).tolist() == [2, 2, 2]
    assert all(t in (f, s) for t, f, s in zip(trainer, first, second, strict=True))
    # A chain: rank 0 is over, rank 2 is short, and only through rank 1 can it give.
    first = np.array([0, 0, 0, 1, 1, 2])
    second = np.array([1, -1, -1, 2, -1, -1])
    trainer = spread(first, second, 3, 2)
    assert np.bincount(trainer, minlength=3).tolist() == [2, 2, 2]
    assert trainer.tolist() == [1, 0, 0, 2, 1, 2]


def test_spreading_replicas_matches_an_exhaustive_search() -> None:
    import itertools

    from feedline.distributed._replicas import spread

    rng = np.random.default_rng(5)
    for _ in range(150):
        world, local = int(rng.integers(2, 6)), int(rng.integers(1, 5))
        first = rng.integers(0, world, world * local)
        second = rng.integers(0, world, first.size)
        second[(second == first) | (rng.random(first.size) < 0.5)] = -1
        movable = np.flatnonzero(second >= 0)[:10]
        second[np.flatnonzero(second >= 0)[10:]] = -1

        def trained(owner: np.ndarray, world: int = world, local: int = local) -> int:
            return int(np.minimum(np.bincount(owner, minlength=world), local).sum())

        best = 0
        for choice in itertools.product((False, True), repeat=movable.size):
            owner = first.copy()
            owner[movable[list(choice)]] = second[movable[list(choice)]]
            best = max(best, trained(owner))
        trainer = spread(first, second, world, local)
        assert trained(trainer) == best
        assert np.all((trainer == first) | (trainer == second))


def test_the_cost_model_is_the_papers_equations() -> None:
    from feedline.distributed import CostModel, expected_beta

    m = CostModel(D=1000.0, V=10.0, R=100.0, U=50.0, R_c=1000.0, alpha=0.8, b=32)
    assert m.training_time(4) == 1000 / (4 * 10)  # (1)
    assert m.storage_time() == 10.0  # (2)
    assert m.preprocessing_time(4) == 5.0  # (3)
    assert m.loading_time(4) == 15.0  # (4)
    assert m.crossover() == 10.0  # (5)
    assert m.epoch_time(4) == 25.0  # (6): training dominates below the crossover
    assert m.epoch_time(100) == m.loading_time(100)  # and loading above it
    assert m.io_time(4, "distributed cache") == pytest.approx(0.2 * 10 + 0.8 * 1.0 * 3 / 4)  # (7)
    assert m.io_time(4, "locality-aware", beta=0.05) == pytest.approx(2 + 0.8 * 1.0 * 0.05)  # (8)
    assert m.io_time(4, "locality-aware") == pytest.approx(2 + 0.8 * expected_beta(4, 32))
    with pytest.raises(ValueError, match="alpha"):
        CostModel(D=1.0, V=1.0, R=1.0, U=1.0, R_c=1.0, alpha=1.5)


def test_the_per_step_terms_beyond_the_paper_add_to_the_locality_aware_io_only() -> None:
    import math

    from feedline.distributed import CostModel

    paper = CostModel(D=1000.0, V=10.0, R=100.0, U=50.0, R_c=1000.0, alpha=0.8, b=10)
    model = CostModel(
        D=1000.0, V=10.0, R=100.0, U=50.0, R_c=1000.0, alpha=0.8, b=10, L_b=0.01, L_plan=0.002
    )
    assert paper.balancing_latency(4, beta=0.05) == 0.0  # the paper's model by default
    steps = 25  # 1000 samples, 4 ranks of 10
    rounds = -math.expm1(-0.05 * 0.8 * 4 * 10)  # the steps that move at least one sample
    latency = steps * (0.002 + rounds * 0.01)
    assert model.balancing_latency(4, beta=0.05) == pytest.approx(latency)
    assert model.io_time(4, "locality-aware", beta=0.05) == pytest.approx(
        paper.io_time(4, "locality-aware", beta=0.05) + latency
    )
    assert model.balancing_latency(4, beta=0.0) == pytest.approx(steps * 0.002)  # no rounds
    for method in ("regular", "distributed cache"):
        assert model.io_time(4, method) == paper.io_time(4, method)
    with pytest.raises(ValueError, match="L_b"):
        CostModel(D=1.0, V=1.0, R=1.0, U=1.0, R_c=1.0, L_b=-1.0)


def test_expected_beta_agrees_with_the_planner() -> None:
    from feedline.distributed import expected_beta

    assert expected_beta(1, 32) == 0.0
    for world, local in ((8, 32), (64, 64), (256, 128)):
        simulated = float(np.mean(simulate_beta(world, local, steps=200, batches_per_epoch=40)))
        assert abs(simulated - expected_beta(world, local)) < 0.003


def test_the_cost_plot_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from feedline.distributed import CostModel

    model = CostModel(D=1e6, V=1e3, R=2e4, U=3e3, R_c=2e5)
    path = model.plot([1, 4, 16, 64, 256], tmp_path / "cost.png")
    assert path is not None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_torch
def test_one_ranks_plan_is_its_part_of_the_whole_plan() -> None:
    from feedline.distributed import plan_for

    sequence = GlobalSequence(5000, 16, 32, seed=2)
    placed = holders(5000, 16, seed=2)[0]
    placed[::13] = -1
    regular = sequence.step(0, 3)
    whole = plan_step(regular, placed)
    for rank in range(16):
        mine = plan_for(regular, placed, rank)
        assert mine.keep.tolist() == whole.keep[rank].tolist()
        assert mine.read.tolist() == whole.read[rank].tolist()
        assert [(d, s.tolist()) for d, s in mine.sends] == [
            (d, s.tolist()) for src, d, s in whole.sends if src == rank
        ]
        assert mine.receives == [(src, len(s)) for src, d, s in whole.sends if d == rank]


@needs_torch
@pytest.mark.parametrize(("size", "replicated"), [(5000, False), (5000, True), (10, False)])
def test_positions_place_each_ranks_batch_and_every_place_once(size: int, replicated: bool) -> None:
    # The places of every rank's batch (kept, read, received by source rank) cover the
    # step's places once each, also where the step pads (10 samples, 16 places) and where
    # replicas move samples to their other holders.
    from feedline.distributed import plan_for
    from feedline.distributed._placement import second_copies

    world, local = 4, 4
    sequence = GlobalSequence(size, world, local, seed=2)
    placed = holders(size, world, seed=2, replicas=2 if replicated else 1)
    placed[0, ::7] = -1  # some read from storage
    second = second_copies(placed, 2, 1.0) if replicated else None
    regular = sequence.step(0, 0)
    flat = regular.ravel()
    whole = plan_step(regular, placed[0], second)
    seen: list[int] = []
    for rank in range(world):
        plan = plan_for(regular, placed[0], rank, second, positions=True)
        received = [s for src, d, s in sorted(whole.sends, key=lambda t: t[0]) if d == rank]
        batch = np.concatenate([plan.keep, plan.read, *received])
        assert flat[plan.positions].tolist() == batch.tolist()
        seen += plan.positions.tolist()
    assert sorted(seen) == list(range(flat.size))
    assert plan_for(regular, placed[0], 0, second).positions.size == 0  # only when asked


def test_both_heap_encodings_of_algorithm_1_agree() -> None:
    from feedline.distributed._balance import _balance_tuples

    rng = np.random.default_rng(1)
    for _ in range(200):
        world = int(rng.integers(2, 300))
        held = np.bincount(rng.integers(0, world, world * 8), minlength=world)
        wanted = np.full(world, 8)
        assert balance(held, wanted) == _balance_tuples(held - wanted)


@needs_torch
@pytest.mark.parametrize("missing", [False, True])
def test_replicas_change_who_trains_and_the_copies_fill_every_second_holder(
    missing: bool,
) -> None:
    from feedline.distributed import plan_for
    from feedline.distributed._placement import second_copies

    size, world, local = 3000, 8, 16
    sequence = GlobalSequence(size, world, local, seed=4)
    placed = holders(size, world, seed=4, replicas=2)
    if missing:
        placed[0, ::11] = -1  # outside the cached share: read from storage, never copied
    second = second_copies(placed, 4, 0.5)
    assert np.all(second[placed[0] < 0] == -1)
    assert 0.4 < np.mean(second >= 0) < 0.6
    regular = sequence.step(1, 2)
    one, two = plan_step(regular, placed[0]), plan_step(regular, placed[0], second)
    for plan in (one, two):  # the regular global batch, each rank its local batch size
        assert Counter(np.concatenate([plan.batch(r) for r in range(world)]).tolist()) == Counter(
            regular.ravel().tolist()
        )
        assert {len(plan.batch(r)) for r in range(world)} == {local}
    assert two.exchanged < one.exchanged
    plans = [plan_for(regular, placed[0], r, second, copies=True) for r in range(world)]
    copied: Counter[int] = Counter()
    for src, plan in enumerate(plans):
        whole = two.keep[src].tolist() + [x for s, _, x in two.sends if s == src for x in x]
        assert plan.keep.tolist() == two.keep[src].tolist()
        for dst, samples in plan.copies:
            # A copy goes from the holder that takes a sample to its other holder.
            assert set(samples.tolist()) <= set(whole)
            assert all(dst in (placed[0, i], second[i]) and dst != src for i in samples)
            assert (src, len(samples)) in plans[dst].copies_in
            copied.update(samples.tolist())
        assert sum(n for _, n in plan.copies_in) == sum(
            len(s) for p in plans for d, s in p.copies if d == src
        )
    replicated = [i for i in regular.ravel().tolist() if second[i] >= 0]
    assert copied == Counter(replicated)
    assert plan_for(regular, placed[0], 0, second).copies == []  # only when asked


@pytest.mark.parametrize(("drop_last", "skip"), [(True, 0), (True, 37), (False, 0)])
def test_what_drop_last_leaves_out_is_the_rest_of_the_epochs_order(
    drop_last: bool, skip: int
) -> None:
    pytest.importorskip("torch")
    size, world, local = 103, 4, 8
    sequence = GlobalSequence(size, world, local, seed=7, drop_last=drop_last, skip=skip)
    for epoch in (0, 3):
        trained = sequence.grid(epoch)[: sequence.steps * local].ravel().tolist()
        left = sequence.left_out(epoch).tolist()
        if drop_last:  # together, every sample not skipped, once
            assert not set(trained) & set(left)
            assert len(set(trained + left)) == len(trained) + len(left) == size - skip
        else:
            assert left == []


@needs_torch
def test_fills_are_read_by_their_holders_and_copied_to_their_second_holders() -> None:
    from feedline.distributed import plan_for
    from feedline.distributed._placement import second_copies
    from feedline.distributed._plan import with_fills

    size, world, local = 600, 4, 8
    placed = holders(size, world, seed=2, replicas=2)
    placed[0, ::13] = -1  # kept by nobody: not read to fill a cache
    second = second_copies(placed, 2, 0.5)
    regular = GlobalSequence(size, world, local, seed=2).step(0, 1)
    extra = np.setdiff1d(np.arange(size), regular.ravel())[::5]
    for spare in (None, second):
        plans = [
            with_fills(
                plan_for(regular, placed[0], r, spare, copies=spare is not None),
                extra,
                placed[0],
                r,
                spare,
            )
            for r in range(world)
        ]
        filled = Counter(x for p in plans for x in p.fills.tolist())
        assert filled == Counter(i for i in extra.tolist() if placed[0, i] >= 0)
        for src, plan in enumerate(plans):
            assert all(placed[0, i] == src for i in plan.fills)
            sent = Counter({dst: len(s) for dst, s in plan.copies})
            for dst, count in sent.items():
                assert (src, count) in plans[dst].copies_in  # both sides count alike
        copied = [x for p in plans for _, s in p.copies for x in s.tolist() if x in set(extra)]
        expected = [] if spare is None else [i for i in extra.tolist() if second[i] >= 0]
        assert sorted(copied) == sorted(expected)
