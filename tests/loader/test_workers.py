"""Worker processes: they start together, stop at Ctrl-C, and fail as PyTorch's do."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader as TorchLoader  # noqa: E402

from feedline import DataLoader, SubprocessDied  # noqa: E402

from .._system import own_segments, starts_processes  # noqa: E402
from .._system import zombies as _zombies  # noqa: E402
from ._datasets import (  # noqa: E402
    Kinds,
    Pictures,
    Rendezvous,
    Sleepy,
    Suicidal,
    failing_collate,
    failing_init,
    worker_pid_collate,
)
from ._procs import alone, no_children_left, only_this_thread  # noqa: E402

pytestmark = starts_processes


@pytest.mark.parametrize("cls", [TorchLoader, DataLoader])
def test_all_workers_start_at_once(cls: Any) -> None:
    # Each worker's first item waits for the others': workers started one after another
    # (each once the one before delivered) would never meet.
    barrier = multiprocessing.get_context("forkserver").Barrier(3)
    loader = cls(
        Rendezvous(9, barrier), batch_size=1, num_workers=3, multiprocessing_context="forkserver"
    )
    assert [b.item() for b in loader] == list(range(9))
    no_children_left()


def test_ctrl_c_while_workers_are_busy_reaches_the_caller_at_once() -> None:
    loader = DataLoader(Sleepy(8, {i: 30.0 for i in range(8)}), batch_size=2, num_workers=2)
    it = iter(loader)
    # Ctrl-C: SIGINT to the main thread, as a terminal's reaches it.
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        next(it)
    waited = time.monotonic() - started
    timer.join()
    assert waited < 5.0, f"KeyboardInterrupt came after {waited:.1f} s"
    no_children_left()  # the workers are gone when it does
    del it
    loader.close()


class _Stuck(torch.utils.data.Dataset[int]):
    """Item ``i`` is ``i``, but item 3 waits for ``release`` (a read without a timeout)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        if i == 3:
            self.release.wait(20)
        return i


def test_ctrl_c_on_threads_leaves_a_call_that_never_returns_after_a_moment(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # As PyTorch's loop without workers, whose __getitem__ runs on the main thread: the
    # KeyboardInterrupt reaches the caller's except block at once, not once the call returns.
    from feedline._grace import STOP_GRACE

    dataset = _Stuck()
    loader = DataLoader(dataset, batch_size=4)
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    started = time.monotonic()
    with caplog.at_level("WARNING", "feedline.loader"), pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    waited = time.monotonic() - started
    timer.join()
    dataset.release.set()
    assert waited < 0.5 + 2 * STOP_GRACE + 2, f"KeyboardInterrupt came after {waited:.1f} s"
    assert "still inside dataset calls after 1 s are left running" in caplog.text
    state = loader.state_dict()  # the checkpoint an except block saves
    assert state["batches_yielded"] == 0
    assert not state["finished"]
    loader.close()
    only_this_thread()


def test_ctrl_c_in_the_loop_body_leaves_a_call_that_never_returns_after_a_moment() -> None:
    # Most of a loop's time is its body (the training step): a KeyboardInterrupt raised there
    # closes the iterator as it unwinds the loop, before any except block holds it.
    from feedline._grace import STOP_GRACE

    dataset = _Stuck()
    loader = DataLoader(dataset, batch_size=2)
    main = threading.main_thread().ident
    assert main is not None
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:  # batch 0; batch 1 (items 2, 3) waits on item 3 meanwhile
            timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
            timer.start()
            time.sleep(5)  # the training step, where the Ctrl-C comes
    waited = time.monotonic() - started
    timer.join()
    dataset.release.set()
    assert waited < 0.3 + 2 * STOP_GRACE + 2, f"KeyboardInterrupt came after {waited:.1f} s"
    only_this_thread()


def _end_pytorchs_workers(it: Any) -> None:
    """End the workers of PyTorch's iterator ``it`` that raised: not what the tests are about.

    The exception's traceback holds the iterator in a reference cycle, and its workers live
    until a collection ends it; ended by a collection, its shutdown waited its 5 s for each
    worker here (the workers never heard that they should stop).
    """
    it._shutdown_workers()
    no_children_left()


def test_a_worker_killed_by_a_signal_raises_runtime_error_naming_it() -> None:
    for cls in (TorchLoader, DataLoader):
        it = iter(cls(Suicidal(8, 5), batch_size=2, num_workers=2))
        with pytest.raises(RuntimeError) as info:
            list(it)
        if cls is TorchLoader:
            # Ended by a collection instead, PyTorch's iterator once left its other worker
            # running (a run of two pytest-xdist workers), failing every later test here,
            # and its SIGCHLD handler raised in another test's teardown.
            _end_pytorchs_workers(it)
        del it
    assert isinstance(info.value, SubprocessDied)
    message = str(info.value)
    assert "DataLoader worker 0" in message
    assert "SIGKILL" in message
    assert f"pid {info.value.pid}" in message
    gc.collect()  # what the last traceback holds, collected now rather than when the GC runs
    no_children_left()


def test_worker_init_fn_exception_is_raised_as_it_is() -> None:
    for cls in (TorchLoader, DataLoader):
        loader = cls(list(range(4)), batch_size=2, num_workers=2, worker_init_fn=failing_init)
        it = iter(loader)
        with pytest.raises(LookupError, match="no shard for worker"):
            list(it)
        if cls is TorchLoader:
            _end_pytorchs_workers(it)
        del it
    no_children_left()  # feedline's: ended when the error was raised


def test_close_mid_epoch_returns_at_once_and_leaves_nothing() -> None:
    before = own_segments()
    loader = DataLoader(
        Sleepy(8, {i: 30.0 for i in range(2, 8)}),
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
    )
    it = iter(loader)
    next(it)
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 2.0
    no_children_left()
    assert own_segments() - before == set()
    with pytest.raises(StopIteration):
        next(it)


def test_break_with_busy_non_persistent_workers_does_not_wait_for_them() -> None:
    loader = DataLoader(Sleepy(8, {i: 30.0 for i in range(2, 8)}), batch_size=1, num_workers=2)
    started = time.monotonic()
    for _ in loader:
        break
    assert time.monotonic() - started < 10.0
    no_children_left()


class _HoldsALambda(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.transform = lambda x: x * 2

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return int(self.transform(i))


def test_a_dataset_that_cannot_be_pickled_works_forked_and_is_named_otherwise() -> None:
    # Forked workers (the default when no other thread runs, as PyTorch forks) need no pickle.
    alone()
    for cls in (TorchLoader, DataLoader):
        assert [b.tolist() for b in cls(_HoldsALambda(), batch_size=2, num_workers=2)] == [
            [0, 2],
            [4, 6],
        ]
        no_children_left()
        alone()  # PyTorch's loader leaves its queue feeders ending
    loader = DataLoader(
        _HoldsALambda(), batch_size=2, num_workers=2, multiprocessing_context="forkserver"
    )
    with pytest.raises(ValueError, match=r"attribute 'transform' \(function\).*num_workers=0"):
        list(loader)
    no_children_left()


@pytest.mark.parametrize("context", ["fork", None])
def test_workers_fork_only_while_no_other_thread_runs(context: Any) -> None:
    def start_method(loader: DataLoader[Any]) -> set[str]:
        it = iter(loader)
        assert next(it).tolist() == [0, 1]
        workers = loader._workers
        assert workers is not None
        found = {type(w._child.process._popen).__module__ for w in workers._workers}
        del it
        loader.close()
        return found

    def make() -> DataLoader[Any]:
        return DataLoader(
            list(range(8)), batch_size=2, num_workers=2, multiprocessing_context=context
        )

    alone()
    assert start_method(make()) == {"multiprocessing.popen_fork"}
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert start_method(make()) == {"multiprocessing.popen_forkserver"}
    finally:
        stop.set()
        other.join()
    no_children_left()


def test_first_hands_too_large_to_write_at_once_still_fork_every_worker() -> None:
    # Each worker is started and given its first batches before the next one forks. A hand
    # larger than an empty pipe takes without blocking goes through the queue's feeder
    # thread: it is put only once every worker has forked, so no fork sees a thread.
    alone()
    segments = own_segments()
    dataset = list(range(3 * 3 * 8192))
    loader = DataLoader(dataset, batch_size=8192, num_workers=3)
    reference = TorchLoader(dataset, batch_size=8192, num_workers=0)
    it = iter(loader)
    got = [next(it)]
    workers = loader._workers
    assert workers is not None
    kinds = {type(w._child.process._popen).__module__ for w in workers._workers}
    assert kinds == {"multiprocessing.popen_fork"}
    got += list(it)
    assert len(got) == len(reference) == 9
    for a, b in zip(got, reference, strict=True):
        assert torch.equal(a, b)
    loader.close()
    no_children_left()
    assert _zombies() == []
    assert own_segments() <= segments  # nothing left in /dev/shm
    only_this_thread()


def test_batches_are_collated_in_the_workers_as_in_pytorch() -> None:
    for cls in (TorchLoader, DataLoader):
        loader = cls(list(range(8)), batch_size=4, num_workers=2, collate_fn=worker_pid_collate)
        batches = list(loader)
        assert [b.tolist() for b, _ in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert all(pid != os.getpid() for _, pid in batches)
    no_children_left()


def test_a_collate_fn_exception_in_a_worker_is_raised_as_it_is() -> None:
    for cls in (TorchLoader, DataLoader):
        loader = cls(list(range(8)), batch_size=4, num_workers=2, collate_fn=failing_collate)
        it = iter(loader)
        with pytest.raises(KeyError, match="label") as info:
            list(it)
        # PyTorch's iterator ends its workers when it is collected, which a reference held
        # by the raised exception's traceback can put off: end them here.
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del it
    notes = "\n".join(info.value.__notes__)
    assert "collate_fn on batch 0 in DataLoader worker 0" in notes
    no_children_left()


class TwoArgumentError(Exception):
    """An exception whose class cannot be rebuilt from its pickle (two required arguments)."""

    def __init__(self, path: str, code: int) -> None:
        super().__init__(f"{path}: code {code}")


class RaisesTwoArgumentError:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        if i == 9:
            raise TwoArgumentError("train/9.jpg", 5)
        return i


def test_an_exception_that_cannot_cross_processes_comes_as_pytorchs_runtime_error() -> None:
    # PyTorch re-raises what it cannot rebuild as a RuntimeError; so does feedline, with the
    # original type, message, index and traceback (never a TypeError about its __init__).
    segments, threads = own_segments(), threading.active_count()
    for cls in (TorchLoader, DataLoader):
        with pytest.raises(RuntimeError, match="TwoArgumentError") as info:
            list(cls(RaisesTwoArgumentError(), batch_size=4, num_workers=2))
        assert "train/9.jpg: code 5" in str(info.value)
    notes = "\n".join(info.value.__notes__)
    assert "raised by dataset[9] in DataLoader worker" in notes
    assert "Traceback" in notes
    no_children_left()
    assert own_segments() - segments == set()
    deadline = time.monotonic() + 5  # PyTorch's queue feeders take a moment to end
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads


def test_default_collation_in_workers_gives_pytorchs_batches_for_every_kind() -> None:
    # The workers stack tensors straight into shared memory: the same values, dtypes and
    # structure as PyTorch's, nothing left in /dev/shm, and the same error for ragged items.
    def batches(cls: Any) -> list[Any]:
        return list(cls(Kinds(10), batch_size=4, num_workers=2))

    def flat(batch: Any) -> Any:
        if isinstance(batch, dict):
            return {k: flat(v) for k, v in batch.items()}
        if isinstance(batch, list | tuple):
            return [flat(v) for v in batch]
        if isinstance(batch, torch.Tensor):
            return (str(batch.dtype), tuple(batch.shape), batch.float().tolist())
        return batch

    before = own_segments()
    ours, theirs = batches(DataLoader), batches(TorchLoader)
    assert [flat(b) for b in ours] == [flat(b) for b in theirs]
    del ours
    no_children_left()
    assert own_segments() - before == set()
    for cls in (TorchLoader, DataLoader):
        it = iter(cls(Kinds(8, ragged=True), batch_size=4, num_workers=2))
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
            list(it)
        if cls is TorchLoader:
            _end_pytorchs_workers(it)
        del it
    gc.collect()
    no_children_left()


def test_feedlines_decoder_keeps_opencv_on_the_calling_thread() -> None:
    # OpenCV's own thread pool, busy in this process at a fork, can leave a worker's copy of
    # its lock held: the worker's first blur or resize then waits for good (seen: 2 hangs in
    # 60 forks right after decoding on threads). feedline's decoder runs each OpenCV call on
    # its calling thread, so that its own calls never put that pool to work.
    cv2 = pytest.importorskip("cv2")
    pictures = Pictures(64)
    assert sum(b.shape[0] for b in DataLoader(pictures, batch_size=16)) == 64
    assert cv2.getNumThreads() == 1
    loader = DataLoader(pictures, batch_size=16, num_workers=2, timeout=60)
    assert next(iter(loader)).shape == (16, 224, 224, 3)
    loader.close()
    no_children_left()


def test_a_main_script_without_a_guard_is_named_as_the_cause(tmp_path: Any) -> None:
    # Under the fork server, a worker imports the main script again; one that iterates a
    # loader at import time makes the worker fail as it starts. The error says what to do.
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import feedline\n"
        "loader = feedline.DataLoader(list(range(8)), batch_size=4, num_workers=1,\n"
        "                             multiprocessing_context='forkserver')\n"
        "if __name__ != '__main__':  # the worker, importing this script again\n"
        "    list(loader)\n"
        "else:\n"
        "    try:\n"
        "        list(loader)\n"
        "    except RuntimeError as error:\n"
        "        print('CAUGHT', type(error).__name__, error)\n"
    )
    segments = own_segments()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert own_segments() - segments == set()  # the failed start left no shared memory
    no_children_left()
    caught = [line for line in done.stdout.splitlines() if line.startswith("CAUGHT")]
    assert caught, done.stdout + done.stderr
    assert "SubprocessDied" in caught[0]
    assert "if __name__ == '__main__':" in caught[0]


_KEEPS_BATCHES = """
import resource, sys
import torch
from torch.utils.data import IterableDataset
import feedline


class Random(IterableDataset):
    def __iter__(self):
        return (torch.randn(2, 2) for _ in range(200))


if __name__ == "__main__":
    cls = torch.utils.data.DataLoader if sys.argv[1] == "torch" else feedline.DataLoader
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
    kept = []
    try:
        for batch in cls(Random(), num_workers=1, multiprocessing_context="fork"):
            kept.append(batch)
    except RuntimeError as error:
        print("raised", "ulimit -n" in str(error))
    print("kept", len(kept))
"""


def test_batches_kept_from_a_worker_hold_no_file_descriptors(tmp_path: Any) -> None:
    # PyTorch's test_fd_limit_exceeded: 200 batches kept under a limit of 100 open files.
    # PyTorch's default sharing holds a descriptor per batch and raises, naming `ulimit -n`;
    # feedline's batches hold none (see the loader README's differences).
    import subprocess
    import sys

    script = tmp_path / "keeps.py"
    script.write_text(_KEEPS_BATCHES)

    def run(which: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, str(script), which], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    segments = own_segments()
    theirs = run("torch")
    assert theirs[:2] == ["raised", "True"]
    assert int(theirs[-1]) < 200
    assert run("feedline") == ["kept", "200"]
    no_children_left()
    assert _zombies() == []
    assert own_segments() <= segments
