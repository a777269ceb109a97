"""``num_workers="auto"``: fetching moves between threads and worker processes mid-epoch.

The moves are driven here by a scripted rule (the rule itself has its table in
``test_move_decisions.py``), so that each test moves where it means to; two tests at the end
let the real measurements decide. Every test counts the batches: each index handed out
once, in order, whatever moved; and no worker process outlives its epoch.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from feedline import DataLoader  # noqa: E402
from feedline.errors import ConfigurationError  # noqa: E402
from feedline.loader import _epoch, _move  # noqa: E402
from feedline.loader._move import Decision  # noqa: E402
from feedline.loader._workers import WorkerSet  # noqa: E402

from .._system import own_segments, starts_processes, zombies  # noqa: E402
from ._datasets import Counting, Drawing, NotRebuilt, Sleepy, Spinning, Stream  # noqa: E402
from ._procs import alone, no_children_left  # noqa: E402

pytestmark = starts_processes


class Script:
    """Stands in for ``_move.decide``: the decisions given, one per window, then "stay"."""

    def __init__(self, *decisions: Decision) -> None:
        self.decisions = list(decisions)
        self.calls = 0
        self.trials: list[float | None] = []  # the trial rate each call was given

    def __call__(
        self, sample: Any, trial_rate: float | None, may_try: bool, asked: Any = None
    ) -> Decision:
        self.calls += 1
        self.trials.append(trial_rate)
        if self.decisions and may_try:
            return self.decisions.pop(0)
        return Decision("stay", "scripted")


def _feedline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("feedline-")]


@pytest.fixture(autouse=True)
def leaves_nothing() -> Iterator[None]:
    """After each test: no thread of feedline's, child process, zombie or segment left."""
    segments = own_segments()
    yield
    gc.collect()  # iterators a test dropped: their finalizers stop what they ran
    deadline = time.monotonic() + 5
    while _feedline_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _feedline_threads() == []
    no_children_left()
    assert zombies() == []
    assert own_segments() <= segments


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Iterator[Script]:
    """Windows of 3 batches, judged at once, by the decisions the test scripts."""
    monkeypatch.setattr(_move, "MIN_BATCHES", 3)
    monkeypatch.setattr(_move, "MIN_SECONDS", 0.0)
    monkeypatch.setattr(_move, "SKIP_BATCHES", 1)
    monkeypatch.setattr(_move, "TRIAL_BATCHES", 3)
    monkeypatch.setattr(_move, "TRIAL_SECONDS", 0.0)
    monkeypatch.setattr(_move, "TRIAL_SKIP", 1)
    monkeypatch.setattr(_epoch, "_HINTED", [False])
    scripted = Script()
    monkeypatch.setattr(_epoch, "decide", scripted)
    yield scripted
    no_children_left()


def move(workers: int) -> Decision:
    return Decision("move", f"scripted: to {workers}", workers)


BACK = Decision("back", "scripted: back")
KEEP = Decision("keep", "scripted: keep", 1)


def batches_of(loader: DataLoader[Any], limit: int | None = None) -> list[tuple[int, int]]:
    """(index, pid of the process that fetched it) for each item handed out."""
    got: list[tuple[int, int]] = []
    for n, (indices, pids) in enumerate(loader):
        got += zip(indices.tolist(), pids.tolist(), strict=True)
        if limit is not None and n + 1 == limit:
            break
    return got


@pytest.mark.parametrize("in_order", [True, False])
def test_fetching_moves_to_workers_and_back_mid_epoch_with_each_batch_once(
    script: Script, in_order: bool
) -> None:
    script.decisions = [move(2), BACK]
    loader = DataLoader(Spinning(240), batch_size=4, num_workers="auto", in_order=in_order)
    got = batches_of(loader)
    indices = [i for i, _ in got]
    assert sorted(indices) == list(range(240))  # each once
    if in_order:
        assert indices == list(range(240))
    me = os.getpid()
    where = [pid != me for _, pid in got]
    first_in_workers = where.index(True)
    back = where.index(False, first_in_workers)
    assert not any(where[back:]), "after moving back, every batch is fetched here"
    assert len({pid for _, pid in got if pid != me}) == 2  # two workers fetched
    tuning = loader.stats().tuning  # type: ignore[union-attr]
    assert any("moves to 2 worker process(es)" in t for t in tuning)
    assert any("moves back to threads" in t for t in tuning)
    ledger = loader.stats().ledger  # type: ignore[union-attr]
    assert ledger is not None
    assert ledger.delivered == ledger.planned == 60
    assert loader.num_workers == 0
    no_children_left()


def test_a_kept_move_starts_the_next_epoch_in_workers(script: Script) -> None:
    script.decisions = [move(1), KEEP]
    loader = DataLoader(Spinning(400), batch_size=4, num_workers="auto")
    first = batches_of(loader)
    assert [i for i, _ in first] == list(range(400))
    assert loader.num_workers == 1
    no_children_left()  # not persistent: ended with the epoch
    second = batches_of(loader)
    assert [i for i, _ in second] == list(range(400))
    assert all(pid != os.getpid() for _, pid in second)


def test_a_trial_the_epoch_ended_in_is_judged_in_the_next_epoch(
    script: Script, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A trial's window is longer than the rest of the epoch: the next epoch, which starts in
    # the workers, judges the trial on an ordinary window (else an epoch too short for a
    # trial's window would leave every trial unjudged, in the workers for good).
    monkeypatch.setattr(_move, "TRIAL_BATCHES", 1_000)
    script.decisions = [move(2), BACK]
    loader = DataLoader(Spinning(80), batch_size=4, num_workers="auto")
    assert [i for i, _ in batches_of(loader)] == list(range(80))
    assert script.calls == 1  # the move; its trial window never filled
    assert loader.num_workers == 2
    second = batches_of(loader)
    assert [i for i, _ in second] == list(range(80))
    assert script.trials[1] is not None  # judged as the trial it is
    assert loader.num_workers == 0
    assert any("moves back to threads" in t for t in loader.stats().tuning)  # type: ignore[union-attr]
    assert second[-1][1] == os.getpid()


def test_a_trial_that_falls_short_in_epochs_shorter_than_two_windows_is_judged() -> None:
    # The real rule, epochs of 14 batches: the window a trial fell short on ("ask") is kept
    # across the epoch's end, and the next epoch's window judges the trial on both (else
    # each epoch would end on a new "ask", and the loader stay in the workers for good).
    loader = DataLoader(Spinning(56), batch_size=4, num_workers="auto")
    placement = loader._placement
    assert placement is not None
    placement.workers, placement.trial_rate = 2, 1e6  # a trial no rate can pass
    workers = []
    for _ in range(3):
        for _batch in loader:
            time.sleep(0.04)  # the training step: 14 batches make about 0.6 s
        workers.append(loader.num_workers)
    assert workers[:2] == [2, 0], loader.stats().tuning  # type: ignore[union-attr]
    assert placement.trial_rate is None
    tuning = loader.stats().tuning  # type: ignore[union-attr]
    assert any("measured once more" in t for t in tuning)
    assert any("over two windows" in t and "moves back to threads" in t for t in tuning)


def test_break_after_a_move_then_state_dict_resumes_with_nothing_lost_or_repeated(
    script: Script,
) -> None:
    script.decisions = [move(2)]
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(
        Spinning(200), batch_size=5, shuffle=True, generator=generator, num_workers="auto"
    )
    head = batches_of(loader, limit=20)
    assert any(pid != os.getpid() for _, pid in head), "the move happened before the break"
    state = loader.state_dict()
    no_children_left()
    again = DataLoader(
        Spinning(200),
        batch_size=5,
        shuffle=True,
        generator=torch.Generator(),
        num_workers="auto",
    )
    again.load_state_dict(state)
    tail = batches_of(again)
    indices = [i for i, _ in head + tail]
    assert sorted(indices) == list(range(200))
    # The same order as an epoch that never moved.
    plain = DataLoader(
        Spinning(200), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    assert indices == [i for i, _ in batches_of(plain)]


def test_failures_within_the_budget_are_skipped_on_both_sides_of_a_move(script: Script) -> None:
    script.decisions = [move(2), BACK]
    failing = frozenset({1, 50, 150, 230})
    loader = DataLoader(
        Spinning(240, failing=failing), batch_size=4, num_workers="auto", max_failures=10
    )
    indices = [i for i, _ in batches_of(loader)]
    assert indices == [i for i in range(240) if i not in failing]


def test_ctrl_c_during_a_move_leaves_no_process(
    script: Script, monkeypatch: pytest.MonkeyPatch
) -> None:
    script.decisions = [move(2)]
    start = WorkerSet.start

    def interrupted(self: WorkerSet, *args: Any, **kwargs: Any) -> None:
        start(self, *args, **kwargs)  # the workers run, then Ctrl-C comes
        raise KeyboardInterrupt

    monkeypatch.setattr(WorkerSet, "start", interrupted)
    loader = DataLoader(Spinning(400), batch_size=4, num_workers="auto")
    pids: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pids.append(0)
    assert pids, "the move came after some batches"
    no_children_left()
    assert not own_segments()


def _unpicklable(n: int) -> Spinning:
    dataset = Spinning(n)
    dataset.transform = lambda x: x  # type: ignore[attr-defined]
    return dataset


@pytest.mark.parametrize(
    ("make", "said"),
    [
        # It does not pickle: no worker starts.
        (_unpicklable, "cannot be sent to the worker processes"),
        # It pickles, so the workers start; each dies making its copy. The move waits for
        # them before it deals any batch.
        (NotRebuilt, "exited (exit code 1)"),
    ],
    ids=["not pickled", "not rebuilt"],
)
def test_a_dataset_the_workers_cannot_take_stays_on_threads_with_each_batch_once(
    script: Script, caplog: pytest.LogCaptureFixture, make: Any, said: str
) -> None:
    script.decisions = [move(2)]
    loader = DataLoader(
        make(120), batch_size=4, num_workers="auto", multiprocessing_context="forkserver"
    )
    with caplog.at_level(logging.WARNING, "feedline.loader"):
        got = batches_of(loader)
    assert [i for i, _ in got] == list(range(120))
    assert all(pid == os.getpid() for _, pid in got)
    tuning = loader.stats().tuning  # type: ignore[union-attr]
    assert any("stays on threads: the workers could not start" in t for t in tuning)
    assert said in caplog.text
    assert script.decisions == []
    assert script.calls >= 1
    no_children_left()
    script.decisions = [move(2)]
    assert len(batches_of(loader)) == 120  # the next epoch does not try again
    assert script.decisions == [move(2)]


def test_a_move_forks_once_the_threads_that_fetched_are_joined(script: Script) -> None:
    # The threads' part of the epoch is stopped, its threads joined, before the workers
    # start: with no other thread left, they fork (a lambda in the dataset needs no pickling),
    # as the first workers of an epoch do.
    alone()
    script.decisions = [move(2)]
    dataset = Spinning(240)
    dataset.transform = lambda x: x  # type: ignore[attr-defined]
    loader = DataLoader(dataset, batch_size=4, num_workers="auto")
    got = batches_of(loader)
    assert [i for i, _ in got] == list(range(240))
    assert any(pid != os.getpid() for _, pid in got)


@pytest.mark.parametrize("in_order", [True, False])
def test_the_workers_start_as_the_threads_last_batch_is_handed_out(
    script: Script, in_order: bool
) -> None:
    # The move does not wait for the next call: the workers fetch their first batches while
    # the consumer works on the last one the threads fetched.
    import multiprocessing

    script.decisions = [move(2)]
    loader = DataLoader(Spinning(240), batch_size=4, num_workers="auto", in_order=in_order)
    me = os.getpid()
    seen: list[tuple[bool, int]] = []  # (fetched here, worker processes alive when handed out)
    for indices, pids in loader:
        assert len(set(pids.tolist())) == 1
        seen.append((pids[0].item() == me, len(multiprocessing.active_children())))
        assert len(indices) == 4
        if len(seen) < 8:  # a training step: the threads have batches drawn ahead at the move
            time.sleep(0.03)
    last_here = max(n for n, (here, _) in enumerate(seen) if here)
    assert last_here < len(seen) - 1, "the epoch moved to the workers"
    assert [alive for _, alive in seen[:last_here]] == [0] * last_here
    assert seen[last_here][1] == 2
    ledger = loader.stats().ledger  # type: ignore[union-attr]
    assert ledger is not None
    assert ledger.delivered == ledger.planned == 60


def stays_unmeasured(script: Script, loader: DataLoader[Any], why: str) -> None:
    """No window is judged, and the reason to stay (``why`` in it) is in ``stats()``."""
    assert script.calls == 0
    tuning = loader.stats().tuning  # type: ignore[union-attr]
    assert any(why in t and "stays on threads" in t for t in tuning)


def test_a_stateful_dataset_stays_on_threads_unmeasured(script: Script) -> None:
    script.decisions = [move(2)]
    loader = DataLoader(Counting(40), batch_size=4, num_workers="auto")
    assert len(list(loader)) == 10
    stays_unmeasured(script, loader, "state_dict()")


def test_free_threaded_python_keeps_fetching_on_threads(
    script: Script, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    script.decisions = [move(2)]
    loader = DataLoader(Spinning(200), batch_size=4, num_workers="auto")
    assert all(pid == os.getpid() for _, pid in batches_of(loader))
    stays_unmeasured(script, loader, "free-threaded")


def test_threads_log_one_hint_naming_num_workers_auto(
    script: Script, caplog: pytest.LogCaptureFixture
) -> None:
    script.decisions = [move(2), move(2)]
    with caplog.at_level(logging.WARNING, "feedline.loader"):
        for _ in range(2):
            loader = DataLoader(Spinning(64), batch_size=4)
            got = batches_of(loader)
            assert all(pid == os.getpid() for _, pid in got)  # the hint moves nothing
    hints = [r for r in caplog.records if 'num_workers="auto"' in r.getMessage()]
    assert len(hints) == 1
    assert "scripted: to 2" in hints[0].getMessage()


def test_num_workers_auto_arguments() -> None:
    with pytest.raises(ConfigurationError, match="persistent_workers"):
        DataLoader(Spinning(8), num_workers="auto", persistent_workers=True)
    with pytest.raises(ConfigurationError, match='"auto"'):
        DataLoader(Spinning(8), num_workers="many")
    loader = DataLoader(Spinning(8), num_workers="auto")
    assert loader.num_workers == 0  # on threads until a move
    loader.num_workers = 2
    assert loader.num_workers == 2
    with pytest.raises(ConfigurationError):
        loader.num_workers = -1
    loader.num_workers = "auto"
    assert loader.num_workers == 0
    assert len(list(loader)) == 8


def test_a_trial_that_goes_back_as_the_epoch_ends_starts_the_next_epoch_on_threads(
    script: Script,
) -> None:
    # However few batches are left when it is judged (the workers hold the hands dealt).
    for batches in (12, 16, 20):
        script.decisions = [move(2), BACK]
        loader = DataLoader(Spinning(4 * batches), batch_size=4, num_workers="auto")
        assert [i for i, _ in batches_of(loader)] == list(range(4 * batches))
        if any("moves back" in t for t in loader.stats().tuning):  # type: ignore[union-attr]
            assert loader.num_workers == 0
            assert all(pid == os.getpid() for _, pid in batches_of(loader))


def test_more_workers_part_way_through_an_epoch_draw_nothing_again(script: Script) -> None:
    # Workers started by a move seed their global generators from the epoch's seed and their
    # first batch: a worker 0 started later does not repeat the first worker 0's draws.
    script.decisions = [move(1), KEEP, move(2)]
    loader = DataLoader(Drawing(400), batch_size=4, num_workers="auto")
    with pytest.warns(RuntimeWarning, match="global random generators"):  # several threads
        draws = [
            (pid, r)
            for _, pids, rs in loader
            for pid, r in zip(pids.tolist(), rs.tolist(), strict=True)
        ]
    assert any("moves to 2" in t for t in loader.stats().tuning)  # type: ignore[union-attr]
    from_workers = [r for pid, r in draws if pid != os.getpid()]
    assert len(set(from_workers)) == len(from_workers)


def test_a_second_iter_stops_the_first_as_with_workers(script: Script) -> None:
    loader = DataLoader(Spinning(400), batch_size=4, num_workers="auto")
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(RuntimeError, match="new iteration"):
        next(first)
    assert [i for indices, _ in second for i in indices.tolist()] == list(range(400))


def test_num_workers_set_mid_epoch_takes_effect_at_the_next(script: Script) -> None:
    script.decisions = [move(2)]
    loader = DataLoader(Spinning(200), batch_size=4, num_workers="auto")
    it = iter(loader)
    got = next(it)[0].tolist()
    loader.num_workers = 2
    got += [i for indices, _ in it for i in indices.tolist()]
    assert got == list(range(200))
    assert loader.num_workers == 2
    assert all(pid != os.getpid() for _, pid in batches_of(loader))


def test_edges_of_an_auto_loader() -> None:
    loader = DataLoader(Spinning(8), num_workers="auto")
    loader.multiprocessing_context = "spawn"  # PyTorch takes it only with workers
    assert loader.mp_context == "spawn"
    stream = DataLoader(Stream(8), batch_size=2, num_workers="auto")
    assert len(list(stream)) == 4
    tuning = stream.stats().tuning  # type: ignore[union-attr]
    assert any("IterableDataset" in t and "stays on threads" in t for t in tuning)
    stateful = DataLoader(Counting(8), batch_size=2, num_workers="auto")
    for _ in range(3):
        list(stateful)
    assert len(stateful.stats().tuning) == 1  # type: ignore[union-attr]  # said once


# -- the real measurements decide -------------------------------------------------------------


def _small_ops(batch: Any, state: Any, ops: int) -> Any:
    # The CPU side of a GPU step: many short calls, each giving the GIL up and taking it back.
    for _ in range(ops):
        state = state.mul(0.999).add(0.001)
    return state


def test_a_dataset_holding_the_gil_beside_a_loop_of_small_ops_is_tried_in_workers() -> None:
    loader = DataLoader(Spinning(100_000, spin=20_000), batch_size=8, num_workers="auto")
    state = torch.zeros(64)
    indices: list[int] = []
    tried = False
    for n, (batch, _) in enumerate(loader):
        indices += batch.tolist()
        state = _small_ops(batch, state, 200)
        tried = any("moves to" in t for t in loader.stats().tuning)  # type: ignore[union-attr]
        if (tried and n > 60) or n == 600:
            break
    assert tried, loader.stats().tuning  # type: ignore[union-attr]
    assert indices == list(range(len(indices)))
    del loader
    no_children_left()


def test_a_dataset_that_waits_stays_on_threads() -> None:
    loader = DataLoader(
        Sleepy(400, {i: 0.002 for i in range(400)}), batch_size=4, num_workers="auto"
    )
    state = torch.zeros(64)
    for batch in loader:
        state = _small_ops(batch, state, 100)
    tuning = loader.stats().tuning  # type: ignore[union-attr]
    assert not any("moves to" in t for t in tuning), tuning
    assert loader.num_workers == 0


def test_ctrl_c_during_a_move_back_to_threads_reaches_the_loop_as_itself(
    script: Script, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The interrupt comes as the threads' new pipeline starts: the loop sees the
    # KeyboardInterrupt (an `except KeyboardInterrupt` that saves a checkpoint runs), not a
    # RuntimeError from the statistics of a pipeline that never ran.
    from feedline.pipeline import Pipeline

    script.decisions = [move(2), BACK]
    start = Pipeline.start
    interrupted: list[int] = []

    def interrupted_after_back(self: Any) -> None:
        if not script.decisions and not interrupted:  # both taken: this is the move back
            interrupted.append(1)
            raise KeyboardInterrupt
        start(self)

    monkeypatch.setattr(Pipeline, "start", interrupted_after_back)
    loader = DataLoader(Spinning(400), batch_size=4, num_workers="auto")
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    assert interrupted
    monkeypatch.undo()
    no_children_left()


def test_stats_from_another_thread_during_moves_never_raise(script: Script) -> None:
    script.decisions = [move(2), BACK, move(2), BACK]
    loader = DataLoader(Spinning(400), batch_size=4, num_workers="auto")
    errors: list[BaseException] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                loader.stats()
            except BaseException as error:  # counted: none may come
                errors.append(error)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert sorted(i for i, _ in batches_of(loader)) == list(range(400))
    finally:
        done.set()
        watcher.join()
    assert errors == []
    no_children_left()
