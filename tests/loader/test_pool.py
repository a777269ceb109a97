from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

import pytest

from feedline.loader._pool import LimitedPool


def test_runs_every_job_fifo_within_the_limit() -> None:
    pool = LimitedPool(8, "test-pool")
    pool.set_limit(3)
    lock = threading.Lock()
    running = peak = 0
    order: list[int] = []

    def job(i: int) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            order.append(i)
        time.sleep(0.01)
        with lock:
            running -= 1

    done = threading.Semaphore(0)
    for i in range(30):
        pool.submit(lambda i=i: (job(i), done.release()))  # type: ignore[misc]
    for _ in range(30):
        assert done.acquire(timeout=10)
    pool.close()
    assert peak == 3
    # The first three jobs are taken first; which of their threads reaches the lock first is a
    # race, so only the set is checked here and the exact order with one thread below.
    assert sorted(order[:3]) == [0, 1, 2]
    assert sorted(order) == list(range(30))


def test_one_thread_runs_jobs_in_submit_order() -> None:
    pool = LimitedPool(4, "test-pool")
    pool.set_limit(1)
    order: list[int] = []
    done = threading.Semaphore(0)
    for i in range(20):
        pool.submit(lambda i=i: (order.append(i), done.release()))  # type: ignore[misc]
    for _ in range(20):
        assert done.acquire(timeout=10)
    pool.close()
    assert order == list(range(20))


def test_a_burst_of_submits_starts_only_as_many_threads_as_the_limit() -> None:
    # Threads started but not yet running a job count: each submit of a burst used to start
    # another thread (21 threads for a limit of 3).
    pool = LimitedPool(64, "test-pool")
    pool.set_limit(3)
    gate = threading.Event()
    done = threading.Semaphore(0)
    for _ in range(32):
        pool.submit(lambda: (gate.wait(10), done.release()))  # type: ignore[func-returns-value]
    started = [t for t in threading.enumerate() if t.name.startswith("test-pool")]
    gate.set()
    for _ in range(32):
        assert done.acquire(timeout=10)
    pool.close()
    assert len(started) == 3


def test_raising_the_limit_starts_waiting_jobs() -> None:
    pool = LimitedPool(4, "test-pool")
    pool.set_limit(1)
    release = threading.Event()
    started = threading.Semaphore(0)

    def job() -> None:
        started.release()
        release.wait(10)

    for _ in range(4):
        pool.submit(job)
    assert started.acquire(timeout=5)
    assert not started.acquire(timeout=0.1)  # the limit holds the others back
    assert pool.waiting == 3
    pool.set_limit(4)
    for _ in range(3):
        assert started.acquire(timeout=5)
    release.set()
    pool.close()


def test_close_drops_queued_jobs_and_joins_threads() -> None:
    pool = LimitedPool(2, "test-pool")
    pool.set_limit(1)
    ran: list[int] = []
    gate, started = threading.Event(), threading.Event()
    pool.submit(lambda: (started.set(), gate.wait(10), ran.append(0)))
    pool.submit(lambda: ran.append(1))
    assert started.wait(5)
    closer = threading.Thread(target=pool.close)
    closer.start()
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    assert ran == [0]
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool")]
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda: None)


def test_a_failing_job_is_logged_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    pool = LimitedPool(1, "test-pool")
    done = threading.Event()
    pool.submit(lambda: 1 / 0)
    pool.submit(done.set)
    assert done.wait(5)
    pool.close()
    assert "unexpected error" in caplog.text


def test_queued_seconds_grows_when_threads_crowd_the_cores_not_when_they_sleep() -> None:
    # The fetcher's signal that more calls at once would only queue for the cores.
    cores = os.cpu_count() or 1
    jobs = 2 * cores + 1

    def measure(job: Any) -> float:
        pool = LimitedPool(jobs, "test-queued")
        try:
            done = threading.Barrier(jobs + 1)
            for _ in range(jobs):
                pool.submit(lambda: (job(), done.wait()))
            done.wait(timeout=30)
            queued = pool.queued_seconds()
        finally:
            pool.close()
        if queued is None:  # pragma: no cover - not Linux
            pytest.skip("no per-thread run-queue accounting here")
        return queued

    data = bytes(2**20)

    def compute() -> None:  # releases the GIL: the threads compete for cores only
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            hashlib.sha256(data).digest()

    computing = measure(compute)  # jobs > cores: about half of them queue at any time
    sleeping = measure(lambda: time.sleep(0.3))
    assert computing > 0.1
    assert sleeping < computing / 4


def test_running_on_cores_counts_computing_threads_not_sleeping_ones() -> None:
    # The fetcher's instant check before it admits more calls: the run-queue delay is only
    # added when a thread gets a core, so a short window can miss it.
    data = bytes(2**20)
    for job, expected in (("compute", 3), ("sleep", 0)):
        pool = LimitedPool(3, "test-on-cores")
        stop = threading.Event()
        started = threading.Barrier(4)

        def run(
            job: str = job, stop: threading.Event = stop, started: threading.Barrier = started
        ) -> None:
            started.wait()
            while not stop.is_set():
                if job == "compute":
                    hashlib.sha256(data).digest()  # releases the GIL
                else:
                    time.sleep(0.05)

        try:
            for _ in range(3):
                pool.submit(run)
            started.wait(timeout=10)
            time.sleep(0.02)
            counts = [pool.running_on_cores() for _ in range(20)]
        finally:
            stop.set()
            pool.close()
        if counts[0] is None:  # pragma: no cover - not Linux
            pytest.skip("no per-thread scheduler state here")
        # A snapshot may catch a thread between two calls, or asleep on the GIL: the median.
        assert sorted(c or 0 for c in counts)[10] == expected, counts


def test_queued_seconds_reads_a_bounded_sample_of_threads() -> None:
    # Reading a file per thread of a 128-thread pool took about 1 ms per check.
    pool = LimitedPool(LimitedPool.SAMPLED_THREADS + 8, "test-sample")
    release = threading.Event()
    try:
        for _ in range(pool.max_threads):
            pool.submit(release.wait)
        deadline = time.monotonic() + 10
        while pool.sampled_threads < LimitedPool.SAMPLED_THREADS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.sampled_threads == LimitedPool.SAMPLED_THREADS
    finally:
        release.set()
        pool.close()
