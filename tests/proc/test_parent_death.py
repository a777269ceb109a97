"""Process-pool workers, the fork server and the resource tracker end with a killed parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from .._system import starts_processes

pytestmark = starts_processes

_PARENT = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import forkserver, resource_tracker
    import feedline.pipeline

    if __name__ == "__main__":
        method = sys.argv[1]
        init = feedline.pipeline.die_with_parent if sys.argv[2] == "yes" else None
        pool = ProcessPoolExecutor(2, mp_context=mp.get_context(method), initializer=init)
        for _ in range(4):
            pool.submit(os.getpid).result()
        workers = list(pool._processes)  # all it started: one may have had no call to answer
        helpers = [resource_tracker._resource_tracker._pid]
        if method == "forkserver":
            helpers.append(forkserver._forkserver._forkserver_pid)
        print(" ".join(str(p) for p in set(workers) | set(h for h in helpers if h)), flush=True)
        time.sleep(60)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_parent_and_watch(
    method: str, initializer: str, script: str = _PARENT, patience: float = 10.0
) -> list[int]:
    """The pids the parent printed that are still alive ``patience`` s after it was killed
    (or as soon as none is)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", script, method, initializer],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert pids
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + patience
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [p for p in pids if _alive(p)]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_pool_workers_made_with_die_with_parent_end_with_the_parent(method: str) -> None:
    left = _kill_parent_and_watch(method, "yes")
    for pid in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert left == []


def test_without_it_the_workers_outlive_the_parent() -> None:
    # What the initializer is for: this is how Python's own pools behave. Workers made with
    # it end as soon as their parent's sentinel closes; these are still there a second later
    # (and for good: a longer wait shows nothing more).
    left = _kill_parent_and_watch("spawn", "no", patience=1.0)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left != []


_REGION_PARENT = textwrap.dedent(
    """
    import os, time
    from multiprocessing import forkserver
    from feedline import PipelineBuilder
    from tests.pipeline._helpers import pid_and_square

    if __name__ == "__main__":
        pipeline = (
            PipelineBuilder().add_source(range(1000)).pipe_in_processes(pid_and_square, processes=2)
            .add_sink().build()
        )
        pids = set()
        for pid, _ in pipeline:
            pids.add(pid)
            if len(pids) == 2:
                break
        pipeline.start()  # a second epoch, left running when this process is killed
        pids.add(forkserver._forkserver._forkserver_pid)
        print(" ".join(str(p) for p in pids), flush=True)
        time.sleep(60)
    """
)


def test_a_process_regions_workers_end_with_a_killed_parent() -> None:
    left = _kill_parent_and_watch("forkserver", "yes", _REGION_PARENT)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []


_MAKES_SEGMENTS = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, time
    from concurrent.futures import ProcessPoolExecutor
    import numpy as np
    import feedline.pipeline
    from feedline._proc import shm

    kept = []

    def init(prefix):
        shm.set_segment_names(shm.SegmentNames(prefix))
        feedline.pipeline.die_with_parent()

    def make():
        kept.append(shm.shared_empty((1 << 16,), np.uint8))  # made, never sent
        # Half made: created, not yet on the resource tracker's list (a kill's moment).
        os.close(os.open(f"/dev/shm/{shm._names()}", os.O_CREAT | os.O_RDWR, 0o600))
        return os.getpid()

    if __name__ == "__main__":
        prefix = shm.SegmentNames.new_prefix()
        pool = ProcessPoolExecutor(1, mp_context=mp.get_context("fork"), initializer=init,
                                   initargs=(prefix,))
        worker = pool.submit(make).result()
        print(worker, prefix, flush=True)
        time.sleep(60)
    """
)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="shared memory segments in /dev/shm")
def test_a_killed_parents_workers_remove_the_segments_they_made_for_it() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _MAKES_SEGMENTS],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        worker, prefix = parent.stdout.readline().split()
        assert len([n for n in os.listdir("/dev/shm") if n.startswith(prefix)]) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(int(worker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(int(worker))
        time.sleep(0.5)  # and the resource tracker's clean-up, where it does one
        left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
        for name in left:  # not to leave them to the next run
            os.unlink(f"/dev/shm/{name}")
        assert left == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
