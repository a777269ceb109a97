"""PipePool, the process regions' pool: calls, results and errors over a pipe per worker."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import CancelledError
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest

from feedline import Pipeline, PipelineBuilder, PipelineFailure
from feedline._proc.pipe_pool import PipePool
from feedline.pipeline._engine import Run
from feedline.pipeline._pipeline import _Holder

from .._system import own_segments, starts_processes, zombies
from ..pipeline._helpers import (
    NeedsTwoArgs,
    big_bytes,
    call_sys_exit,
    die_on_three,
    exit_code_of_a_child,
    fail_init,
    fail_on_three,
    fail_unless,
    length_and_pid,
    pid_and_square,
    raise_needs_two,
    return_a_lock,
    sleep_for,
    square,
    wait_for_file,
)

pytestmark = starts_processes

_CTX = multiprocessing.get_context("forkserver")


def _pool_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("feedline-pool")]


_segments_before: set[str] = set()


@pytest.fixture(autouse=True)
def _count_segments() -> None:
    _segments_before.clear()
    _segments_before.update(own_segments())


def _sleeping_region(seconds: list[float], **build: Any) -> Pipeline[float]:
    """A pipeline whose items sleep their value in a process region (2 workers, 4 calls)."""
    return (
        PipelineBuilder()
        .add_source(seconds)
        .pipe_in_processes(sleep_for, processes=2, concurrency=4)
        .add_sink()
        .build(**build)
    )


def _no_leftovers() -> None:
    """No child process, zombie, pool thread or shared-memory segment left by the test."""
    assert multiprocessing.active_children() == []
    assert zombies() == []
    assert _pool_threads() == []
    assert own_segments() <= _segments_before


def test_calls_go_to_the_least_busy_worker_and_the_pool_restarts_after_close() -> None:
    pool = PipePool(2, _CTX, "test")
    futures = [pool.submit(square, i) for i in range(20)]
    assert [f.result(30) for f in futures] == [i * i for i in range(20)]
    assert len(multiprocessing.active_children()) == 2
    pool.close()
    _no_leftovers()
    assert pool.submit(square, 7).result(30) == 49  # new workers
    pool.close()
    pool.close()  # again: nothing to do
    _no_leftovers()


def test_a_pool_closed_with_hold_starts_no_workers_until_reopened() -> None:
    # A stop closes its regions so: a call that raced with it (counted in just before the
    # stop, sent just after the close) must not start workers that the stop then waits for.
    pool = PipePool(2, _CTX, "test")
    assert pool.submit(square, 3).result(30) == 9
    pool.close(hold=True)
    late = pool.submit(sleep_for, 30.0)
    with pytest.raises(CancelledError, match="closed"):
        late.result(0)
    assert multiprocessing.active_children() == []
    pool.close()  # a plain close keeps the hold
    with pytest.raises(CancelledError):
        pool.submit(square, 3).result(0)
    pool.reopen()
    assert pool.submit(square, 4).result(30) == 16  # new workers
    pool.close()
    _no_leftovers()


def test_a_region_stopped_part_way_refuses_calls_until_the_next_epoch() -> None:
    items = [0.0] + [30.0] * 6
    pipeline = _sleeping_region(items)
    for _ in pipeline:
        break
    (region,) = pipeline._holder.regions
    with pytest.raises(CancelledError):  # as a call that raced with the stop finds it
        region.submit(sleep_for, 30.0).result(0)
    assert multiprocessing.active_children() == []
    items[:] = [0.0, 0.0]
    assert list(pipeline) == [0.0, 0.0]  # the next epoch starts workers again
    del pipeline
    _no_leftovers()


def test_a_call_its_region_cancels_mid_epoch_is_an_items_failure_not_a_silent_loss() -> None:
    # Whoever closes the pool mid-epoch (not a stop), the item it cancels is named and counted:
    # the worker that awaited it must not end as if cancelled itself, losing the item unseen.
    pipeline = _sleeping_region([0.0, 30.0] + [0.0] * 4, max_failures=6)
    (region,) = pipeline._holder.regions
    out = []
    t0 = time.monotonic()
    for x in pipeline:
        out.append(x)
        if len(out) == 1:
            time.sleep(0.5)  # the 30 s item is in a worker by now
            region.close()
    assert time.monotonic() - t0 < 15
    (stage,) = [s for s in pipeline.stats().stages if s.name == "sleep_for"]
    assert 30.0 not in out
    assert stage.failures >= 1
    assert len(out) + stage.failures == 6  # each item delivered or counted as failed
    del pipeline
    _no_leftovers()


def test_a_stop_from_another_thread_never_holds_the_next_epochs_regions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another thread stops the epoch and does its last close of the regions slowly (ending
    # workers takes a moment); the consumer's next epoch, started meanwhile, must find them
    # open. The consumer's own stop waits for the stopper to be in that close, so that the
    # stopper is the one to do it.
    items = [0.0] * 4 + [30.0] * 4
    pipeline = _sleeping_region(items)
    close_regions, run_stop = _Holder.close_regions, Run.stop
    closes: list[str] = []
    last_close = threading.Event()

    def slow_close(holder: _Holder) -> None:
        closes.append(threading.current_thread().name)
        if threading.current_thread().name == "stopper" and closes.count("stopper") == 2:
            last_close.set()
            time.sleep(1.0)  # a start() may come now
        close_regions(holder)

    def stop(run: Run) -> None:
        run_stop(run)
        if threading.current_thread().name == "MainThread":
            last_close.wait(10)  # let the stopper take the last close

    monkeypatch.setattr(_Holder, "close_regions", slow_close)
    monkeypatch.setattr(Run, "stop", stop)
    it = iter(pipeline)
    assert next(it) == 0.0
    stopper = threading.Thread(target=pipeline.stop, name="stopper")
    stopper.start()
    assert 30.0 not in list(it)  # ends as the stop reaches the consumer
    items[:] = [0.4] * 8  # an epoch of about 2 s: the stopper's last close comes amid it
    t0 = time.monotonic()
    assert list(pipeline) == [0.4] * 8
    assert time.monotonic() - t0 < 15
    stopper.join(30)
    assert closes.count("stopper") == 2
    del it, pipeline
    _no_leftovers()


def test_submitting_large_items_to_a_busy_worker_never_blocks(tmp_path: Path) -> None:
    # 3 MiB per call is far more than a pipe holds: what it cannot take waits in the outbox.
    flag = str(tmp_path / "go")
    pool = PipePool(1, _CTX, "test")
    try:
        stuck = pool.submit(wait_for_file, flag)
        t0 = time.monotonic()
        futures = [pool.submit(length_and_pid, big_bytes(i)) for i in range(8)]
        submitted = time.monotonic() - t0
        assert not stuck.done()  # the worker is still stuck: nothing it took let submit go on
        Path(flag).touch()
        pid = stuck.result(30)
        assert [f.result(30) for f in futures] == [(3 << 20, i, pid) for i in range(8)]
        assert submitted < 20  # returned while the worker was stuck (the pipe holds 64 KiB)
    finally:
        Path(flag).touch()
        pool.close()
    _no_leftovers()


def test_errors_come_back_as_the_users_exception_with_the_workers_traceback() -> None:
    pool = PipePool(1, _CTX, "region 'x'")
    try:
        with pytest.raises(ValueError, match="three is not allowed") as caught:
            pool.submit(fail_on_three, 3).result(30)
        assert "Original traceback in worker process" in "\n".join(caught.value.__notes__)
        assert "fail_on_three" in "\n".join(caught.value.__notes__)
        with pytest.raises(RuntimeError, match=r"NeedsTwoArgs.*cannot be rebuilt"):
            pool.submit(raise_needs_two, 1).result(30)
        with pytest.raises(TypeError, match="lock"):  # a result that cannot be pickled
            pool.submit(return_a_lock, 1).result(30)
        assert pool.submit(square, 3).result(30) == 9  # the worker goes on after each
        assert NeedsTwoArgs(1, 2).args == ("1 and 2",)
    finally:
        pool.close()
    _no_leftovers()


def test_a_worker_that_dies_fails_its_item_and_a_replacement_runs_the_queued_ones() -> None:
    pool = PipePool(1, _CTX, "region 'x'")
    try:
        first = pool.submit(square, 2).result(30)  # the worker has answered: it may be replaced
        futures = [pool.submit(die_on_three, i) for i in range(3, 8)]
        with pytest.raises(BrokenProcessPool, match=r"region 'x'.*killed by SIGKILL.*this item"):
            futures[0].result(30)
        assert [f.result(30) for f in futures[1:]] == [4, 5, 6, 7]
        assert first == 4
    finally:
        pool.close()
    _no_leftovers()


def test_a_worker_that_cannot_start_breaks_the_pool() -> None:
    pool = PipePool(2, _CTX, "region 'x'", initializer=fail_init)
    try:
        future = pool.submit(square, 2)
        with pytest.raises(BrokenProcessPool, match="as it started"):
            future.result(30)
        assert pool.broken
        with pytest.raises(BrokenProcessPool, match="as it started"):
            pool.submit(square, 2)  # the pool is broken: later calls are refused at once
    finally:
        pool.close()
    _no_leftovers()


def test_closing_with_calls_under_way_cancels_them(tmp_path: Path) -> None:
    pool = PipePool(2, _CTX, "test")
    futures = [pool.submit(wait_for_file, str(tmp_path / "never")) for _ in range(4)]
    time.sleep(0.2)
    pool.close()  # the workers are stuck in a call: ended after a short grace
    for future in futures:
        with pytest.raises(CancelledError):
            future.result(0)
    _no_leftovers()


def test_workers_ignore_ctrl_c(tmp_path: Path) -> None:
    flag = str(tmp_path / "go")
    pool = PipePool(1, _CTX, "test")
    try:
        pid, _ = pool.submit(pid_and_square, 1).result(30)  # the worker is up
        future = pool.submit(wait_for_file, flag)
        os.kill(pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the whole group
        time.sleep(0.2)
        Path(flag).touch()
        assert future.result(30) == pid
    finally:
        pool.close()
    _no_leftovers()


def test_a_region_whose_worker_dies_names_the_item_and_skips_it_within_the_budget() -> None:
    def build(max_failures: int) -> object:
        return (
            PipelineBuilder()
            .add_source(range(8))
            .pipe_in_processes(die_on_three, processes=2, name="native")
            .add_sink()
            .build(max_failures=max_failures)
        )

    skipping = build(1)
    assert sorted(skipping) == [0, 1, 2, 4, 5, 6, 7]  # type: ignore[call-overload]
    failing = build(0)
    with pytest.raises(PipelineFailure, match=r"stage 'native'.*source item") as caught:
        list(failing)  # type: ignore[call-overload]
    assert "killed by SIGKILL" in str(caught.value.__cause__)
    del skipping, failing
    import gc

    gc.collect()
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    _no_leftovers()


def test_a_crash_on_a_new_workers_first_item_fails_only_that_item() -> None:
    # The replacement of a worker that died is ready before it runs anything: its own death
    # on its first item is that item's doing, not a start that failed.
    pool = PipePool(1, _CTX, "region 'x'")
    try:
        futures = [pool.submit(die_on_three, i) for i in (3, 3, 4, 5)]
        for future in futures[:2]:
            with pytest.raises(BrokenProcessPool, match="while it ran this item"):
                future.result(30)
        assert [f.result(30) for f in futures[2:]] == [4, 5]
        assert not pool.broken
    finally:
        pool.close()
    _no_leftovers()


def test_a_broken_pool_works_again_once_closed(tmp_path: Path) -> None:
    flag = tmp_path / "ready"
    pool = PipePool(2, _CTX, "test", initializer=fail_unless, initargs=(str(flag),))
    try:
        with pytest.raises(BrokenProcessPool, match="as it started"):
            pool.submit(square, 2).result(30)
        pool.close()
        flag.touch()
        assert pool.submit(square, 3).result(30) == 9
    finally:
        pool.close()
    _no_leftovers()


def test_an_op_may_start_processes_and_may_call_sys_exit() -> None:
    pool = PipePool(1, _CTX, "test")
    try:
        assert pool.submit(exit_code_of_a_child, 2).result(30) == 0  # workers are not daemonic
        with pytest.raises(RuntimeError, match=r"SystemExit\(3,\).*raise an exception instead"):
            pool.submit(call_sys_exit, 3).result(30)
        assert pool.submit(square, 4).result(30) == 16  # the worker went on
    finally:
        pool.close()
    _no_leftovers()


def test_a_close_interrupted_part_way_is_finished_by_the_next(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from feedline._proc import pipe_pool as _pipe_pool

    pool = PipePool(2, _CTX, "test")
    assert pool.submit(square, 2).result(30) == 4
    # Both workers in a call: an idle one would exit by itself once its task pipe closes.
    futures = [pool.submit(wait_for_file, str(tmp_path / "never")) for _ in range(2)]
    real = _pipe_pool._end

    def interrupted(workers: object) -> None:
        monkeypatch.setattr(_pipe_pool, "_end", real)
        raise KeyboardInterrupt  # a second Ctrl-C while the first one's close waits

    monkeypatch.setattr(_pipe_pool, "_end", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    assert len(multiprocessing.active_children()) == 2
    pool.close()
    for future in futures:
        with pytest.raises(CancelledError):
            future.result(0)
    _no_leftovers()


def test_leaving_an_epoch_early_does_not_wait_for_the_items_in_the_workers() -> None:
    pipeline = _sleeping_region([0.0] + [30.0] * 6)
    t0 = time.monotonic()
    for _ in pipeline:
        break
    assert time.monotonic() - t0 < 15  # not the 30 s items (nor those queued behind them)
    del pipeline
    _no_leftovers()


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_worker_killed_between_items_is_blamed_for_none() -> None:
    # Calls sent to a worker that was already dead (the pool's thread may not have seen it
    # yet) were never read by it: they run on its replacement.
    pool = PipePool(1, _CTX, "test")
    try:
        for _ in range(3):
            pid, _ = pool.submit(pid_and_square, 1).result(30)
            os.kill(pid, signal.SIGKILL)  # idle, between items (as the OOM killer might)
            deadline = time.monotonic() + 10
            while not _dead(pid) and time.monotonic() < deadline:
                time.sleep(0.001)
            futures = [pool.submit(square, i) for i in range(4)]
            assert [f.result(30) for f in futures] == [0, 1, 4, 9]
    finally:
        pool.close()
    _no_leftovers()


def test_the_calls_a_dead_worker_never_read_are_those_whole_in_its_pipe() -> None:
    from concurrent.futures import Future
    from multiprocessing.connection import Connection

    from feedline._proc.pipe_pool import _Worker
    from feedline._proc.pipe_worker import HEADER

    read_end, write_end = os.pipe()
    worker = _Worker(None, Connection(write_end), Connection(read_end))
    futures: list[Future[object]] = [Future() for _ in range(3)]
    for call, future in enumerate(futures, 1):
        worker.send(call, future, bytes(100 * call))
    assert [f for f, _ in worker.never_read()] == futures  # it died between items
    os.read(read_end, HEADER.size + 100)  # it took the first call, then died
    assert [f for f, _ in worker.never_read()] == futures[1:]
    worker.gone = True  # a later call found the pipe closed: kept in the outbox
    worker.outbox += [memoryview(b"x" * (HEADER.size + 400))]
    worker.calls[4] = (Future(), bytes(400))
    assert len(worker.never_read()) == 3
    worker.tasks.close()
    worker.results.close()


def test_two_threads_stopping_a_region_pipeline_at_once() -> None:
    for _ in range(4):
        pipeline = (
            PipelineBuilder()
            .add_source([0.0] + [5.0] * 6)
            .pipe_in_processes(sleep_for, processes=2)
            .add_sink()
            .build()
        )
        it = iter(pipeline)
        assert next(it) == 0.0
        errors: list[BaseException] = []

        def stop(p: object = pipeline, errors: list[BaseException] = errors) -> None:
            try:
                p.stop()  # type: ignore[attr-defined]
            except BaseException as error:  # any error fails the test
                errors.append(error)

        threads = [threading.Thread(target=stop) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        del it, pipeline
    _no_leftovers()
