"""Worker processes beside threads a fork cannot copy: a native runtime, live queue feeders."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from feedline import DataLoader  # noqa: E402
from feedline._proc.forking import fork_hazards  # noqa: E402

from .._system import starts_processes, zombies  # noqa: E402
from ._procs import alone, no_children_left  # noqa: E402

pytestmark = starts_processes

_SCRIPT = """
import sys, threading, time
import feedline, torch
from feedline import RemoteStore
from feedline._proc.forking import fork_hazards

class Reads(torch.utils.data.Dataset):
    def __init__(self, store, keys):
        self.store, self.keys = store, keys
    def __len__(self):
        return len(self.keys)
    def __getitem__(self, i):
        return int(bytes(self.store.read_sync(self.keys[i])))

if __name__ == "__main__":
    store = RemoteStore(sys.argv[1])
    keys = sorted(store.keys())
    got = []  # read on a thread of its own: on this one, read_sync leaves one for a moment
    reader = threading.Thread(target=lambda: got.append(bytes(store.read_sync(keys[0]))))
    reader.start()
    reader.join()
    assert int(got[0]) == 0  # obstore's runtime starts its threads
    deadline = time.monotonic() + 10
    while not fork_hazards() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("python threads", threading.active_count(), "hazards", fork_hazards(), flush=True)
    loader = feedline.DataLoader(Reads(store, keys), batch_size=4, num_workers=2, timeout=60)
    it = iter(loader)
    got = [next(it).tolist()]
    kinds = {type(w._child.process._popen).__module__ for w in loader._workers._workers}
    got += [b.tolist() for b in it]
    print("kinds", sorted(kinds), flush=True)
    print("batches", got, flush=True)
"""


def test_fork_hazards_name_native_threads_python_does_not_see(tmp_path: Path) -> None:
    pytest.importorskip("obstore")
    code = textwrap.dedent(
        """
        import sys, threading, time
        from feedline import RemoteStore
        from feedline._proc.forking import fork_hazards
        store = RemoteStore(sys.argv[1])
        before = fork_hazards()
        reader = threading.Thread(target=store.read_sync, args=("a",))
        reader.start()  # (on the main thread, read_sync leaves a thread for a moment)
        reader.join()
        deadline = time.monotonic() + 10
        while not fork_hazards() and time.monotonic() < deadline:
            time.sleep(0.01)
        print(before, threading.active_count(), fork_hazards())
        """
    )
    (tmp_path / "a").write_bytes(b"x")
    out = subprocess.run(
        [sys.executable, "-c", code, f"file://{tmp_path}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    before, count, after = out.split(" ", 2)
    assert before == "[]"
    assert count == "1"  # Python sees no other thread...
    assert "native thread 'tokio" in after  # ...the kernel does


def test_python_threads_are_hazards_and_queue_feeders_are_not() -> None:
    alone()
    assert fork_hazards() == []
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="busy")
    other.start()
    try:
        assert fork_hazards() == ["Python thread 'busy'"]
    finally:
        stop.set()
        other.join()
    import multiprocessing

    q = multiprocessing.get_context("fork").Queue()
    q.put(1)  # starts its feeder thread
    assert any(t.name == "QueueFeederThread" for t in threading.enumerate())
    assert fork_hazards() == []
    assert q.get(timeout=5) == 1
    q.close()
    q.join_thread()


def test_workers_start_beside_a_native_runtime_instead_of_hanging(tmp_path: Path) -> None:
    # The parent read from a RemoteStore: obstore's runtime threads run, which Python does
    # not see. A forked worker would inherit the runtime without them and wait for ever at
    # its first read; the workers start with the fork server and read.
    pytest.importorskip("obstore")
    data = tmp_path / "data"
    data.mkdir()
    for i in range(10):
        (data / f"{i:02d}").write_bytes(str(i).encode())
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), f"file://{data}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines["python"].startswith("threads 1 ")
    assert "tokio" in lines["python"]
    assert lines["kinds"] == "['multiprocessing.popen_forkserver']"
    assert lines["batches"] == "[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]"


def _local_init(worker_id: int) -> None:
    del worker_id


def test_live_persistent_workers_do_not_push_the_next_loader_off_fork() -> None:
    # The first loader's workers live on, and its queues' feeder threads with them; the
    # second loader still forks (as PyTorch's would), so a local function needs no pickle.
    alone()
    first = DataLoader(list(range(64)), batch_size=2, num_workers=2, persistent_workers=True)
    assert len(list(first)) == 32
    assert any(t.name == "QueueFeederThread" for t in threading.enumerate())

    def init(worker_id: int) -> None:  # local: it cannot be pickled
        _local_init(worker_id)

    second = DataLoader(list(range(8)), batch_size=2, num_workers=2, worker_init_fn=init)
    assert [b.tolist() for b in second] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    first.close()
    no_children_left()
    deadline = time.monotonic() + 5
    while zombies() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert zombies() == []


def _make_a_segment() -> None:
    import numpy as np

    from feedline._proc.shm import shared_empty

    array = shared_empty((1000,), np.uint8)  # registered with the resource tracker
    del array


def test_a_child_forked_while_a_thread_holds_the_resource_tracker_s_lock_makes_segments() -> None:
    # A garbage collection in a queue's feeder thread that finalizes a semaphore, a reader
    # that unregisters a segment: another thread may hold multiprocessing's resource tracker
    # lock as the fork happens. A worker's first batch registers a segment with the tracker:
    # with the lock as the fork left it, it waited for ever (a DataLoader beside other work
    # stalled so until its 300 s timeout, a worker's stack in ensure_running).
    import multiprocessing
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    tracker.ensure_running()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with tracker._lock:  # type: ignore[attr-defined]
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        child = multiprocessing.get_context("fork").Process(target=_make_a_segment)
        child.start()
        child.join(30)
        if child.exitcode is None:
            child.kill()
            child.join()
            pytest.fail("the child waited for the lock the fork copied")
    finally:
        release.set()
        holder.join()
    assert child.exitcode == 0


_START_METHOD_SCRIPT = """
import multiprocessing, os, sys
import torch
import feedline

PARENT = os.getpid()


class WhereFrom(torch.utils.data.Dataset):
    # Each item: whether the worker was forked (it still has the value set after import).
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return sys.modules["__main__"].MARK


MARK = "as imported"

if __name__ == "__main__":
    multiprocessing.set_start_method(sys.argv[1], force=True)
    MARK = "set by the parent"  # a forked worker has it; a started one imports this file
    for name, cls in (("torch", torch.utils.data.DataLoader), ("feedline", feedline.DataLoader)):
        batch = next(iter(cls(WhereFrom(), batch_size=2, num_workers=1, collate_fn=list)))
        print(name, batch[0], flush=True)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_start_method_set_for_the_program_is_used_as_pytorch_uses_it(
    tmp_path: Path, method: str
) -> None:
    script = tmp_path / "start_method.py"
    script.write_text(_START_METHOD_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), method], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["torch as imported", "feedline as imported"], out.stdout
