from __future__ import annotations

import functools
import mmap
import multiprocessing
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import pytest

from feedline import (
    ConfigurationError,
    PipelineBuilder,
    SubprocessFailure,
    iterate_in_subprocess,
    run_pipeline_in_subprocess,
)
from feedline._proc import mapped

from .._system import own_segments, starts_processes, zombies
from ..loader._procs import no_children_left
from . import _helpers

pytestmark = starts_processes


def test_pipeline_in_subprocess_for_three_epochs() -> None:
    with run_pipeline_in_subprocess(_helpers.square_builder(50), num_threads=2) as it:
        for _ in range(3):
            assert list(it) == [i * i for i in range(50)]


def _root(array: np.ndarray) -> object:
    # What owns the memory: through the arrays and memoryviews that view it.
    base: object = array
    while True:
        if isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        elif isinstance(base, memoryview):
            base = base.obj
        else:
            return base


_MAPPINGS = (mmap.mmap, mapped._Mapping)  # what a received array's memory belongs to


def test_arrays_cross_through_shared_memory() -> None:
    before = own_segments()
    with run_pipeline_in_subprocess(_helpers.array_builder(10)) as it:
        items = sorted(it, key=lambda d: d["index"])  # type: ignore[index]
    assert [d["index"] for d in items] == list(range(10))
    for d in items:
        i = d["index"]
        np.testing.assert_array_equal(d["image"], np.full((64, 64, 3), i % 256, np.uint8))
        np.testing.assert_array_equal(d["big"], np.arange(100_000, dtype=np.float32) + i)
        # the large array views a shared-memory mapping; the small one came as a pickle
        assert isinstance(_root(d["big"]), _MAPPINGS)
        assert not isinstance(_root(d["image"]), _MAPPINGS)
    # every segment was unlinked once mapped: nothing is left in /dev/shm
    assert own_segments() - before == set()


def test_early_break_then_next_epoch() -> None:
    factory = functools.partial(_helpers.make_slow, 100, 0.001)
    with iterate_in_subprocess(factory) as it:
        for i, _ in enumerate(it):
            if i == 3:
                break
        assert list(it) == list(range(100))


def test_a_child_asked_to_leave_is_replaced_by_the_next_epoch() -> None:
    # The child leaves after ask_to_leave(): the next epoch starts a new one, and neither
    # reports the one that left as dead (exit code 0, "a crash") nor yields nothing.
    with iterate_in_subprocess(functools.partial(_helpers.make_slow, 10, 0.001)) as it:
        assert list(it) == list(range(10))
        first = it._child.process
        pid = first.pid
        it.ask_to_leave()
        first.join(10)
        assert first.exitcode == 0
        assert list(it) == list(range(10))
        assert it.pid != pid
    no_children_left()
    assert zombies() == []


def test_error_in_child_pipeline_is_raised() -> None:
    with (
        run_pipeline_in_subprocess(_helpers.failing_builder(10)) as it,
        pytest.raises(SubprocessFailure, match="three is not allowed") as info,
    ):
        list(it)
    # Where it failed travels with it: the child's stage, its count and the sample.
    failure = info.value
    assert failure.stage == "fail_on_three"
    assert failure.num_failures == 1
    assert failure.sample == "3"
    assert isinstance(failure.last_error, ValueError)


def test_factory_error_is_raised() -> None:
    it = iterate_in_subprocess(_helpers.bad_factory)
    with pytest.raises(SubprocessFailure, match="cannot make the iterable"):
        list(it)
    it.close()


def test_child_crash_is_reported() -> None:
    with (
        iterate_in_subprocess(_helpers.make_crashing) as it,
        pytest.raises(SubprocessFailure, match="exit code 7"),
    ):
        list(it)


def test_timeout() -> None:
    # The first item comes at once, the next after 5 s: with a 2 s limit, the wait that
    # times out is the one for the second item, not the child's start-up.
    got: list[int] = []
    stalling = functools.partial(_helpers.Stalling, 5.0)
    with iterate_in_subprocess(stalling, timeout=2.0) as it, pytest.raises(TimeoutError):
        for item in it:
            got.append(item)
    assert got == [0]


def test_unpicklable_factory_is_rejected() -> None:
    with pytest.raises(ConfigurationError, match="module-level"):
        iterate_in_subprocess(lambda: [1, 2])


def test_child_exits_when_parent_dies(tmp_path: object) -> None:
    import subprocess
    import sys

    code = (
        "import functools, os, sys\n"
        "sys.path.insert(0, os.getcwd())\n"
        "from feedline import iterate_in_subprocess\n"
        "from tests.pipeline import _helpers\n"
        "it = iterate_in_subprocess(functools.partial(_helpers.make_slow, 10**6, 0.01))\n"
        "g = iter(it)\n"
        "next(g)\n"
        "print(it._child.process.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=os.getcwd()
    )
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.strip())
    assert _helpers.process_exits(child, within=10), "the child process outlived its parent"


def test_subprocess_iterable_as_pipeline_source() -> None:
    with run_pipeline_in_subprocess(_helpers.square_builder(20)) as src:
        p = PipelineBuilder().add_source(src).aggregate(5).build()
        assert [x for batch in p for x in batch] == [i * i for i in range(20)]


def test_torch_tensors_cross_as_arrays_with_their_values_and_types() -> None:
    torch = pytest.importorskip("torch")
    before = own_segments()
    with iterate_in_subprocess(_helpers.make_tensors) as it:
        small, big, nested, flag = list(it)
    expected = _helpers.make_tensors()
    assert torch.equal(small, expected[0])
    assert small.dtype == torch.int64
    assert torch.equal(big, expected[1])
    # The large one went through shared memory, the small one by value.
    from feedline._proc.shm import ShmArray, TensorRef, pack, release

    packed = pack(expected[:2], 64 * 1024)
    assert isinstance(packed[1], TensorRef)
    assert isinstance(packed[1].array, ShmArray)
    assert not isinstance(packed[0].array, ShmArray)
    release(packed)
    assert torch.equal(nested["t"], expected[2]["t"])
    assert nested["bf"].dtype == torch.bfloat16  # no NumPy dtype: torch's own pickling
    assert nested["n"] == 3
    assert flag.item() is True
    assert own_segments() - before == set()


class _TwoArgumentError(Exception):
    def __init__(self, path: str, code: int) -> None:
        super().__init__(f"{path}: code {code}")


def _raises_two_argument_error() -> Iterator[int]:
    yield 1
    raise _TwoArgumentError("a.bin", 3)


def test_an_exception_that_cannot_be_rebuilt_is_reported_with_its_text() -> None:
    # Unpickling it here would raise a TypeError about its __init__ instead.
    from feedline.pipeline import iterate_in_subprocess
    from tests.loader._procs import no_children_left

    iterable = iterate_in_subprocess(_raises_two_argument_error)
    with pytest.raises(SubprocessFailure, match=r"_TwoArgumentError: a\.bin: code 3") as info:
        list(iterable)
    assert "Traceback" in str(info.value)
    assert info.value.__cause__ is None
    iterable.close()
    no_children_left()  # the child is gone, not left a zombie


def test_a_pipeline_in_a_subprocess_is_tuned_there() -> None:
    # The op waits 10 ms: the tuner in the child raises its concurrency past where it starts
    # (the cores), and each epoch starts where the last one ended.
    with run_pipeline_in_subprocess(_helpers.waiting_builder(600), autotune=True) as it:
        first = list(it)
        second = list(it)
    assert len(first) == len(second) == 600
    cores = os.cpu_count() or 1
    assert max(first) > cores, f"at most {max(first)} calls at once"
    # The second epoch's first calls (before the tuner's first look) run as many at once as
    # the first epoch ended with, not as many as the cores.
    assert max(second[:20]) > cores, second[:20]
    no_children_left()
    assert zombies() == []


def test_a_subprocess_pipelines_budget_is_checked_in_the_parent() -> None:
    with pytest.raises(ConfigurationError, match="memory_budget"):
        run_pipeline_in_subprocess(_helpers.waiting_builder(10), memory_budget=10)


def _started_by(parent: int) -> int:
    # Which process started workers whose parent is ``parent``: ``parent``, or the process
    # that started it where it is a fork server.
    with open(f"/proc/{parent}/stat") as f:
        grandparent = int(f.read().rsplit(")", 1)[1].split()[1])
    return parent if grandparent == os.getpid() else grandparent


def _left_by_itself(it: object) -> int | None:
    # Asks the child to leave and waits for it: its exit code (0: it shut down what it owned
    # by itself, not terminated by close()).
    process = it._child.process  # type: ignore[attr-defined]
    it.ask_to_leave()  # type: ignore[attr-defined]
    process.join(30)
    return process.exitcode  # type: ignore[no-any-return]


def test_a_stage_with_its_own_thread_pool_runs_in_one_made_in_the_child() -> None:
    threads, segments = _helpers.live_threads(), own_segments()
    pool = ThreadPoolExecutor(2, thread_name_prefix="own-pool")
    builder = (
        PipelineBuilder()
        .add_source(range(40))
        .pipe(_helpers.where_it_ran, concurrency=2, executor=pool)
        .add_sink(4)
    )
    it = run_pipeline_in_subprocess(builder, num_threads=2)
    for _ in range(2):
        got = list(it)
        assert sorted(r[0] for r in got) == [i * i for i in range(40)]
        assert {r[1] for r in got} == {it.pid}  # in the child
        names = {r[3] for r in got}  # in a pool of the same kind and size
        assert 1 <= len(names) <= 2
        assert all(name.startswith("own-pool") for name in names), names
    assert _left_by_itself(it) == 0
    it.close()
    assert not pool._threads  # type: ignore[attr-defined]  # this process's pool ran nothing
    pool.shutdown()
    _helpers.assert_nothing_left(threads, segments)


def test_a_stage_with_its_own_process_pool_runs_in_one_made_in_the_child() -> None:
    threads, segments = _helpers.live_threads(), own_segments()
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"))
    builder = (
        PipelineBuilder()
        .add_source(range(20))
        .pipe(_helpers.where_it_ran, concurrency=2, executor=pool)
        .add_sink(4)
    )
    it = run_pipeline_in_subprocess(builder, num_threads=2, timeout=60)
    got = list(it)
    assert sorted(r[0] for r in got) == [i * i for i in range(20)]
    workers = {r[1] for r in got}
    assert {_started_by(r[2]) for r in got} == {it.pid}  # the child's own workers
    assert 1 <= len(workers) <= 2
    assert sorted(r[0] for r in it) == [i * i for i in range(20)]
    assert _left_by_itself(it) == 0
    it.close()
    for pid in workers:
        assert _helpers.process_exits(pid, within=10), "a worker outlived the child"
    assert not pool._processes  # type: ignore[attr-defined]  # this process's pool ran nothing
    pool.shutdown()
    _helpers.assert_nothing_left(threads, segments)


def test_a_process_region_runs_in_a_subprocess_pipeline() -> None:
    # The child may start processes: its region's workers are its own and end with it.
    threads, segments = _helpers.live_threads(), own_segments()
    builder = (
        PipelineBuilder()
        .add_source(range(20))
        .pipe_in_processes(_helpers.where_it_ran, processes=2)
        .add_sink(4)
    )
    with run_pipeline_in_subprocess(builder, num_threads=2, timeout=60) as it:
        got = list(it)
        assert sorted(r[0] for r in got) == [i * i for i in range(20)]
        assert {_started_by(r[2]) for r in got} == {it.pid}
        workers = {r[1] for r in got}
    for pid in workers:
        assert _helpers.process_exits(pid, within=10), "a worker outlived the child"
    _helpers.assert_nothing_left(threads, segments)


class _OwnPool(ThreadPoolExecutor):
    """An executor of a kind the child cannot make again (and that does not pickle)."""


def _initializer() -> None:
    pass


def test_an_executor_that_cannot_be_sent_is_refused_naming_the_stage_and_its_type() -> None:
    pool = _OwnPool(1)
    builder = PipelineBuilder().add_source(range(3)).pipe(_helpers.square, executor=pool)
    with pytest.raises(
        ConfigurationError,
        match=r"stage 'square': its executor, a .*_OwnPool, cannot be sent .*"
        r"ThreadPoolExecutor or a ProcessPoolExecutor",
    ):
        run_pipeline_in_subprocess(builder)
    lock = threading.Lock()
    local = ThreadPoolExecutor(1, initializer=_initializer, initargs=(lock,))
    builder = PipelineBuilder().add_source(range(3)).pipe(_helpers.square, executor=local)
    with pytest.raises(ConfigurationError, match=r"stage 'square': the initializer of its Thre"):
        run_pipeline_in_subprocess(builder)
    assert multiprocessing.active_children() == []
    pool.shutdown()
    local.shutdown()
