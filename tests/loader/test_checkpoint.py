"""A checkpoint describes the last batch handed out, however the loop ended.

torchdata's ``StatefulDataLoader`` is the reference: after ``break``, after an exception in the
loop body, or after the last batch, ``state_dict()`` resumes at the next batch.
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

from torch.utils.data import DataLoader as TorchLoader  # noqa: E402

from feedline import DataLoader  # noqa: E402

from .._interrupts import ctrl_c_after, where_the_ctrl_c_lands  # noqa: E402
from .._system import own_segments, starts_processes, zombies  # noqa: E402
from ._datasets import (  # noqa: E402
    Counting,
    OwnIterator,
    ResumableStream,
    SharesStream,
    StatefulSampler,
)
from ._procs import no_children_left  # noqa: E402
from ._reference import side_by_side  # noqa: E402

StatefulDataLoader = stateful_dataloader.StatefulDataLoader
pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"), starts_processes]


def _values(batches: list[Any]) -> list[list[int]]:
    return [b.tolist() for b in batches]


def _run(cls: Any, stop_at: int, how: str, **kw: Any) -> tuple[list[Any], list[Any], Any]:
    """Batches before a checkpoint taken after leaving the loop ``how``, and after resuming."""
    torch.manual_seed(5)
    loader = cls(list(range(30)), batch_size=4, shuffle=True, **kw)
    seen = []
    if how == "break":
        for step, batch in enumerate(loader):
            seen.append(batch)
            if step == stop_at:
                break
    elif how == "exception":
        with pytest.raises(ZeroDivisionError):
            for step, batch in enumerate(loader):
                seen.append(batch)
                if step == stop_at:
                    raise ZeroDivisionError
    else:  # "exhausted"
        seen = list(loader)
    state = loader.state_dict()
    torch.manual_seed(99)  # a resumed process has another global state
    resumed = cls(list(range(30)), batch_size=4, shuffle=True, **kw)
    resumed.load_state_dict(state)
    return seen, list(resumed), state


@pytest.mark.parametrize("how", ["break", "exception", "exhausted"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_after_leaving_the_loop_resumes_at_the_next_batch(
    how: str, workers: int
) -> None:
    kw: dict[str, Any] = {"num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = "forkserver"
    for cls in (StatefulDataLoader, DataLoader):
        torch.manual_seed(5)
        reference = (TorchLoader if cls is DataLoader else cls)(
            list(range(30)), batch_size=4, shuffle=True, **kw
        )
        expected = _values(list(reference) + list(reference))  # this epoch and the next
        seen, rest, _ = _run(cls, 3, how, **kw)
        assert _values(seen) == expected[: len(seen)]
        assert len(seen) == (8 if how == "exhausted" else 4)
        # The resumed loader goes on with the next batch: the rest of this epoch, or the
        # whole next one after an exhausted epoch.
        assert len(rest) == (8 if how == "exhausted" else 4)
        assert _values(rest) == expected[len(seen) : len(seen) + len(rest)]


def test_the_state_is_plain_data_that_json_can_write() -> None:
    gen = torch.Generator().manual_seed(1)
    loader = DataLoader(list(range(20)), batch_size=3, shuffle=True, generator=gen)
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    text = json.dumps(loader.state_dict())
    del it
    resumed = DataLoader(list(range(20)), batch_size=3, shuffle=True, generator=torch.Generator())
    resumed.load_state_dict(json.loads(text))
    again = DataLoader(list(range(20)), batch_size=3, shuffle=True, generator=gen.manual_seed(1))
    assert _values(first + list(resumed)) == _values(list(again))


def test_a_new_epoch_after_break_starts_afresh_as_in_pytorch() -> None:
    gen = torch.Generator().manual_seed(2)
    loader = DataLoader(list(range(12)), batch_size=4, generator=gen)
    for _ in loader:
        break
    assert loader.state_dict()["batches_yielded"] == 1
    assert len(list(loader)) == 3  # iter() without load_state_dict: a whole new epoch
    assert loader.state_dict()["batches_yielded"] == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_datasets_own_state_is_saved_and_restored(workers: int) -> None:
    kw: dict[str, Any] = {"batch_size": 2, "num_workers": workers}
    outcomes = []
    for make in side_by_side():
        loader = make(Counting(12), **kw)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        whole_rest = [b[1].tolist() for b in it]
        resumed = make(Counting(12), **kw)
        resumed.load_state_dict(state)
        rest = list(resumed)
        outcomes.append((whole_rest, [b[0].tolist() for b in rest], [b[1].tolist() for b in rest]))
        if isinstance(loader, DataLoader):
            assert state["dataset_state"] is not None
            served = sum(s["served"] for s in state["dataset_state"] if s is not None)
            assert served == 6  # each worker's copy counted its own items
    assert outcomes[1] == outcomes[0]
    uninterrupted, indices, counts = outcomes[1]
    assert [i for b in indices for i in b] == list(range(6, 12))
    # Each dataset went on counting from its saved state, not from zero: in one process
    # 7..12; with workers, batch b goes to worker b % 2, as in the epoch it resumes (worker
    # 0 had served 4 items, worker 1 two).
    assert counts == uninterrupted
    assert counts == ([[7, 8], [9, 10], [11, 12]] if workers == 0 else [[3, 4], [5, 6], [5, 6]])


def test_a_stateful_iterable_dataset_resumes_itself_instead_of_replaying() -> None:
    stream = ResumableStream(10)
    loader = DataLoader(stream, batch_size=3)
    for step, _ in enumerate(loader):
        if step == 1:
            break
    state = loader.state_dict()
    assert state["dataset_state"] == [{"position": 6}]
    fresh = ResumableStream(10)
    resumed = DataLoader(fresh, batch_size=3)
    resumed.load_state_dict(state)
    assert _values(list(resumed)) == [[6, 7, 8], [9]]
    assert fresh.opened == 4  # nothing before the checkpoint was read again


@pytest.mark.parametrize("dataset", [SharesStream, OwnIterator], ids=["generator", "own iterator"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_kept_while_the_epoch_goes_on_resumes_where_it_was_taken(
    workers: int, dataset: Any
) -> None:
    # torchdata's own resume case: the state is saved aside (for a checkpoint written later)
    # and the loop goes on to the end of the epoch before a new process resumes from it. A
    # dataset that is its own iterator starts over in __iter__: torchdata loads its state
    # after iter() (before it, the state was lost and the epoch replayed its first batches).
    outcomes = []
    for make in side_by_side("auto"):
        kw: dict[str, Any] = {"batch_size": 3, "num_workers": workers, "collate_fn": list}
        loader = make(dataset([5, 7]), **kw)
        it = iter(loader)
        head = [next(it), next(it)]
        state = loader.state_dict()
        rest = list(it)
        resumed = make(dataset([5, 7]), **kw)
        resumed.load_state_dict(state)
        outcomes.append((head, rest, list(resumed)))
    assert outcomes[1] == outcomes[0]
    head, rest, after_resume = outcomes[1]
    assert after_resume == rest
    assert sorted(i for b in head + rest for i in b) == list(range(12))


def test_a_stateful_sampler_resumes_itself() -> None:
    sampler = StatefulSampler(10, seed=3)
    loader = DataLoader(list(range(10)), batch_size=4, sampler=sampler)
    whole = _values(list(DataLoader(list(range(10)), batch_size=4, sampler=StatefulSampler(10, 3))))
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    del it
    assert state["sampler_state"] == {"epoch": 0, "yielded": 4}
    other = StatefulSampler(10, seed=3)
    resumed = DataLoader(list(range(10)), batch_size=4, sampler=other)
    resumed.load_state_dict(state)
    assert _values([first, *resumed]) == whole
    assert other.state_dict() == {"epoch": 1, "yielded": 0}


def test_assigning_a_fixed_argument_after_construction_raises_like_pytorch() -> None:
    for cls in (TorchLoader, DataLoader):
        loader = cls(list(range(8)), batch_size=2)
        with pytest.raises(ValueError, match="batch_size attribute should not be set"):
            loader.batch_size = 4
    loader = DataLoader(list(range(8)), batch_size=2)
    loader.collate_fn = lambda items: sum(items)
    assert list(loader) == [1, 5, 9, 13]  # a setting PyTorch lets change between epochs


def test_resuming_leaves_the_saved_state_as_it_was() -> None:
    # A sampler or dataset may keep the dict its load_state_dict() is given; the resumed
    # epoch must not change the caller's checkpoint through it.
    loader = DataLoader(ResumableStream(20), batch_size=3)
    for step, _ in enumerate(loader):
        if step == 1:
            break
    state = loader.state_dict()
    saved = json.dumps(state)

    class Keeping(ResumableStream):
        def load_state_dict(self, state: dict[str, int]) -> None:
            self.kept = state
            super().load_state_dict(state)

    resumed = DataLoader(Keeping(20), batch_size=3)
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert resumed.state_dict()["dataset_state"] == [{"position": 6}]  # nothing handed out
    assert _values([next(it)]) == [[6, 7, 8]]
    del it
    assert json.dumps(state) == saved


class _Breaks(torch.utils.data.IterableDataset[int]):
    """A stream of 0..11 whose record ``broken`` (if any) raises; no state of its own."""

    def __init__(self, broken: int | None) -> None:
        self.broken = broken

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, 12, workers):
            if i == self.broken:
                raise OSError(f"record {i} is corrupt")
            yield i


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_after_the_stream_raised_resumes_after_the_last_batch(
    workers: int,
) -> None:
    # A job that saves its checkpoint in its except handler, fixes the record and restarts
    # gets the rest of the epoch: nothing handed out twice, nothing lost (torchdata's
    # fast-forward). Resumed over the same broken record, it raises again.
    def run(cls: Any) -> tuple[list[int], list[int]]:
        loader = cls(_Breaks(9), batch_size=2, num_workers=workers)
        seen: list[int] = []
        with pytest.raises(OSError, match="record 9 is corrupt"):
            for batch in loader:
                seen += batch.tolist()
        state = json.loads(json.dumps(loader.state_dict()))
        fixed = cls(_Breaks(None), batch_size=2, num_workers=workers)
        fixed.load_state_dict(state)
        rest = [i for batch in fixed for i in batch.tolist()]
        again = cls(_Breaks(9), batch_size=2, num_workers=workers)
        again.load_state_dict(state)
        with pytest.raises(OSError, match="record 9 is corrupt"):
            list(again)
        return seen, rest

    segments = own_segments()
    ours = run(DataLoader)
    no_children_left()
    assert zombies() == []
    assert own_segments() == segments
    assert ours == run(StatefulDataLoader)
    gc.collect()  # the reference's workers live until its iterators, in cycles, are collected
    seen, rest = ours
    assert sorted(seen + rest) == list(range(12))


class _SamplerBreaks(torch.utils.data.Sampler[int]):
    """0..39 in order, but drawing ``broken`` (if any) raises."""

    def __init__(self, broken: int | None) -> None:
        self.broken = broken

    def __len__(self) -> int:
        return 40

    def __iter__(self) -> Any:
        for i in range(40):
            if i == self.broken:
                raise IndexError(f"the sampler failed at {i}")
            yield i


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_that_raises_hands_out_the_batches_drawn_before_it(workers: int) -> None:
    # In the place of the batch it could not draw, as PyTorch's loop without workers raises
    # it (PyTorch's workers drop the batches drawn ahead: listed among the differences); a
    # checkpoint saved then resumes at that batch (torchdata's loses index 20, drawn into
    # the batch that failed).
    def seen_before_the_error(loader: Any) -> list[int]:
        seen: list[int] = []
        with pytest.raises(IndexError, match="the sampler failed at 21"):
            for batch in loader:
                seen += batch.tolist()
        return seen

    kw: dict[str, Any] = {"batch_size": 4, "num_workers": workers}
    loader = DataLoader(list(range(40)), sampler=_SamplerBreaks(21), **kw)
    seen = seen_before_the_error(loader)
    assert seen == list(range(20))
    if not workers:
        assert (
            seen_before_the_error(TorchLoader(list(range(40)), sampler=_SamplerBreaks(21), **kw))
            == seen
        )
    state = json.loads(json.dumps(loader.state_dict()))
    assert (state["batches_yielded"], state["finished"]) == (5, False)
    resumed = DataLoader(list(range(40)), sampler=_SamplerBreaks(None), **kw)
    resumed.load_state_dict(state)
    assert [i for batch in resumed for i in batch.tolist()] == list(range(20, 40))
    no_children_left()  # the epoch that raised ended its workers (one was left before)
    assert zombies() == []


class _Calls(torch.utils.data.Dataset[int]):
    """Item ``i`` is ``i``, after 5 ms; every call is recorded."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, []  # type: ignore[var-annotated]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.calls.append(i)
        time.sleep(0.005)
        return i


def test_an_iteration_after_load_state_dict_stops_the_one_before_it() -> None:
    # The earlier iterator, still referenced, fetches no more beside the resumed epoch (its
    # calls would share the dataset and the generators with it), and says why at its next.
    dataset = _Calls(80)
    loader = DataLoader(dataset, batch_size=4, fetch_concurrency=4, prefetch_factor=4)
    old = iter(loader)
    assert [next(old).tolist() for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    loader.load_state_dict(loader.state_dict())  # the old epoch is still fetching ahead
    resumed = iter(loader)
    before = len(dataset.calls)
    assert [b.tolist() for b in resumed] == [list(range(k, k + 4)) for k in range(8, 80, 4)]
    assert len(dataset.calls) - before == 72  # the resumed epoch's calls, and no other
    with pytest.raises(RuntimeError, match="load_state_dict"):
        next(old)


def test_a_ctrl_c_while_a_batch_is_counted_comes_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Ctrl-C that lands between the ledger's record of a batch and the position's cut
    # the two apart (a checkpoint load_state_dict() refused with LedgerError); one that lands
    # after both would lose the batch. It comes a moment after the batch is handed out.
    import signal

    from feedline.loader import _ledgers

    handler = signal.getsignal(signal.SIGINT)
    loader = DataLoader(list(range(20)), batch_size=4)
    it = iter(loader)
    got = [next(it)]
    ledger = _ledgers.LoaderLedger
    monkeypatch.setattr(ledger, "deliver", ctrl_c_after(ledger.deliver))
    with pytest.raises(KeyboardInterrupt):
        got.append(next(it))
        time.sleep(2)  # the loop body, where the Ctrl-C comes
    monkeypatch.undo()
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["batches_yielded"] == 2
    it.close()
    assert signal.getsignal(signal.SIGINT) is handler  # the epoch's relay is gone with it
    resumed = DataLoader(list(range(20)), batch_size=4)
    resumed.load_state_dict(state)
    assert _values(got + list(resumed)) == [list(range(k, k + 4)) for k in range(0, 20, 4)]


@pytest.mark.parametrize("leave", ["break", "end"])
def test_a_held_ctrl_c_reaches_the_loop_however_it_is_left(
    monkeypatch: pytest.MonkeyPatch, leave: str
) -> None:
    # Held back while a batch is counted, it is sent again once the batch is out: not into
    # the __del__ that closes an iterator left with break (Python would print it and go on),
    # and into the loop's except when that batch was the last.
    from feedline.loader import _ledgers

    which = 0 if leave == "break" else 4  # the first batch, or the last of 5
    ledger = _ledgers.LoaderLedger
    monkeypatch.setattr(ledger, "deliver", ctrl_c_after(ledger.deliver, lambda n, *_: n == which))
    where = where_the_ctrl_c_lands(DataLoader(list(range(20)), batch_size=4), leave)
    assert where == (("after the loop", 1) if leave == "break" else ("the loop", 5))
