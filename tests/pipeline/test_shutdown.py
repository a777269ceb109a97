"""Stopping is re-entrant and leaves nothing: no thread, child process, zombie or segment."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from feedline import PipelineBuilder, iterate_in_subprocess, run_pipeline_in_subprocess
from feedline._proc import subprocess as _subprocess
from feedline.pipeline import _executors

from .._interrupts import ctrl_c_after
from .._system import own_segments, starts_processes
from . import _helpers

pytestmark = starts_processes


def _feedline_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("feedline-"))


def _zombies() -> list[int]:
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == me:
            found.append(int(entry))
    return found


def _slow(x: int) -> int:
    time.sleep(0.05)
    return x


def _slow_gen(x: int) -> Any:
    time.sleep(0.05)
    yield x


def _build(kind: str, pool: ThreadPoolExecutor) -> Any:
    b = PipelineBuilder().add_source(range(60))
    if kind == "sync":
        b.pipe(_slow, concurrency=4)
    elif kind == "generator":
        b.pipe(_slow_gen, concurrency=4)
    else:
        b.pipe(_slow, concurrency=4, executor=pool)
    return b.add_sink(2).build(num_threads=4)


@pytest.mark.parametrize("kind", ["sync", "generator", "executor"])
@pytest.mark.parametrize("where", ["join", "shutdown"])
def test_a_stop_interrupted_by_a_second_ctrl_c_is_finished_by_the_next(
    kind: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = ThreadPoolExecutor(4)
    pipeline = _build(kind, pool)
    it = iter(pipeline)
    next(it)
    interrupted = []
    if where == "join":
        original_join = threading.Thread.join

        def join(self: threading.Thread, timeout: float | None = None) -> None:
            if not interrupted and self.name == "feedline-event-loop":
                interrupted.append(self.name)
                raise KeyboardInterrupt
            original_join(self, timeout)

        monkeypatch.setattr(threading.Thread, "join", join)
    else:
        original = _executors.WorkerPool.shutdown

        def shutdown(self: Any, wait: bool = True) -> None:
            if not interrupted:
                interrupted.append("pool")
                raise KeyboardInterrupt
            original(self, wait)

        monkeypatch.setattr(_executors.WorkerPool, "shutdown", shutdown)
    with pytest.raises(KeyboardInterrupt):
        pipeline.stop()
    assert interrupted
    pipeline.stop()  # finishes what the interrupted one left
    assert _feedline_threads() == []
    del it
    # The next epoch is whole.
    assert sorted(pipeline) == list(range(60))
    pool.shutdown()


def test_an_epoch_after_an_interrupted_one_is_complete_and_close_leaves_nothing() -> None:
    before = own_segments()
    with run_pipeline_in_subprocess(_helpers.slow_array_builder(8), num_threads=2) as it:
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(it):
                if i == 1:
                    raise KeyboardInterrupt
        assert sorted(int(a[0]) for a in it) == list(range(8))
    assert own_segments() - before == set()
    assert _zombies() == []


def test_close_mid_epoch_returns_within_a_second_and_leaves_nothing() -> None:
    before = own_segments()
    it = run_pipeline_in_subprocess(_helpers.slow_array_builder(50), num_threads=2)
    epoch = iter(it)
    next(epoch)
    time.sleep(0.3)  # the child has arrays waiting in the queue
    started = time.monotonic()
    it.close()
    assert time.monotonic() - started < 1.0
    epoch.close()
    assert own_segments() - before == set()
    assert _zombies() == []


def test_ctrl_c_while_the_child_is_started_leaves_no_zombie(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The interrupt arrives while the child's arguments are being written to it: the start
    # completes, then the interrupt is raised, and close() reaps the child.
    original = _subprocess._sigint_deferred

    @functools.wraps(original)
    def deferred() -> Any:
        manager = original()

        class Interrupting:
            def __enter__(self) -> None:
                manager.__enter__()
                os.kill(os.getpid(), 2)  # SIGINT, held back until the start is done

            def __exit__(self, *exc: object) -> None:
                manager.__exit__(*exc)

        return Interrupting()

    monkeypatch.setattr(_subprocess, "_sigint_deferred", deferred)
    factory = functools.partial(_helpers.make_slow, 10, 0.001)
    it = iterate_in_subprocess(factory)
    with pytest.raises(KeyboardInterrupt):
        iter(it)
    monkeypatch.undo()
    it.close()
    assert _zombies() == []
    assert list(it) == list(range(10))  # a new child serves the next epoch
    it.close()


_GROUP_PARENT = """
import sys, time
sys.path.insert(0, {tests!r})
from feedline import run_pipeline_in_subprocess
from pipeline import _helpers

if __name__ == "__main__":
    it = run_pipeline_in_subprocess(_helpers.slow_array_builder(50), num_threads=2)
    try:
        for i, _ in enumerate(it):
            if i == 2:
                print(it.pid, flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise
"""


def test_ctrl_c_to_the_process_group_leaves_no_segment_and_no_process() -> None:
    # A terminal's Ctrl-C: SIGINT to the parent and its child at once, mid-epoch, while
    # arrays are in flight through shared memory.
    import signal
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent.parent)
    parents = []
    for _ in range(3):
        parent = subprocess.Popen(
            [sys.executable, "-c", _GROUP_PARENT.format(tests=tests)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        parents.append(parent.pid)
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        time.sleep(0.3)  # arrays waiting in the queue
        os.killpg(parent.pid, signal.SIGINT)
        assert parent.stdout.readline().strip() == "interrupted"
        assert parent.wait(20) != 0
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{child}")
    # The segments are named after the parent that started the child.
    assert [own_segments(pid) for pid in parents] == [set()] * 3


def _interrupting(original: Callable[..., Any], after: bool) -> Callable[..., Any]:
    # ``original``, except that its first call raises KeyboardInterrupt (a second Ctrl-C),
    # after doing its work if ``after``, before doing any otherwise.
    fired: list[bool] = []

    def hook(*args: Any, **kwargs: Any) -> Any:
        if fired:
            return original(*args, **kwargs)
        fired.append(True)
        if after:
            original(*args, **kwargs)
        raise KeyboardInterrupt

    hook.fired = fired  # type: ignore[attr-defined]
    return hook


@pytest.mark.parametrize("where", ["settle", "leave", "segments"])
def test_an_epoch_after_a_second_ctrl_c_during_clean_up_is_complete(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first Ctrl-C lands while the consumer waits for its fourth item, with arrays in
    # shared memory on their way; the second while that clean-up runs: before it began
    # (settle), once the child was asked to leave (ask_to_leave, then the wait for it), or
    # while the child's segments are removed (remove_prefixed).
    threads, segments = _helpers.live_threads(), own_segments()
    it = iterate_in_subprocess(functools.partial(_helpers.full_arrays, 30))
    receive = _subprocess.SubprocessIterable._receive
    calls: list[int] = []

    def first_ctrl_c(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 5:  # "ready", then three items
            assert _helpers.wait_until(lambda: own_segments() - segments)
            raise KeyboardInterrupt
        return receive(self, *args, **kwargs)

    monkeypatch.setattr(_subprocess.SubprocessIterable, "_receive", first_ctrl_c)
    if where == "settle":
        second = _interrupting(_subprocess.SubprocessIterable.settle, after=False)
        monkeypatch.setattr(_subprocess.SubprocessIterable, "settle", second)
    elif where == "leave":
        second = _interrupting(_subprocess._Child.ask_to_leave, after=True)
        monkeypatch.setattr(_subprocess._Child, "ask_to_leave", second)
    else:
        second = _interrupting(_subprocess.remove_prefixed, after=False)
        monkeypatch.setattr(_subprocess, "remove_prefixed", second)
    with pytest.raises(KeyboardInterrupt):
        for _ in it:
            pass
    assert second.fired, "the second interrupt did not come from the clean-up"  # type: ignore[attr-defined]
    monkeypatch.undo()
    # The next epoch finishes what the clean-up left and is whole (it yielded nothing, or
    # the interrupted epoch's items, or left that child's segments behind).
    assert [int(a[0]) for a in it] == list(range(30))
    assert [int(a[0]) for a in it] == list(range(30))
    it.close()
    _helpers.assert_nothing_left(threads, segments)


def test_a_close_interrupted_part_way_is_finished_by_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads, segments = _helpers.live_threads(), own_segments()
    it = iterate_in_subprocess(functools.partial(_helpers.full_arrays, 30))
    epoch = iter(it)
    next(epoch)
    assert _helpers.wait_until(lambda: own_segments() - segments)  # arrays waiting
    second = _interrupting(_subprocess.remove_prefixed, after=False)
    monkeypatch.setattr(_subprocess, "remove_prefixed", second)
    with pytest.raises(KeyboardInterrupt):
        it.close()
    monkeypatch.undo()
    assert own_segments() - segments  # the interrupted close left them
    it.close()
    epoch.close()
    _helpers.assert_nothing_left(threads, segments)


@pytest.mark.parametrize("when", ["waiting", "between"])
def test_close_from_another_thread_ends_the_loop_quietly(
    when: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As Pipeline.stop() from another thread: the loop ends, with no error, whether the
    # close lands while the consumer waits for the child's next item (the child is stuck on
    # it: the close ends it) or between two items. Not "SubprocessDied ... (pid None)".
    threads, segments = _helpers.live_threads(), own_segments()
    gate = str(tmp_path / "gate")
    it = iterate_in_subprocess(functools.partial(_helpers.Gated, gate))
    closer = threading.Thread(target=it.close, name="closer")
    got = []
    if when == "waiting":
        receive = _subprocess.SubprocessIterable._receive
        calls: list[int] = []

        def close_meanwhile(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 3:  # "ready", item 0, then the wait for item 1
                closer.start()
            return receive(self, *args, **kwargs)

        monkeypatch.setattr(_subprocess.SubprocessIterable, "_receive", close_meanwhile)
    for item in it:
        got.append(item)
        if when == "between":
            closer.start()
            closer.join()
    closer.join()
    assert got == [0]
    monkeypatch.undo()
    open(gate, "w").close()
    assert list(it) == [0, 1, 2]  # a new child serves the next epoch
    it.close()
    _helpers.assert_nothing_left(threads, segments)


def test_a_task_runs_only_once_the_pool_thread_started_for_it_has_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A thread becomes idle while a submission makes a new one for its task: the idle thread
    # may run the task first. The run's stop follows its last job, and then joins every pool
    # thread: one still unstarted raised "cannot join thread before it is started".
    release = threading.Event()
    seen: list[bool] = []
    original_init, original_start = threading.Thread.__init__, threading.Thread.start

    def init(self: threading.Thread, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self.name == "test-pool_1":
            release.set()  # the first task ends: its thread takes the next task

    def start(self: threading.Thread) -> None:
        if self.name == "test-pool_1":
            time.sleep(0.3)  # a slow thread start
        original_start(self)

    monkeypatch.setattr(threading.Thread, "__init__", init)
    monkeypatch.setattr(threading.Thread, "start", start)
    pool = _executors.WorkerPool(2, "test-pool", threading.Lock())
    done = threading.Event()

    def check() -> None:
        seen.append(all(t.ident is not None for t, _ in pool._threads))
        done.set()

    try:
        pool.submit(release.wait)
        pool.submit(check)  # no thread idle: it makes a second one
        assert done.wait(5)
        assert seen == [True]
    finally:
        release.set()
        pool.shutdown(wait=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool")]


def test_a_thread_that_cannot_start_leaves_the_pool_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "test-pool_1":
            raise RuntimeError("can't start new thread")
        original_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    pool = _executors.WorkerPool(2, "test-pool", threading.Lock())
    release, ran = threading.Event(), threading.Event()
    try:
        pool.submit(release.wait)  # the first thread, busy until released
        with pytest.raises(RuntimeError, match="can't start new thread"):
            pool.submit(ran.set)  # no thread idle: the second cannot start
        assert [t.name for t, _ in pool._threads] == ["test-pool_0"]
        release.set()
        monkeypatch.setattr(threading.Thread, "start", original_start)
        pool.submit(ran.set)  # not queued before: it runs now, on either thread
        assert ran.wait(5)
    finally:
        release.set()
        pool.shutdown(wait=True)  # joins only threads that started
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool")]


def _named(names: list[str], done: threading.Event) -> None:
    names.append(threading.current_thread().name)
    done.set()


def test_a_pool_wakes_the_thread_idle_last_so_that_one_task_at_a_time_stays_on_one() -> None:
    # Three threads started, then tasks one at a time: each goes to the thread that went
    # idle last, the one that ran the task before (woken in turn, they went round all three).
    pool = _executors.WorkerPool(3, "test-pool", threading.Lock())
    started = threading.Barrier(4, timeout=10)
    for _ in range(3):
        pool.submit(started.wait)
    started.wait()
    names: list[str] = []
    for _ in range(12):
        deadline = time.monotonic() + 10
        while len(pool._idle) < 3:  # the last task's thread is back on the stack
            assert time.monotonic() < deadline
            time.sleep(1e-3)
        done = threading.Event()
        pool.submit(_named, names, done)
        assert done.wait(10)
    assert len(names) == 12
    assert len(set(names)) == 1, names
    pool.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool")]


def test_a_pool_shutdown_cut_short_part_way_through_its_ends_is_finished_by_the_next() -> None:
    # A Ctrl-C after the pool marked itself shut down and before it had queued an end for
    # each thread: the next shutdown queues the rest (before: it joined the threads for ever).
    pool = _executors.WorkerPool(3, "test-pool", threading.Lock())
    release = threading.Event()
    for _ in range(3):
        pool.submit(release.wait)
    thread, inbox = pool._threads[0]  # (the thread holds its own reference to its inbox)

    class InterruptedAfterOne:
        def put(self, task: Any) -> None:
            inbox.put(task)
            raise KeyboardInterrupt

    pool._threads[0] = (thread, InterruptedAfterOne())  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        pool.shutdown(wait=False)
    pool._threads[0] = (thread, inbox)
    release.set()
    assert _returns(pool.shutdown), "the second shutdown waits for threads never told to end"
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool")]


def _returns(call: Callable[[], Any], within: float = 10.0) -> bool:
    # Whether ``call`` returns within ``within`` seconds (run on a daemon thread: one that
    # hangs leaves the test, not the test run, waiting).
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(within)
    return not thread.is_alive()


def _slowly(x: Any) -> Any:
    time.sleep(0.01)
    return x


def _finalize_in(where: str) -> tuple[Callable[[Any], Any], list[Any], threading.Event]:
    # An op (sync or async) whose calls after the first wait until given the pipeline's
    # finalizer, then one of them calls it (as a garbage collection in the op would), and
    # says when it did.
    given: list[Any] = []
    done, claim = threading.Event(), threading.Lock()

    def finalize_once() -> None:
        with claim:
            if not done.is_set():
                given[0]()
                done.set()

    def op(x: Any) -> Any:
        if x > 0:
            _helpers.wait_until(lambda: bool(given))
            finalize_once()
        return x

    async def aop(x: Any) -> Any:
        if x > 0:
            while not given:
                await asyncio.sleep(0.005)
            finalize_once()
        return x

    return (op if where == "worker" else aop), given, done


@pytest.mark.parametrize("where", ["worker", "event loop"])
def test_a_pipeline_finalized_on_one_of_its_own_threads_stops_and_leaves_nothing(
    where: str,
) -> None:
    # The pipeline's finalizer runs on a thread of its own run (a collection that frees it
    # in an op, on a pool thread or the event loop): it cannot wait there for the run's
    # threads, one of which is itself. It stops the run from a thread of its own. (Before:
    # the pool thread waited for itself for ever, warning every 5 s; on the loop, the pool's
    # threads were never joined.)
    threads, segments = _helpers.live_threads(), own_segments()
    op, given, done = _finalize_in(where)
    builder = PipelineBuilder().add_source(range(10**6))
    if where == "event loop":  # a stage on threads before it: the pool has threads to join
        builder = builder.pipe(_slowly, concurrency=2)
    pipeline = builder.pipe(op, concurrency=2).add_sink().build()
    it = iter(pipeline)
    next(it)
    given.append(pipeline._finalizer)
    assert done.wait(10)
    del it, pipeline, given[:]
    _helpers.assert_nothing_left(threads, segments)


def test_stop_called_from_inside_an_op_returns_and_the_run_ends() -> None:
    # A stop asked for by one of the run's own calls cannot wait for that call to end.
    threads, segments = _helpers.live_threads(), own_segments()
    holder: list[Any] = []
    returned = threading.Event()

    def stops(x: int) -> int:
        if x == 50 and holder[0] is not None:
            holder[0].stop()
            returned.set()
        return x

    pipeline = PipelineBuilder().add_source(range(20_000)).pipe(stops).build()
    holder.append(pipeline)
    got = sum(1 for _ in pipeline)
    assert returned.wait(5)
    assert 0 < got < 20_000
    holder[:] = [None]  # the next epoch does not stop itself; it runs whole, on a new run
    assert sum(1 for _ in pipeline) == 20_000
    del holder[:], pipeline
    _helpers.assert_nothing_left(threads, segments)


@pytest.mark.parametrize("continuous", [False, True])
def test_a_stop_from_another_thread_as_a_loop_begins_ends_the_loop_quietly(
    monkeypatch: pytest.MonkeyPatch, continuous: bool
) -> None:
    # Pipeline.stop is safe to call any time: one that lands between the loop's start of the
    # run and its first look at it ends the loop (before: a bare AssertionError).
    threads, segments = _helpers.live_threads(), own_segments()
    pipeline = (
        PipelineBuilder()
        .add_source(range(100))
        .pipe(_helpers.identity, concurrency=4)
        .build(continuous=continuous)
    )
    start = type(pipeline).start

    def start_then_stopped_elsewhere(self: Any) -> None:
        start(self)
        stopper = threading.Thread(target=self.stop)
        stopper.start()
        stopper.join()

    monkeypatch.setattr(type(pipeline), "start", start_then_stopped_elsewhere)
    assert list(pipeline) == []
    monkeypatch.undo()
    assert sorted(pipeline) == list(range(100))  # the next loop runs a whole epoch
    del pipeline
    _helpers.assert_nothing_left(threads, segments)


def test_two_loops_of_one_pipeline_are_refused_even_if_both_were_made_first() -> None:
    pipeline = PipelineBuilder().add_source(range(1000)).pipe(str, concurrency=4).build()
    first, second = iter(pipeline), iter(pipeline)
    assert next(first) is not None
    with pytest.raises(RuntimeError, match="already being iterated"):
        next(second)
    assert 1 + sum(1 for _ in first) == 1000  # the first loop has the whole epoch
    assert sorted(pipeline, key=int) == [str(i) for i in range(1000)]


def test_a_stop_that_an_interrupt_cut_short_is_finished_by_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Ctrl-C inside the first stop, after the run was marked as stopping and before the
    # event loop was told: the next stop tells it again (before: it joined the loop for ever).
    from feedline.pipeline._stages import _sink

    threads, segments = _helpers.live_threads(), own_segments()
    pipeline = PipelineBuilder().add_source(range(10**6)).pipe(str, concurrency=2).build()
    interrupt = _sink.SinkReader.interrupt

    def cut_short(self: Any) -> None:
        monkeypatch.setattr(_sink.SinkReader, "interrupt", interrupt)
        raise KeyboardInterrupt

    it = iter(pipeline)
    next(it)
    monkeypatch.setattr(_sink.SinkReader, "interrupt", cut_short)
    with pytest.raises(KeyboardInterrupt):
        pipeline.stop()
    assert _returns(pipeline.stop), "the second stop hangs"
    it.close()
    del it, pipeline
    _helpers.assert_nothing_left(threads, segments)


@pytest.mark.parametrize("queued", [False, True])
def test_a_ctrl_c_while_a_job_is_handed_to_the_pool_leaves_the_stop_nothing_to_wait_for(
    monkeypatch: pytest.MonkeyPatch, queued: bool
) -> None:
    # The interrupt lands in the pool's submit, before or after the job was queued: the job
    # is counted done once (by the pool's thread, or by the submit if it never started), and
    # the stop does not wait for a job that will never run.
    threads, segments = _helpers.live_threads(), own_segments()
    submit = _executors.WorkerPool.submit
    hits: list[int] = []

    def interrupted(self: Any, fn: Any, *args: Any) -> None:
        if threading.current_thread() is not threading.main_thread() or hits:
            return submit(self, fn, *args)
        hits.append(1)
        if queued:
            submit(self, fn, *args)
        raise KeyboardInterrupt

    pipeline = PipelineBuilder().add_source(range(1000)).pipe(_slow, concurrency=2).build()
    monkeypatch.setattr(_executors.WorkerPool, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        for _ in pipeline:
            pass
    assert hits
    assert _returns(pipeline.stop), "the stop waits for a job that never runs"
    monkeypatch.undo()
    del pipeline
    _helpers.assert_nothing_left(threads, segments)


def test_a_ctrl_c_as_a_pool_thread_starts_leaves_that_thread_to_be_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The interrupt comes in Thread.start's wait for the new thread, which runs: the pool
    # lists it, so that its shutdown ends and joins it (before: it stayed, idle, for good).
    original_start = threading.Thread.start

    def interrupted_start(self: threading.Thread) -> None:
        original_start(self)
        raise KeyboardInterrupt

    pool = _executors.WorkerPool(2, "test-pool", threading.Lock())
    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        pool.submit(lambda: None)
    monkeypatch.undo()
    pool.shutdown(wait=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool")]


async def _cancelled_at_5(x: int) -> int:
    if x == 5:
        raise asyncio.CancelledError  # as an await of something cancelled elsewhere would
    return x


async def _exits_at_5(x: int) -> int:
    if x == 5:
        raise SystemExit("from the op")
    return x


@pytest.mark.parametrize(
    ("op", "raised"), [(_cancelled_at_5, RuntimeError), (_exits_at_5, SystemExit)]
)
def test_a_coroutine_op_that_raises_a_base_exception_ends_the_run_with_an_error(
    op: Any, raised: type[BaseException]
) -> None:
    # Not an Exception, so not an item's failure: the run ends with it, as a sync op's does
    # (before: the stage's task, or the event loop, ended and the consumer waited for ever).
    threads, segments = _helpers.live_threads(), own_segments()
    pipeline = PipelineBuilder().add_source(range(100)).pipe(op, concurrency=4).build()
    with pytest.raises(raised):
        for _ in pipeline:
            pass
    del pipeline
    _helpers.assert_nothing_left(threads, segments)


def test_a_run_that_a_coroutine_op_ended_leaves_no_task_pending(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The calls of the next stage still wait as the SystemExit ends the loop: they are
    # cancelled and awaited before it closes, never destroyed pending.
    async def waits(x: int) -> int:
        await asyncio.sleep(30)
        return x

    builder = PipelineBuilder().add_source(range(100)).pipe(_exits_at_5, concurrency=8)
    pipeline = builder.pipe(waits, concurrency=8).build()
    with caplog.at_level(logging.ERROR, "asyncio"), pytest.raises(SystemExit):
        for _ in pipeline:
            pass
    del pipeline
    gc.collect()
    assert "destroyed but it is pending" not in caplog.text
    assert "Event loop is closed" not in caplog.text


@pytest.mark.parametrize("kind", ["generator", "async generator"])
def test_a_stop_closes_the_op_iterators_it_left_part_way(kind: str) -> None:
    # An op that yields many outputs per item, stopped while its outputs wait for room: its
    # finally blocks (closing a file, say) run by the time stop() returns, not when the
    # pipeline is collected.
    closed: list[int] = []
    started: list[int] = []

    def expand(x: int) -> Any:
        started.append(x)
        try:
            yield from range(1000)
        finally:
            closed.append(x)

    async def expand_async(x: int) -> Any:
        started.append(x)
        try:
            for k in range(1000):
                yield k
        finally:
            closed.append(x)

    op = expand if kind == "generator" else expand_async
    p = PipelineBuilder().add_source(range(100)).pipe(op, concurrency=2).add_sink(2).build()
    it = iter(p)
    for _ in range(10):
        next(it)
    it.close()  # type: ignore[attr-defined]
    p.stop()
    assert started
    assert sorted(closed) == sorted(started)
    assert _feedline_threads() == []


# -- Ctrl-C and exit do not wait for an op that never returns -------------------------------


def _ctrl_c_after(seconds: float) -> threading.Timer:
    # SIGINT to the main thread, as a terminal's Ctrl-C reaches it.
    import signal

    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    return timer


def _ended(prefix: str) -> bool:
    # Whether the threads named ``prefix``... have ended (within a few seconds).
    deadline = time.monotonic() + 5
    while any(t.name.startswith(prefix) for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_ctrl_c_leaves_an_op_that_never_returns_after_a_moment(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from feedline._grace import STOP_GRACE

    release = threading.Event()

    def op(i: int) -> int:
        if i == 3:
            release.wait(20)  # a read without a timeout
        return i

    pipeline = PipelineBuilder().add_source(range(50)).pipe(op, concurrency=2).build()
    seen = []
    timer = _ctrl_c_after(0.5)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, "feedline.pipeline"):
        with pytest.raises(KeyboardInterrupt):
            for item in pipeline:
                seen.append(item)
        took = time.monotonic() - began
    timer.join()
    release.set()
    assert took < 0.5 + STOP_GRACE + 2, f"Ctrl-C took {took:.1f} s to reach the caller"
    assert "1 job(s) still inside stage ops after 1 s are left running" in caplog.text
    assert 3 not in seen
    assert len(seen) == 49
    assert _ended("feedline-worker")  # the thread left ends as its op does
    # The next epoch runs as usual.
    assert sorted(pipeline) == list(range(50))


def test_ctrl_c_in_the_loop_body_leaves_an_op_that_never_returns_after_a_moment() -> None:
    # The KeyboardInterrupt raised in the body closes the loop's generator as it unwinds,
    # before any except block holds it: the SIGINT the relay passed on says it is Ctrl-C.
    from feedline._grace import STOP_GRACE

    release = threading.Event()

    def op(i: int) -> int:
        if i == 3:
            release.wait(20)
        return i

    pipeline = PipelineBuilder().add_source(range(50)).pipe(op, concurrency=2).build()
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for item in pipeline:
            if item == 0:
                timer = _ctrl_c_after(0.3)
                time.sleep(5)  # the training step, where the Ctrl-C comes
    took = time.monotonic() - began
    timer.join()
    release.set()
    assert took < 0.3 + STOP_GRACE + 2, f"Ctrl-C took {took:.1f} s to reach the caller"
    assert _ended("feedline-worker")


def test_a_ctrl_c_held_then_a_break_leaves_an_op_that_never_returns_after_a_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Ctrl-C that lands as the item is counted is held back until it is handed out; the
    # body then leaves with break. That is still a stop on Ctrl-C: it waits a moment for the
    # op, not as long as the op runs, and the Ctrl-C comes after it.
    from feedline._grace import STOP_GRACE
    from feedline._ledger import Ledger

    release = threading.Event()

    def op(i: int) -> int:
        if i >= 1:
            release.wait(20)  # a read without a timeout
        return i

    monkeypatch.setattr(Ledger, "deliver", ctrl_c_after(Ledger.deliver, lambda n: n == 0))
    pipeline = PipelineBuilder().add_source(range(50)).pipe(op, concurrency=2).build(resumable=True)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for _ in pipeline:
            break
        time.sleep(5)  # after the loop, where the held Ctrl-C comes
    took = time.monotonic() - began
    release.set()
    assert took < STOP_GRACE + 2, f"Ctrl-C took {took:.1f} s to reach the caller"
    assert _ended("feedline-worker")


def test_a_pipeline_left_running_at_exit_does_not_hold_the_exit() -> None:
    import subprocess
    import sys

    script = (
        "import threading, feedline\n"
        "began = threading.Event()\n"
        "def op(i):\n"
        "    began.set()\n"
        "    threading.Event().wait()  # never returns\n"
        "p = feedline.PipelineBuilder().add_source(range(10)).pipe(op).build()\n"
        "p.start()\n"
        "began.wait(30)\n"
        "print('leaving', flush=True)\n"
    )
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "leaving" in done.stdout
    assert time.monotonic() - began < 15
    assert "left running on daemon threads" in done.stderr
