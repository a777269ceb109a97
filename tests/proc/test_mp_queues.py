"""The feeder threads of multiprocessing queues: write_first writes without one."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

from feedline._proc.queues import close_queue, write_first


def _feeders_end() -> bool:
    # A closed queue's feeder thread leaves once what was put reached the pipe.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not any(t.name == "QueueFeederThread" for t in threading.enumerate()):
            return True
        time.sleep(0.01)
    return False


def _echo(q: mp.Queue, out: mp.Queue) -> None:  # type: ignore[type-arg]
    for _ in range(3):
        out.put(q.get())


def test_a_first_small_message_is_written_without_a_feeder_thread() -> None:
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    before = threading.active_count()
    assert write_first(q, ("start", 1, list(range(100))))
    assert threading.active_count() == before  # no feeder thread
    child = ctx.Process(target=_echo, args=(q, out))
    child.start()
    try:
        q.put("second")  # the usual way from here: a feeder thread, after the first message
        assert not write_first(q, "third")  # not the first: nothing written
        q.put("third")
        got = [out.get(timeout=10) for _ in range(3)]
        assert got == [("start", 1, list(range(100))), "second", "third"]
    finally:
        child.join(10)
        assert child.exitcode == 0
        close_queue(q)
        close_queue(out)
    assert _feeders_end()


def test_a_large_first_message_goes_through_the_feeder() -> None:
    # Larger than the part of an empty pipe written without blocking: a reader that is not
    # there yet must not hold the writer.
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    big = bytes(1 << 20)
    assert not write_first(q, big)
    assert q.empty()
    q.put(big)
    assert q.get(timeout=10) == big
    assert not write_first(q, "small")  # the feeder runs
    close_queue(q)
    assert _feeders_end()


def test_get_after_write_first_keeps_the_queue_usable() -> None:
    # write_first takes the queue's semaphore as put does, which get gives back: many rounds
    # neither over-release it nor block.
    ctx = mp.get_context("fork")
    for _ in range(50):
        q = ctx.Queue()
        assert write_first(q, "x")
        assert q.get(timeout=10) == "x"
        assert q.empty()
        close_queue(q)
