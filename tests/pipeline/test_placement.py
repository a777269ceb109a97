"""Stages of ``executor="auto"``: on threads, moved to worker processes where the GIL holds them.

The decision itself, from windows given by hand, is in ``test_tuner_decisions.py``; here real
runs show what a move does: where the calls run, that no item is lost or repeated across it,
that a stage that cannot move says why, and that no process outlives the pipeline. Whether
processes pay is the machine's to measure (a loaded one rightly finds they do not), so the
tests that need a move kept or undone set the gain it must bring.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import sys
import threading
import time
import types
from concurrent.futures import CancelledError
from typing import Any

import pytest

from feedline import ConfigurationError, PipelineBuilder
from feedline.pipeline import _decide, _tuner
from feedline.pipeline._placement import Placement, cannot_move

from .._system import own_segments, starts_processes, zombies
from ._helpers import (
    holds_the_gil,
    holds_the_gil_on_bytes,
    holds_the_gil_unless_seven,
    processes_gone,
    sleep_for,
    square,
    waits,
)
from .test_tuner import decided, run_for, run_until

pytestmark = starts_processes

gil = pytest.mark.skipif(
    not getattr(sys, "_is_gil_enabled", lambda: True)(),
    reason="free-threaded Python: threads run Python code side by side, nothing moves",
)


@pytest.fixture(autouse=True)
def _this_process_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # The cores this process leaves idle count as room for workers, whatever other processes
    # (another test's, on a shared machine) do with them: these tests are about what a move
    # does; whether to move is decided from given figures in test_tuner_decisions.py.
    monkeypatch.setattr(_tuner, "_machine_idle", lambda: None)
    # Nor does a move wait for a window whose calls were seen waiting for the GIL: on a
    # loaded machine a stage kept at one call, then tried at two, may have about one call in
    # flight in every window, and the test waited minutes for its move.
    monkeypatch.setattr(_decide, "MOVE_WAITED", 100.0)


def _runs_in(pipeline: Any) -> str:
    return str(pipeline.stats().stages[1].runs_in)


@gil
def test_a_stage_that_holds_the_gil_moves_mid_epoch_and_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_decide, "MOVE_GAIN", 0.0)  # kept, whatever this machine measures
    pipeline = (
        PipelineBuilder()
        .add_source(itertools.count())
        .pipe(holds_the_gil, executor="auto", output_order="input")
        .add_sink()
        .build()
    )
    seen: list[tuple[int, int]] = []
    where: set[str] = set()
    it = iter(pipeline)
    t0 = time.monotonic()
    for item in it:
        seen.append(item)
        if len(seen) % 50 == 0:
            stats = pipeline.stats()
            where.add(stats.stages[1].runs_in)
            kept = any(re.search(r"processes \(2\) kept", d) for d in stats.tuning)
            if kept and sum(pid != os.getpid() for _, pid in seen) >= 200:
                break
        assert time.monotonic() - t0 < 60, pipeline.stats()
    it.close()
    assert [x for x, _ in seen] == list(range(len(seen)))  # none lost, none twice, in order
    pids = {pid for _, pid in seen}
    assert os.getpid() in pids  # on threads first...
    assert len(pids - {os.getpid()}) >= 1  # ... then in the workers
    assert where >= {"threads", "processes (2)"}
    decisions = "\n".join(pipeline.stats().tuning)
    assert re.search(
        r"its calls kept [\d.]+ cores busy, [\d.]+ idle: trying 2 processes", decisions
    )
    # The next epoch starts where this one left the stage: in processes.
    for _ in pipeline:
        assert _runs_in(pipeline) == "processes (2)"
        break
    del pipeline, it
    processes_gone()


@gil
def test_in_processes_an_item_whose_call_raises_fails_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_decide, "MOVE_GAIN", 0.0)
    pipeline = (
        PipelineBuilder()
        .add_source(itertools.count())
        .pipe(holds_the_gil_unless_seven, executor="auto", output_order="input")
        .add_sink()
        .build(max_failures=None)
    )
    seen: list[int] = []
    moved_at = None
    t0 = time.monotonic()
    for x, pid in pipeline:
        seen.append(x)
        if moved_at is None and pid != os.getpid():
            moved_at = len(seen)
        if moved_at is not None and len(seen) >= moved_at + 300:
            break
        assert time.monotonic() - t0 < 60, f"no move: {pipeline.stats()}"
    placement = pipeline._config.stages[0].placement
    assert placement.takes > 1  # the items went in chunks
    assert seen == [x for x in range(seen[-1] + 1) if x % 10 != 7]  # each 7 alone, in order
    assert "Unlucky: " in caplog.text
    assert "ends in 7" in caplog.text
    assert "source item 7" in caplog.text  # the failure names its source item
    del pipeline
    processes_gone()


@gil
def test_items_that_do_not_pickle_keep_the_stage_on_threads_and_lose_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_decide, "MOVE_GAIN", 0.0)
    views = (memoryview(bytes([i % 256])) for i in itertools.count())
    pipeline = (
        PipelineBuilder()
        .add_source(views)
        .pipe(holds_the_gil_on_bytes, executor="auto", output_order="input")
        .add_sink()
        .build()  # no failure allowed
    )
    out: list[int] = []
    deadline = time.monotonic() + 30  # until the move is tried (later on a loaded machine)
    for x, _ in pipeline:
        out.append(x)
        if len(out) % 500 == 0 and (
            "cannot be sent" in pipeline.stats().stages[1].runs_in or time.monotonic() > deadline
        ):
            break
    assert out == [i % 256 for i in range(len(out))]
    stats = pipeline.stats()
    assert any("trying 2 processes" in d for d in stats.tuning), stats
    assert "its items cannot be sent to processes (TypeError" in stats.stages[1].runs_in
    del pipeline
    processes_gone()


@gil
def test_a_move_that_does_not_pay_goes_back_to_threads_and_ends_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_decide, "MOVE_GAIN", 100.0)  # never pays
    pipeline = (
        PipelineBuilder()
        .add_source(itertools.count())
        .pipe(holds_the_gil, executor="auto")
        .add_sink()
        .build()
    )
    seen = []
    back = False
    it = iter(pipeline)
    t0 = time.monotonic()
    for item in it:
        seen.append(item[0])
        if not back and len(seen) % 50 == 0:
            back = any("processes did not pay" in d for d in pipeline.stats().tuning)
        if back and not multiprocessing.active_children():
            break  # the retired workers ended while the epoch goes on
        assert time.monotonic() - t0 < 60, f"no move and back: {pipeline.stats()}"
    assert _runs_in(pipeline) == "threads"
    it.close()
    assert len(set(seen)) == len(seen)
    del pipeline
    processes_gone()


@gil
def test_a_move_back_is_remembered_in_the_next_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each epoch's tuner starts afresh, but not on the moves that went back: the next epoch
    # waits the retry schedule out (and the one after a second move back, twice as long).
    monkeypatch.setattr(_decide, "MOVE_GAIN", 100.0)  # never pays
    segments = own_segments()
    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(holds_the_gil, executor="auto")
        .add_sink()
        .build()
    )
    t0 = time.monotonic()
    for n, _ in enumerate(pipeline):
        if n % 50 == 0 and any("processes did not pay" in d for d in pipeline.stats().tuning):
            break
        assert time.monotonic() - t0 < 60, f"no move and back: {pipeline.stats()}"
    assert "(tried again in 30 s)" in pipeline.stats().tuning[-1]
    t0 = time.monotonic()
    for _ in pipeline:  # the next epoch, for a few of the tuner's windows
        if time.monotonic() - t0 > 2:
            break
    tuning = pipeline.stats().tuning
    assert not any("processes" in d for d in tuning), tuning
    assert _runs_in(pipeline) == "threads"
    del pipeline
    processes_gone(segments)  # no worker, zombie or shared-memory segment left


def test_an_op_that_waits_stays_on_threads() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(itertools.count())
        .pipe(waits, executor="auto")
        .add_sink()
        .build()
    )
    stats = run_for(pipeline, 2.0)
    assert stats.stages[1].runs_in.startswith("threads")  # (stays: ...) on free-threaded Python
    assert not any("processes" in d for d in stats.tuning), stats
    assert multiprocessing.active_children() == []
    del pipeline
    processes_gone()


def test_a_call_sent_to_a_region_as_it_retires_runs_on_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The tuner moves the stage back and closes the idle region between a call's reading of
    # it and its sending there: the call must not start workers nobody would end.
    segments = own_segments()
    placement = Placement(square, "square")
    _moved(placement)
    region = placement._region
    assert region is not None
    send = region.submit

    def retire_then_send(fn: Any, /, *args: Any) -> Any:
        placement.back()
        placement.tidy()
        return send(fn, *args)

    monkeypatch.setattr(region, "submit", retire_then_send)
    assert placement(7) == 49
    assert multiprocessing.active_children() == []
    assert sum(calls for _, calls in placement._cpu.values()) == 1  # on this thread
    placement.close()
    processes_gone(segments)
    assert not [t for t in threading.enumerate() if t.name.startswith("feedline-pool")]


def _moved(placement: Placement) -> None:
    placement.move(1)
    deadline = time.monotonic() + 30
    while placement.poll() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert placement.processes == 1


def test_a_stop_cancels_a_call_in_a_retired_region_without_running_it_again() -> None:
    # The stage moved back to threads while a call ran on in its old region; the stop ends
    # that region: the call fails (uncounted, the run stops), and is not run on a thread.
    segments = own_segments()
    placement = Placement(sleep_for, "sleep_for")
    _moved(placement)
    region = placement._region
    assert region is not None
    errors: list[BaseException] = []

    def call() -> None:
        try:
            placement(5.0)
        except CancelledError as error:
            errors.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 10
    while region.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    placement.back()  # retired, its call under way
    t0 = time.monotonic()
    placement.close(hold=True)  # as a stop does
    caller.join(10)
    assert not caller.is_alive()
    assert time.monotonic() - t0 < 3
    assert len(errors) == 1
    assert placement._cpu == {}  # not run again on a thread
    placement.reopen()
    placement.close()
    processes_gone(segments)
    assert not [t for t in threading.enumerate() if t.name.startswith("feedline-pool")]


def test_autotune_alone_moves_nothing() -> None:
    pipeline = PipelineBuilder().add_source(range(10)).pipe(holds_the_gil).add_sink()
    built = pipeline.build(autotune=True)
    assert sorted(x for x, _ in built) == list(range(10))
    assert built.stats().stages[1].runs_in == "threads"
    assert built._config.stages[0].placement is None


def test_a_stage_that_cannot_move_says_why() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(range(10))
        .pipe(lambda x: x + 1, executor="auto", name="lam")
        .pipe(str, executor="threads")
        .add_sink()
        .build()
    )
    assert sorted(pipeline, key=int) == [str(i + 1) for i in range(10)]
    lam, pinned = pipeline.stats().stages[1:]
    if getattr(sys, "_is_gil_enabled", lambda: True)():
        assert lam.runs_in.startswith("threads (stays: the op cannot be pickled")
        assert "define it at module level" in lam.runs_in
    else:
        assert lam.runs_in.startswith("threads (stays: free-threaded Python")
    assert pinned.runs_in == "threads"


def test_free_threaded_python_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    assert cannot_move(holds_the_gil) == (
        "free-threaded Python runs Python code on threads side by side"
    )
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: True, raising=False)
    assert cannot_move(holds_the_gil) is None


# An op the workers cannot import: its module exists in this process only.
_ghost = types.ModuleType("feedline_tests_ghost")
exec(  # a module made here on purpose
    "import time\n"
    "def spin(x):\n"
    "    end = time.perf_counter() + 0.001\n"
    "    while time.perf_counter() < end:\n"
    "        pass\n"
    "    return x\n",
    _ghost.__dict__,
)


@gil
def test_an_op_its_workers_cannot_import_stays_on_threads_and_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, _ghost.__name__, _ghost)
    pipeline = (
        PipelineBuilder()
        .add_source(itertools.count())
        .pipe(_ghost.spin, executor="auto", output_order="input")
        .add_sink()
        .build()
    )
    out: list[int] = []
    stays = ""
    judged = False
    deadline = time.monotonic() + 60  # the tuner judges the failed move a window later
    for x in pipeline:
        out.append(x)
        if len(out) % 100 == 0:
            stats = pipeline.stats()
            runs_in = str(stats.stages[1].runs_in)
            stays = stays or (runs_in if "stays" in runs_in else "")
            judged = any("it could not move" in d for d in stats.tuning)
            if (stays and judged) or time.monotonic() > deadline:
                break
    assert out == list(range(len(out)))  # nothing lost or repeated on the way
    assert "its workers did not take the op" in stays, pipeline.stats()
    assert judged, pipeline.stats().tuning
    del pipeline
    processes_gone()


@gil
def test_ctrl_c_during_a_move_leaves_no_process(caplog: pytest.LogCaptureFixture) -> None:
    segments = own_segments()
    pipeline = (
        PipelineBuilder()
        .add_source(itertools.count())
        .pipe(holds_the_gil, executor="auto")
        .add_sink()
        .build()
    )
    with pytest.raises(KeyboardInterrupt):
        run_until(pipeline, decided("trying 2 processes"))
        raise KeyboardInterrupt
    assert multiprocessing.active_children() == []  # ended with the epoch, no GC needed
    assert zombies() == []
    # Calls the stop cancelled in the workers are not the items' failures.
    assert "failed on sample" not in caplog.text
    assert pipeline.stats().stages[1].failures == 0
    del pipeline
    processes_gone(segments)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"executor": "processes"}, "executor must be 'auto', 'threads', None or"),
        ({"executor": "auto", "concurrency": 4}, "executor='auto' tunes the stage"),
    ],
)
def test_executor_arguments_that_cannot_work(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        PipelineBuilder().add_source(range(3)).pipe(holds_the_gil, **kwargs)


def test_a_coroutine_cannot_be_placed() -> None:
    async def op(x: int) -> int:
        return x

    with pytest.raises(ConfigurationError, match="run on the event loop"):
        PipelineBuilder().add_source(range(3)).pipe(op, executor="auto")


class _Chunk:
    # 1 MiB that counts how often it was pickled.
    pickled = 0

    def __reduce__(self) -> tuple[Any, ...]:
        _Chunk.pickled += 1
        return (bytes, (bytes(1 << 20),))


class _Holder:
    # A large object whose bound method would travel with every item.
    def __init__(self) -> None:
        self.chunks = [_Chunk() for _ in range(64)]

    def size(self, x: int) -> int:
        return x + len(self.chunks)


def test_an_op_that_pickles_large_stays_without_pickling_it_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: True, raising=False)
    _Chunk.pickled = 0
    why = cannot_move(_Holder().size)
    assert why is not None
    assert "pickles to over 1 MiB" in why
    assert _Chunk.pickled <= 2  # it stopped at the limit
