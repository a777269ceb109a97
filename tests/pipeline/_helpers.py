"""Module-level helpers, so that child processes can import them."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from feedline import PipelineBuilder


def square(x: int) -> int:
    return x * x


def pid_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


def make_arrays(i: int) -> dict[str, object]:
    return {
        "index": i,
        "image": np.full((64, 64, 3), i % 256, dtype=np.uint8),
        "big": np.arange(100_000, dtype=np.float32) + i,
    }


def array_builder(n: int) -> PipelineBuilder[object]:
    return PipelineBuilder().add_source(range(n)).pipe(make_arrays, concurrency=2).add_sink(4)


def square_builder(n: int) -> PipelineBuilder[object]:
    return (
        PipelineBuilder()
        .add_source(range(n))
        .pipe(square, concurrency=2, output_order="input")
        .add_sink(4)
    )


def failing_builder(n: int) -> PipelineBuilder[object]:
    return PipelineBuilder().add_source(range(n)).pipe(fail_on_three).add_sink(4)


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three is not allowed")
    return x


def slow_range(n: int, delay: float) -> Iterator[int]:
    for i in range(n):
        time.sleep(delay)
        yield i


def make_slow_range(n: int, delay: float) -> Iterator[int]:
    return slow_range(n, delay)


class SlowRange:
    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __iter__(self) -> Iterator[int]:
        return slow_range(self.n, self.delay)


def make_slow(n: int, delay: float) -> SlowRange:
    return SlowRange(n, delay)


class Stalling:
    """Yields 0 at once, then nothing for ``delay`` seconds, then 1."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __iter__(self) -> Iterator[int]:
        yield 0
        time.sleep(self.delay)
        yield 1


def crash(n: int) -> Iterator[int]:
    yield 1
    os._exit(7)


class Crashing:
    def __iter__(self) -> Iterator[int]:
        return crash(0)


def make_crashing() -> Crashing:
    return Crashing()


def bad_factory() -> list[int]:
    raise RuntimeError("cannot make the iterable")


def fail_on_odd(x: int) -> int:
    if x % 2:
        raise ValueError(f"odd {x}")
    return x


def logged_slow_op(item: tuple[str, int]) -> int:
    """Sleep, then append 'x start end' to the log file named in the item."""
    import fcntl

    log, x = item
    t0 = time.time()
    time.sleep(0.3)
    t1 = time.time()
    with open(log, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"{x} {t0} {t1}\n")
    return x


def bounded_range() -> list[int]:
    return [0, 1, 2]


def square_any(x: object) -> object:
    return x


def process_exits(pid: int, within: float) -> bool:
    """Whether process ``pid`` is gone within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def identity(x: object) -> object:
    return x


def drain_with_deadline(pipeline: Any, deadline: float = 10.0) -> list[Any]:
    """Every item of one epoch; each wait has a deadline, so a hang fails with TimeoutError."""
    got = []
    with pipeline.auto_stop():
        while True:
            try:
                got.append(pipeline.get_item(timeout=deadline))
            except EOFError:
                return got


def slow_arrays(i: int) -> np.ndarray:
    """A large array (it crosses through shared memory), slowly after the first few."""
    if i >= 3:
        time.sleep(0.5)
    return np.full(100_000, i, dtype=np.float32)


def slow_array_builder(n: int) -> PipelineBuilder[object]:
    return PipelineBuilder().add_source(range(n)).pipe(slow_arrays, concurrency=2).add_sink(2)


def make_tensors() -> list[object]:
    """Tensors of several kinds: small, large (shared memory), strided, bfloat16, in a dict."""
    import torch

    big = torch.arange(200_000, dtype=torch.float32)
    return [
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        big,
        {"t": big[::2], "bf": torch.ones(4, dtype=torch.bfloat16), "n": 3},
        torch.tensor(True),
    ]


class NotForPickling:
    """What a region's first function hands its second: refuses to be pickled."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        raise TypeError("NotForPickling crossed a process boundary")


def wrap(x: int) -> NotForPickling:
    return NotForPickling(x)


def unwrap_with_pid(item: NotForPickling) -> tuple[int, int, np.ndarray[Any, Any]]:
    return item.value, os.getpid(), np.full((200, 200), item.value, dtype=np.float32)


class Counted:
    """An input that counts how often it is pickled (in the process that pickles it)."""

    pickled = 0

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        Counted.pickled += 1
        return (Counted, (self.value,))


def value_of(item: Counted) -> int:
    return item.value * 10


class _Overlap:
    """Counts the calls of :func:`wait_and_count` running now in this process."""

    lock = threading.Lock()
    now = 0


def wait_and_count(item: int) -> int:
    """Wait 10 ms; return how many calls of this function were running at its end."""
    with _Overlap.lock:
        _Overlap.now += 1
    time.sleep(0.01)
    with _Overlap.lock:
        running = _Overlap.now
        _Overlap.now -= 1
    return running


def waiting_builder(n: int) -> PipelineBuilder[int]:
    """``range(n)`` through :func:`wait_and_count`, its concurrency left to the tuner."""
    return PipelineBuilder().add_source(range(n)).pipe(wait_and_count)


def die_on_three(x: int) -> int:
    """Kills its own (worker) process on 3, as a crash in native code would."""
    if x == 3:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return x


def wait_for_file(path: str) -> int:
    """Blocks until ``path`` exists; returns the worker's pid."""
    while not os.path.exists(path):
        time.sleep(0.01)
    return os.getpid()


def length_and_pid(data: bytes) -> tuple[int, int, int]:
    return len(data), data[0] if data else -1, os.getpid()


def big_bytes(n: int) -> bytes:
    return bytes([n % 256]) * (3 << 20)


def fail_init() -> None:
    raise RuntimeError("this initializer fails")


class NeedsTwoArgs(Exception):
    """An exception that pickles but cannot be rebuilt from its pickle."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a} and {b}")


def raise_needs_two(x: int) -> int:
    raise NeedsTwoArgs(x, x)


def return_a_lock(x: int) -> object:
    return threading.Lock()


def fail_unless(path: str) -> None:
    """An initializer that fails until ``path`` exists."""
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing")


def sleep_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def exit_code_of_a_child(x: int) -> int | None:
    """Starts a process of its own (which a daemonic worker could not)."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=square, args=(x,))
    child.start()
    child.join()
    return child.exitcode


def call_sys_exit(x: int) -> int:
    import sys

    sys.exit(x)


def full_arrays(n: int) -> list[np.ndarray]:
    """``n`` arrays of 400 KB (they cross through shared memory), array ``i`` full of ``i``."""
    return [np.full(100_000, i, dtype=np.float32) for i in range(n)]


def wait_until(condition: Any, within: float = 10.0) -> bool:
    """Whether ``condition()`` turns true within ``within`` seconds (polled)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Gated:
    """Yields 0 at once, then 1 and 2 once the file ``path`` exists (within a minute)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __iter__(self) -> Iterator[int]:
        yield 0
        wait_until(lambda: os.path.exists(self.path), within=60.0)
        yield 1
        yield 2


def where_it_ran(x: int) -> tuple[int, int, int, str]:
    """``x * x`` with where it was computed: pid, parent pid, thread name."""
    return x * x, os.getpid(), os.getppid(), threading.current_thread().name


def live_threads() -> set[threading.Thread]:
    """The threads alive now, but queue feeder threads (a closed queue's leaves on its own)."""
    return {t for t in threading.enumerate() if t.is_alive() and t.name != "QueueFeederThread"}


def assert_nothing_left(threads: set[threading.Thread], segments: set[str]) -> None:
    """No thread beyond ``threads``, child process, zombie or segment beyond ``segments``.

    A thread that ends on its own (the ``feedline-unmap`` thread, idle) has 2 s to go.
    """
    import multiprocessing

    from .._system import own_segments, zombies

    assert multiprocessing.active_children() == []
    assert zombies() == []
    assert own_segments() == segments
    wait_until(lambda: not live_threads() - threads, within=2.0)
    left = sorted(t.name for t in live_threads() - threads)
    assert not left, f"threads left: {left}"


def holds_the_gil(x: int) -> tuple[int, int]:
    """``x`` and the pid that computed it, after a millisecond of pure Python (it holds the
    GIL throughout, so threads take turns)."""
    end = time.perf_counter() + 0.001
    while time.perf_counter() < end:
        pass
    return x, os.getpid()


def waits(x: int) -> int:
    """``x``, after 20 ms of sleep (off the cores, the GIL released: a GET's wait)."""
    time.sleep(0.02)
    return x


class Unlucky(Exception):
    """What :func:`holds_the_gil_unless_seven` raises."""


def holds_the_gil_unless_seven(x: int) -> tuple[int, int]:
    """:func:`holds_the_gil`, raising :class:`Unlucky` for every ``x`` that ends in 7."""
    if x % 10 == 7:
        raise Unlucky(f"{x} ends in 7")
    return holds_the_gil(x)


def holds_the_gil_on_bytes(view: memoryview) -> tuple[int, int]:
    """:func:`holds_the_gil` on the first byte of ``view`` (a memoryview does not pickle)."""
    return holds_the_gil(view[0])


def processes_gone(segments: set[str] | None = None) -> None:
    """Wait (10 s at most) for this process's children to end; then assert that none is left,
    no zombie, and (given the segments there were before) no new shared-memory segment."""
    import gc
    import multiprocessing

    from .._system import own_segments, zombies

    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        gc.collect()  # the pipeline's threads may hold it a moment after the epoch
        time.sleep(0.05)
    assert multiprocessing.active_children() == []
    assert zombies() == []
    if segments is not None:
        assert own_segments() <= segments
