"""Arrays received through shared memory are unmapped on the unmap thread, not the dropper's."""

from __future__ import annotations

import gc
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feedline._proc.forking import fork_hazards
from feedline._proc.shm import SHM_AVAILABLE, pack, shared_empty, unpack
from feedline._proc.unmap import IDLE_SECONDS, MOST_QUEUED, THREAD_NAME, hand_over

from .._system import own_segments, zombies
from ..pipeline._helpers import wait_until

pytestmark = pytest.mark.skipif(not SHM_AVAILABLE, reason="needs /dev/shm")


class _Blocker:
    """Handed to the unmap thread as if it were a mapping: closing it waits for ``go``."""

    def __init__(self, go: threading.Event) -> None:
        self.go = go
        self.closing = threading.Event()

    def close(self) -> None:
        self.closing.set()
        self.go.wait(30.0)


def _block_the_thread() -> threading.Event:
    # The unmap thread, busy with a "mapping" that is dropped only once the event is set.
    gc.collect()  # arrays other tests left in cycles: not queued meanwhile
    go = threading.Event()
    carrier, blocker = np.zeros(1), _Blocker(go)
    hand_over(carrier, blocker)
    del carrier
    assert blocker.closing.wait(10.0)  # taken from the queue: the thread is busy with it
    return go


def _unmap_threads() -> int:
    return sum(t.name == THREAD_NAME for t in threading.enumerate())


def _mapped(name: str) -> bool:
    # Whether this process maps the segment ``name`` (removed already: "(deleted)").
    return name in Path("/proc/self/maps").read_text()


def _received(shape: tuple[int, ...]) -> tuple[str, np.ndarray[Any, Any]]:
    # An array as a child's would arrive: its segment's name, and the view unpack returns.
    before = own_segments()
    sent = shared_empty(shape, np.uint8)
    sent[...] = 3
    (name,) = own_segments() - before
    packed = pack(sent, min_bytes=1)
    del sent
    return name, unpack(packed)


def test_an_array_dropped_here_is_unmapped_by_the_unmap_thread() -> None:
    go = _block_the_thread()
    try:
        name, array = _received((256, 1024))
        view = array[10:20]  # a view keeps the mapping
        del array
        assert _mapped(name)
        assert int(view.sum()) == 3 * 10 * 1024
        del view  # the last view: the mapping is queued, not unmapped on this thread
        assert _mapped(name)
    finally:
        go.set()
    assert wait_until(lambda: not _mapped(name))


def test_past_the_most_queued_the_dropping_thread_unmaps_its_own() -> None:
    # Memory stays bounded when the thread falls behind: here it is held busy.
    go = _block_the_thread()
    try:
        received = [_received((16, 4096)) for _ in range(MOST_QUEUED + 1)]
        names = [name for name, _ in received]
        while received:  # dropped in order (the list held the only views)
            del received[0]
        assert all(_mapped(name) for name in names[:MOST_QUEUED])  # queued
        assert not _mapped(names[MOST_QUEUED])  # unmapped as it was dropped
    finally:
        go.set()
    assert wait_until(lambda: not any(_mapped(name) for name in names))


def test_the_thread_ends_when_idle_and_a_new_mapping_starts_it_again() -> None:
    name, array = _received((64, 1024))
    del array
    assert wait_until(lambda: not _mapped(name))
    assert wait_until(lambda: _unmap_threads() == 0, within=IDLE_SECONDS + 10.0)
    name, array = _received((64, 1024))
    del array
    assert wait_until(lambda: not _mapped(name))
    assert wait_until(lambda: _unmap_threads() == 0, within=IDLE_SECONDS + 10.0)


def _in_child(queued: list[str], results: Any) -> None:
    # In a child forked while the parent's unmap thread was busy and had ``queued`` mappings
    # waiting: they are gone here, and what the child receives goes on a thread of its own.
    gone = not any(_mapped(name) for name in queued)
    name, array = _received((64, 1024))
    started = _unmap_threads() == 1
    del array
    results.put((gone, started, wait_until(lambda: not _mapped(name))))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_fork_beside_the_busy_thread_is_safe_and_the_child_drops_what_it_queued() -> None:
    segments = own_segments()
    go = _block_the_thread()
    try:
        received = [_received((64, 1024)) for _ in range(3)]
        queued = [name for name, _ in received]
        del received
        assert all(_mapped(name) for name in queued)
        assert not any(THREAD_NAME in hazard for hazard in fork_hazards())
        context = multiprocessing.get_context("fork")
        results = context.SimpleQueue()
        child = context.Process(target=_in_child, args=(queued, results))
        child.start()
        child.join(30.0)
        assert child.exitcode == 0
        assert results.get() == (True, True, True)
    finally:
        go.set()
    assert wait_until(lambda: not any(_mapped(name) for name in queued))
    assert wait_until(lambda: _unmap_threads() == 0, within=IDLE_SECONDS + 10.0)
    assert multiprocessing.active_children() == []
    assert zombies() == []
    assert own_segments() <= segments  # the child's and the parent's segments are all gone
