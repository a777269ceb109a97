"""The epoch's batches reach the workers as they need them, and nothing outlives its epoch."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch.utils.data import Dataset, Sampler  # noqa: E402

from feedline import DataLoader  # noqa: E402
from feedline._ledger import ledger_check  # noqa: E402
from feedline.loader._deal import Dealer  # noqa: E402

from .._system import own_segments, starts_processes, zombies  # noqa: E402
from ._datasets import SlowFirstWorker  # noqa: E402
from ._procs import alone, no_children_left  # noqa: E402

pytestmark = starts_processes


class CountingSampler(Sampler[int]):
    """``range(n)``, counting how many indices were drawn (in the process that iterates it)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.drawn = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.drawn += 1
            yield i


def _persistent(**kw: Any) -> DataLoader[Any]:
    """3,000 ints in batches of 2, over 2 persistent workers."""
    return DataLoader(list(range(3000)), batch_size=2, num_workers=2, persistent_workers=True, **kw)


def _tasks(n: int) -> Iterator[tuple[int, list[int]]]:
    return ((b, [b]) for b in range(n))


def test_the_dealer_deals_round_robin_and_only_as_far_as_needed() -> None:
    drawn = itertools.count()
    tasks = ((next(drawn), [b]) for b in range(1000))
    dealer = Dealer(tasks, workers=3, ahead=2)
    hands = dealer.first_hands()
    assert [[n for n, _ in h] for h in hands] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert not dealer.exhausted
    sent: list[tuple[int, list[int], bool]] = []

    def send(worker: int, hand: list[tuple[int, list[int]]], last: bool) -> None:
        sent.append((worker, [n for n, _ in hand], last))

    dealer.top_up(send)
    assert sent == []  # every worker holds 3 batches, as many as it should
    for i in range(3):
        dealer.handed_out(dealer.owner(i))
    dealer.top_up(send)  # each now holds 2: a round of 6 more each
    assert [w for w, _, _ in sent] == [0, 1, 2]
    assert sent[0][1] == list(range(9, 27, 3))
    assert dealer.dealt == 27
    # Drive it to the end: every batch dealt once, to worker i % 3, the last round saying so.
    owners = {}
    for w, numbers, _ in sent:
        owners.update(dict.fromkeys(numbers, w))
    i = 3
    while i < dealer.dealt or not dealer.exhausted:
        dealer.handed_out(dealer.owner(i))
        i += 1
        before = len(sent)
        dealer.top_up(send)
        for w, numbers, _ in sent[before:]:
            owners.update(dict.fromkeys(numbers, w))
    assert dealer.dealt == 1000
    assert i == 1000
    assert all(owners[n] == n % 3 for n in range(9, 1000))
    assert sorted(owners) == list(range(9, 1000))
    assert [last for _, _, last in sent[-3:]] == [True, True, True]
    assert max(len(numbers) for _, numbers, _ in sent) <= 256


def test_a_resumed_epoch_deals_each_batch_to_the_worker_it_had() -> None:
    # Resumed at batch 7 of 3 workers: batch n to worker n % 3, whose dataset's state the
    # resumed worker restores.
    dealer = Dealer(((b, [b]) for b in range(7, 20)), workers=3, ahead=1, first=7)
    hands = dealer.first_hands()
    assert [[n for n, _ in h] for h in hands] == [[9, 12], [7, 10], [8, 11]]
    assert [dealer.owner(i) for i in range(3)] == [1, 2, 0]


def test_out_of_order_the_dealer_gives_the_next_batch_to_a_worker_with_room() -> None:
    dealer = Dealer(_tasks(20), workers=2, ahead=2, in_order=False)
    # As PyTorch's: at most prefetch_factor (ahead) batches dealt to a worker at a time.
    assert [[n for n, _ in h] for h in dealer.first_hands()] == [[0, 2], [1, 3]]
    sent: list[tuple[int, list[int], bool]] = []

    def send(worker: int, hand: list[tuple[int, list[int]]], last: bool) -> None:
        sent.append((worker, [n for n, _ in hand], last))

    # Worker 0 is slow: worker 1 hands out its batches, and only it gets more, one by one.
    for _ in range(17):  # the last finds the sampler drawn out
        dealer.handed_out(1)
        dealer.top_up(send)
    assert sent[:16] == [(1, [n], False) for n in range(4, 20)]
    assert dealer.holds(0) == 2
    assert sent[16:] == [(0, [], True), (1, [], True)]  # the end: both shares are complete
    assert dealer.exhausted


def test_an_empty_epoch_is_dealt_as_finished() -> None:
    dealer = Dealer(_tasks(0), workers=2, ahead=2)
    assert dealer.first_hands() == [[], []]
    assert dealer.exhausted


@pytest.mark.parametrize("in_order", [True, False])
def test_workers_get_the_epoch_as_they_need_it_not_all_at_once(in_order: bool) -> None:
    n = 4_000  # 16 times what the workers may have drawn after the first batch
    sampler = CountingSampler(n)
    loader = DataLoader(
        list(range(n)), batch_size=4, sampler=sampler, num_workers=2, in_order=in_order
    )
    it = iter(loader)
    first = next(it)
    if in_order:  # (else the batch of whichever worker is first)
        assert first.tolist() == [0, 1, 2, 3]
    # PyTorch draws 2 batches per worker ahead; feedline a few rounds: far from the epoch.
    assert sampler.drawn <= 4 * 64, sampler.drawn
    rest = [b.tolist() for b in it]
    got = sorted([first.tolist(), *rest])
    assert got == [list(range(i, i + 4)) for i in range(0, n, 4)]
    if in_order:
        assert [first.tolist(), *rest] == got
    assert sampler.drawn == n
    no_children_left()


@pytest.mark.parametrize(("in_order", "concurrency"), [(True, None), (False, None), (True, 1)])
def test_an_epoch_left_early_leaves_nothing_for_the_next(
    in_order: bool, concurrency: int | None
) -> None:
    # Persistent workers keep their queues: hands dealt to an epoch left early (several
    # rounds of them by then) must not reach the next epoch, which must be whole. At a
    # concurrency of one, the workers fetch without a pipeline.
    loader = _persistent(fetch_concurrency=concurrency, in_order=in_order)
    whole = [[i, i + 1] for i in range(0, 3000, 2)]
    for stop in (150, None, 40, 1, None):
        batches = []
        for i, batch in enumerate(loader):
            batches.append(batch.tolist())
            if stop is not None and i + 1 == stop:
                break
        if stop is None:
            assert sorted(batches) == whole
            if in_order:
                assert batches == whole
        else:
            assert len(batches) == stop
            assert all(b in whole for b in batches)
    loader.close()
    no_children_left()


def test_every_epoch_and_the_next_loader_fork_their_workers() -> None:
    # The queues of an epoch's workers run feeder threads that leave just after it; the
    # next epoch must not take them for the training's own threads and use the fork server
    # (about 1.5 s the first time, against milliseconds for a fork).
    alone()
    parents = []
    for loader in (DataLoader(list(range(8)), batch_size=2, num_workers=2) for _ in range(2)):
        for _ in range(3):
            for batch in loader:
                workers = loader._workers
                assert workers is not None
                parents.append({type(w._child.process._popen).__module__ for w in workers._workers})
                assert batch.numel() == 2
    assert len(parents) == 2 * 3 * 4
    assert all(p == {"multiprocessing.popen_fork"} for p in parents), parents
    no_children_left()


@pytest.mark.parametrize("concurrency", [1, None])
def test_persistent_workers_left_mid_epoch_are_kept(concurrency: int | None) -> None:
    # A worker waiting for its next hand when the loop breaks is told its share is complete,
    # so it acknowledges the stop and serves the next epoch (it was ended and started anew).
    segments = own_segments()
    loader = _persistent(fetch_concurrency=concurrency)
    assert len(list(loader)) == 1500
    workers = loader._workers
    assert workers is not None
    pids = [w.pid for w in workers._workers]
    for i, _ in enumerate(loader):
        if i == 100:
            break
    for batch in loader:
        assert batch.tolist() == [0, 1]
        break
    assert [w.pid for w in workers._workers] == pids
    loader.close()
    no_children_left()
    assert own_segments() - segments == set()


def _split(loader: Any) -> dict[int, int]:
    """Batches fetched by each worker (SlowFirstWorker's items say which)."""
    counts: dict[int, int] = {}
    for _, workers in loader:
        counts[int(workers[0])] = counts.get(int(workers[0]), 0) + 1
    return counts


def test_out_of_order_a_free_worker_fetches_what_a_slow_one_would_hold() -> None:
    # Worker 0 takes 50 ms an item. PyTorch's in_order=False gives the next batch to a
    # worker with room: the fast one fetches most of the epoch, the slow one its first few.
    kw: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "in_order": False}
    theirs = _split(TorchLoader(SlowFirstWorker(80, 0.05), **kw))
    ours = _split(DataLoader(SlowFirstWorker(80, 0.05), **kw))
    for counts in (theirs, ours):
        assert sum(counts.values()) == 40
        assert counts.get(1, 0) > 3 * counts.get(0, 0), (theirs, ours)
    no_children_left()
    assert zombies() == []


class _SlowFirstItem(Dataset[tuple[int, int]]):
    # Item 0 takes a while; each item says which worker fetched it.
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[int, int]:
        if i == 0:
            time.sleep(0.5)
        info = torch.utils.data.get_worker_info()
        return (info.id if info is not None else -1), i


def test_out_of_order_a_stuck_worker_holds_what_pytorch_s_would() -> None:
    # Batch 0 keeps worker 0 busy: PyTorch deals it prefetch_factor batches (0 and 2) and the
    # other worker fetches the rest, none of which waits for batch 0.
    kw: dict[str, Any] = {"num_workers": 2, "prefetch_factor": 2, "in_order": False}

    def on_the_stuck_worker(cls: Any) -> list[int]:
        return sorted(int(i) for w, i in cls(_SlowFirstItem(), **kw) if int(w) == 0)

    segments = own_segments()
    theirs, ours = on_the_stuck_worker(TorchLoader), on_the_stuck_worker(DataLoader)
    assert theirs == [0, 2]
    assert ours == theirs
    no_children_left()
    assert zombies() == []
    assert own_segments() <= segments


def test_an_epoch_resumed_out_of_order_hands_out_every_batch_once() -> None:
    # The fast worker's batches overtake the slow one's: the state holds the batches handed
    # out above the watermark, and the resumed epoch hands out the others, each once (the
    # epoch's ledger checks the saved position, and the resumed epoch at its end).
    assert ledger_check()
    kw: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "in_order": False}
    loader = DataLoader(SlowFirstWorker(60, 0.05), **kw)
    head = []
    for batch in loader:
        head.append(batch[0].tolist())
        if len(head) == 8:
            break
    state = loader.state_dict()
    assert state["yielded_ahead"], state  # some batches came before batch 0
    resumed = DataLoader(SlowFirstWorker(60, 0.05), **kw)
    resumed.load_state_dict(state)
    rest = [batch[0].tolist() for batch in resumed]
    assert sorted(head + rest) == [[i, i + 1] for i in range(0, 60, 2)]
    assert resumed.stats().ledger.repeated == 0  # type: ignore[union-attr]
    no_children_left()
    assert zombies() == []
