"""Arrays made in shared memory from the start: sent uncopied, removed if never sent."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import numpy as np
import pytest

from feedline._proc.shm import SHM_AVAILABLE, ShmArray, pack, shared_empty, unpack

from .._system import own_segments

pytestmark = pytest.mark.skipif(not SHM_AVAILABLE, reason="needs /dev/shm")


def test_an_array_made_in_shared_memory_is_sent_as_its_segment() -> None:
    before = own_segments()
    array = shared_empty((4, 3), np.float32)
    array[...] = np.arange(12, dtype=np.float32).reshape(4, 3)
    (made,) = own_segments() - before
    packed: Any = pack({"x": array, "small": np.zeros(2)}, min_bytes=1 << 30)
    # Sent as it is, whatever the threshold: the segment it lives in, not a copy.
    assert isinstance(packed["x"], ShmArray)
    assert packed["x"].name == made
    assert isinstance(packed["small"], np.ndarray)
    array[0, 0] = 100.0  # the receiver maps the very same memory
    received = unpack(packed)
    assert received["x"][0, 0] == 100.0
    assert received["x"].tolist() == [[100.0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert own_segments() - before == set()  # unlinked by the receiver once mapped
    del array
    gc.collect()
    assert own_segments() - before == set()


def test_a_segment_never_sent_is_removed_with_its_array() -> None:
    before = own_segments()
    array = shared_empty((1000,), np.uint8)
    assert len(own_segments() - before) == 1
    del array
    assert own_segments() - before == set()


def test_only_the_whole_array_is_sent_uncopied_and_only_once() -> None:
    before = own_segments()
    array = shared_empty((8, 8), np.int64)
    array[...] = 7
    part: Any = pack(array[2:4], min_bytes=1 << 30)  # a slice is not the segment: by value
    assert isinstance(part, np.ndarray)
    first: Any = pack(array, min_bytes=1 << 30)
    assert isinstance(first, ShmArray)
    again: Any = pack(array, min_bytes=1 << 30)  # sent already: a second send copies
    assert isinstance(again, np.ndarray)
    assert unpack(first).sum() == 7 * 64
    del array
    gc.collect()
    assert own_segments() - before == set()


def test_an_address_reused_after_an_array_died_is_not_taken_for_it() -> None:
    before = own_segments()
    for _ in range(50):
        array = shared_empty((256,), np.float64)
        del array
    plain = np.ones(256)
    assert isinstance(pack(plain, min_bytes=1 << 30), np.ndarray)
    assert own_segments() - before == set()


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_arrays_made_or_received_and_kept_hold_no_file_descriptor() -> None:
    # A program may keep many batches from its workers (a cache, a list of results): each
    # mapping used to hold a descriptor until its array went, and a few hundred batches ran
    # into the open-files limit (PyTorch's test_fd_limit_exceeded keeps 200 under 100).
    before_all = own_segments()
    warm = shared_empty((1,), np.uint8)  # the first may start the resource tracker (a pipe)
    before = _open_descriptors()
    made = [shared_empty((256,), np.float32) for _ in range(50)]
    for i, array in enumerate(made):
        array[...] = i
    assert _open_descriptors() == before
    received = [unpack(pack(array, min_bytes=1 << 30)) for array in made]
    assert _open_descriptors() == before
    gc.collect()
    time.sleep(0.3)  # whatever the unmap thread was given, it has closed by now
    assert [float(r.sum()) for r in received] == [256.0 * i for i in range(50)]
    del made, received, warm
    gc.collect()
    assert own_segments() - before_all == set()
