from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest

from feedline import ConfigurationError
from feedline.io import BufferPool


def test_acquire_gives_aligned_writable_arrays_of_the_shape() -> None:
    pool = BufferPool((4, 6, 5, 3), np.float32, count=2)
    batch = pool.acquire()
    assert batch.shape == (4, 6, 5, 3)
    assert batch.dtype == np.float32
    assert batch.flags.writeable
    assert batch.flags.c_contiguous
    assert batch.ctypes.data % 64 == 0
    assert not pool.pinned


def test_pool_is_bounded_and_reuses_memory() -> None:
    pool = BufferPool((2, 3), count=2)
    a = pool.acquire()
    b = pool.acquire()
    assert a.ctypes.data != b.ctypes.data
    with pytest.raises(TimeoutError, match="still in use"):
        pool.acquire(timeout=0.01)
    address = a.ctypes.data
    del a
    c = pool.acquire(timeout=1)
    assert c.ctypes.data == address
    del b, c


def test_memory_stays_flat_over_an_epoch() -> None:
    pool = BufferPool((8, 16, 16, 3), count=3)
    addresses = set()
    for _ in range(500):
        batch = pool.acquire(timeout=1)
        batch[...] = 1
        addresses.add(batch.ctypes.data)
        del batch
    assert len(addresses) <= 3
    assert pool.free == 3
    assert pool.acquired == 500


def test_a_view_keeps_its_buffer_out_of_the_pool() -> None:
    pool = BufferPool((4, 10), count=1)
    batch = pool.acquire()
    first_row = batch[0]  # NumPy points this view past `batch`, at the memory's owner
    sample = batch[1:3].T
    del batch
    gc.collect()
    assert pool.free == 0, "the buffer was recycled while views of it were alive"
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.01)
    del first_row
    assert pool.free == 0
    del sample
    assert pool.free == 1


def test_slots_filled_from_many_threads() -> None:
    pool = BufferPool((16, 32, 32, 3), count=2)
    batch = pool.acquire()

    def fill(i: int) -> None:
        batch[i] = i  # each thread writes its own slot, nothing else

    threads = [threading.Thread(target=fill, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(16):
        assert (batch[i] == i).all()


def test_acquire_waits_for_a_release_from_another_thread() -> None:
    pool = BufferPool((2,), count=1)
    held = [pool.acquire()]
    threading.Timer(0.05, held.clear).start()
    again = pool.acquire(timeout=5)
    assert again.shape == (2,)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigurationError, match="count must be"):
        BufferPool((2, 2), count=0)
    with pytest.raises(ConfigurationError, match="negative"):
        BufferPool((2, -1))
    with pytest.raises(ConfigurationError, match="numeric dtype"):
        BufferPool((2,), dtype=object)
    with pytest.raises(ConfigurationError, match="pin_memory=True needs PyTorch with CUDA"):
        BufferPool((2,), pin_memory=True)
    for dtype in ("U0", "V0"):
        with pytest.raises(ConfigurationError, match="fixed size"):
            BufferPool((2,), dtype=dtype)
    for shape in ((2.7, 3), "abc", 5):
        with pytest.raises(ConfigurationError, match="tuple of ints"):
            BufferPool(shape)  # type: ignore[arg-type]
    # Sizes whose product wraps in 64 bits (to 0, or to something allocatable) are refused.
    for shape in ((2**32, 2**32), (2**31 + 1, 2**33), (2**62, 4)):
        with pytest.raises(ConfigurationError, match="more bytes than this machine"):
            BufferPool(shape)


def test_a_batch_collected_on_the_thread_that_holds_the_pool_goes_back() -> None:
    # A garbage collection that runs while acquire() holds the pool's lock (an allocation
    # there) may free a batch held in a cycle: its finalizer gives it back on this very thread.
    pool = BufferPool((4,), count=1)
    cycle: list[Any] = [pool.acquire()]
    cycle.append(cycle)
    done = threading.Event()

    def collect_under_the_lock() -> None:
        with pool._cond:
            del cycle[:]  # the batch goes now, its finalizer on this thread, the lock held
            gc.collect()
        done.set()

    thread = threading.Thread(target=collect_under_the_lock, daemon=True)
    thread.start()
    assert done.wait(10), "the finalizer waited for the lock its own thread held"
    assert pool.free == 1


def test_empty_shape_is_allowed() -> None:
    pool = BufferPool((0, 3), count=1)
    assert pool.acquire().shape == (0, 3)
