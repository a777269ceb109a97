"""Regression tests for concurrency bugs found in review, each once reproduced by a script."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from feedline import PipelineBuilder, iterate_in_subprocess
from feedline._proc.shm import SHM_AVAILABLE, pack, release
from feedline.pipeline._engine import Run

from .._system import own_segments, starts_processes
from . import _helpers


def jittery(x: int) -> int:
    r = random.random()
    if r < 0.05:
        time.sleep(0.0005)
    elif r < 0.5:
        time.sleep(0)
    return x


def test_ordered_stage_never_overfills_its_window() -> None:
    # Two jobs could both pass the window check and overfill it; the stage then stopped
    # kicking itself and the consumer slept forever (a hang, caught by the test timeout).
    for _ in range(8):
        p = (
            PipelineBuilder()
            .add_source(range(2000))
            .pipe(jittery, concurrency=4, output_order="input")
            .add_sink(1)
            .build()
        )
        assert list(p) == list(range(2000))


def test_start_after_a_concurrent_stop_returns() -> None:
    p = PipelineBuilder().add_source(range(10)).pipe(_helpers.square).build()
    run = Run(p._config, lambda source, run: source)
    run.stop()
    t = threading.Thread(target=run.start, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "Run.start() hung after a concurrent stop()"


def test_start_and_stop_racing_from_two_threads() -> None:
    p = PipelineBuilder().add_source(range(10)).pipe(_helpers.square).build()
    for _ in range(50):
        go = threading.Event()

        def stopper(go: threading.Event = go) -> None:
            go.wait()
            for _ in range(50):
                p.stop()

        s = threading.Thread(target=stopper)
        s.start()
        go.set()
        p.start()
        s.join(5)
        p.stop()
        assert not s.is_alive()


def test_stop_waits_for_process_pool_calls(tmp_path: Path) -> None:
    log = str(tmp_path / "calls.txt")
    with ProcessPoolExecutor(4) as pool:
        list(pool.map(abs, range(8)))  # start the workers
        p = (
            PipelineBuilder()
            .add_source([(log, i) for i in range(100)])
            .pipe(_helpers.logged_slow_op, concurrency=2, executor=pool)
            .add_sink(1)
            .build()
        )
        for _ in p:
            time.sleep(0.1)
            break
        stopped = time.time()
        for i, _ in enumerate(p):
            if i == 3:
                break
    rows = [tuple(map(float, line.split())) for line in Path(log).read_text().splitlines()]
    assert not [r for r in rows if r[1] < stopped < r[2] - 0.05], "calls outlived stop()"
    events = sorted([(r[1], 1) for r in rows] + [(r[2], -1) for r in rows])
    now = peak = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    assert peak <= 2


@starts_processes
def test_subprocess_child_stops_after_reuse() -> None:
    it = iterate_in_subprocess(_helpers.bounded_range)
    assert list(it) == [0, 1, 2]
    it.close()
    assert list(it) == [0, 1, 2]  # a new child
    child = it._child.process
    assert child is not None
    pid = child.pid
    it.close()
    assert it._child.process is None
    assert _helpers.process_exits(pid, within=5), "the second child outlived close()"


def slow_tail(x: int) -> Any:
    if x < 200:
        yield x
        return
    for i in range(5):
        time.sleep(0.15)
        yield ("slow", i, time.perf_counter())


def test_outputs_of_a_stage_that_turns_slow_are_not_held_back() -> None:
    # 200 instant items make the generator stage "cheap", so a waiting consumer runs it
    # inline; when it turns slow, its outputs must still flow one by one.
    p = (
        PipelineBuilder()
        .add_source(range(201))
        .pipe(slow_tail, buffer_size=64)
        .pipe(_helpers.square_any, name="cheap1")
        .pipe(_helpers.square_any, name="cheap2")
        .add_sink(64)
        .build()
    )
    delays = [time.perf_counter() - x[2] for x in p if isinstance(x, tuple)]
    assert len(delays) == 5
    # Held back, the first would wait 0.6 s for the last; 0.1 s leaves room for a machine
    # that stalls the process now and then.
    assert max(delays) < 0.1, delays


def test_release_removes_packed_segments() -> None:
    if not SHM_AVAILABLE:
        return
    before = own_segments()
    packed = pack({"a": np.zeros(100_000), "b": [np.ones(50_000)]}, 1024)
    assert len(own_segments() - before) == 2
    release(packed)
    assert own_segments() - before == set()


@pytest.mark.parametrize("concurrency", [1, 8])
def test_a_cheap_chain_runs_on_the_pool_and_passes_every_item_once(concurrency: int) -> None:
    # Every call of a stage runs on the pool's threads: the consumer's thread (the training
    # loop) never runs a stage's op, however cheap the chain and however long it waits.
    threads: Counter[str] = Counter()
    lock = threading.Lock()

    def op(x: int) -> int:
        with lock:
            threads[threading.current_thread().name] += 1
        return x

    b: PipelineBuilder[int] = PipelineBuilder().add_source(range(3000))
    for _ in range(3):
        b = b.pipe(op, concurrency=concurrency)
    p = b.add_sink(3).build(num_threads=8)
    got = list(p)
    assert got == list(range(3000)) if concurrency == 1 else sorted(got) == list(range(3000))
    assert sum(threads.values()) == 3 * 3000
    assert threading.current_thread().name not in threads, dict(threads)


def test_a_cheap_stage_that_turns_slow_while_the_consumer_waits_keeps_going() -> None:
    # A waiting consumer runs only cheap stages itself; when a stage turns slow, the consumer
    # must not wait for work nobody runs.
    def turns_slow(x: int) -> int:
        if x >= 300:
            time.sleep(0.002)
        return x

    p = (
        PipelineBuilder()
        .add_source(range(400))
        .pipe(_helpers.identity)
        .pipe(turns_slow, concurrency=4)
        .pipe(_helpers.identity)
        .add_sink(3)
        .build(num_threads=4)
    )
    with p.auto_stop():
        got = [p.get_item(timeout=10) for _ in range(400)]
    assert sorted(got) == list(range(400))


def test_a_stage_that_turns_slow_and_emits_nothing_while_the_consumer_waits() -> None:
    # A stage that turns expensive while the consumer waits, and sends nothing to the sink
    # (its slow items fail), must still be run by pool jobs once the consumer's pulls no
    # longer run it.
    def slow_failures(x: int) -> int:
        if x % 25 == 24:
            time.sleep(0.003)
            raise ValueError(f"item {x}")
        return x

    p = PipelineBuilder().add_source(range(1500)).pipe(slow_failures).add_sink(3)
    pipeline = p.build(max_failures=None)
    with pipeline.auto_stop():
        got = [pipeline.get_item(timeout=5) for _ in range(1500 - 1500 // 25)]
    assert got == [x for x in range(1500) if x % 25 != 24]


def _fuzz_op(kind: str, delay: float) -> Any:
    if kind == "async":

        async def aop(x: int) -> int:
            if delay:
                await asyncio.sleep(delay)
            elif x % 97 == 96:
                await asyncio.sleep(0)  # a cheap coroutine that suspends once in a while
            return x

        return aop
    if kind == "gen":

        def gen(x: int) -> Iterator[int]:
            if delay:
                time.sleep(delay)
            yield x

        return gen

    def op(x: int) -> int:
        if delay:
            time.sleep(delay)
        return x

    return op


_FUZZ_SEEDS = int(os.environ.get("FEEDLINE_FUZZ_SEEDS", "24"))  # more for a longer hunt


@pytest.mark.parametrize("seed", range(_FUZZ_SEEDS))
def test_random_pipelines_deliver_every_item_once(seed: int) -> None:
    # Random mixes of cheap and slow, sync, async and generator stages, ordered or not, with
    # a consumer that sometimes dawdles: every item arrives exactly once, in order where every
    # stage keeps it, and nothing hangs (each get has a deadline). FEEDLINE_FUZZ_SEEDS=400
    # runs more (about 30 s); after an engine change, run it so.
    rng = random.Random(seed)
    n = rng.choice([0, 1, 7, 200, 600])
    b: PipelineBuilder[Any] = PipelineBuilder().add_source(range(n))
    ordered = True
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["sync", "sync", "async", "async", "gen"])
        delay = rng.choice([0.0, 0.0, 0.0005])
        order = rng.choice(["input", "completion"])
        conc = rng.choice([1, 2, 8])
        if kind == "gen" and order == "input":
            conc = 1  # the builder refuses an ordered generator stage that runs in parallel
        ordered &= order == "input" or conc == 1
        b = b.pipe(_fuzz_op(kind, delay), concurrency=conc, output_order=order)
    if rng.random() < 0.3:
        size = rng.randint(1, 5)
        b = b.aggregate(size).disaggregate()
    p = b.add_sink(rng.randint(1, 4)).build(num_threads=rng.choice([None, 8]))
    dawdle = rng.random() < 0.3
    got = []
    with p.auto_stop():
        while True:
            try:
                got.append(p.get_item(timeout=10))
            except EOFError:
                break
            if dawdle and rng.random() < 0.05:
                time.sleep(0.002)
    if ordered:
        assert got == list(range(n))
    else:
        assert sorted(got) == list(range(n))


def test_a_consumer_waiting_behind_a_slow_stage_sleeps() -> None:
    # The consumer pulls cheap stages while it waits, but only as long as that moves items:
    # behind a slow stage it must sleep, not spin on pulls that do nothing.
    def slow(x: int) -> int:
        time.sleep(0.03)
        return x

    p = (
        PipelineBuilder()
        .add_source(range(12))
        .pipe(_helpers.identity)
        .pipe(slow)
        .pipe(_helpers.identity)
        .add_sink(3)
        .build()
    )
    with p.auto_stop():
        p.get_item(timeout=5)
        cpu, wall = time.process_time(), time.monotonic()
        rest = [p.get_item(timeout=5) for _ in range(11)]
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    assert sorted(rest) == list(range(1, 12))
    assert cpu < 0.1 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s of waiting"


@pytest.mark.parametrize("sink", [1, 2, 3])
def test_async_workers_waiting_for_room_behind_a_small_sink_are_all_woken(sink: int) -> None:
    # Waiting workers are woken one at a time, each passing the wake-up on. A worker that
    # filled the output's last slot once passed nothing on, and no one asked the channel to
    # report the next drain: the workers still waiting slept forever (a hang here).
    async def anoop(x: int) -> int:
        return x

    for _ in range(20):
        b: PipelineBuilder[Any] = PipelineBuilder().add_source(range(300))
        for _ in range(3):
            b = b.pipe(anoop, concurrency=8)
        got = _helpers.drain_with_deadline(b.add_sink(sink).build(num_threads=4))
        assert sorted(got) == list(range(300))


@pytest.mark.parametrize("resumable", [False, True])
def test_an_item_the_consumer_dropped_is_held_by_nothing_in_the_pipeline(resumable: bool) -> None:
    # Each async worker used to keep the last item it handed on until its next one came, and
    # the record an item travels in kept its value after the consumer took it. (An item
    # nothing holds may still be alive a moment on free-threaded Python, until the thread
    # that made it runs again: what is checked is what refers to it.)
    import gc
    import sys
    import weakref

    async def make(i: int) -> Any:
        await asyncio.sleep(0.002)
        return np.full(16, i)

    pipeline = (
        PipelineBuilder()
        .add_source(range(300))
        .pipe(make, concurrency=8)
        .add_sink()
        .build(resumable=resumable)
    )
    here = sys._getframe()
    refs: list[weakref.ref[Any]] = []
    holders: set[str] = set()
    for n, item in enumerate(pipeline):
        refs.append(weakref.ref(item))
        del item
        if n % 20 == 19:
            for ref in refs[-10:-1]:
                dropped = ref()
                if dropped is not None:
                    holders.update(type(h).__name__ for h in gc.get_referrers(dropped))
                    holders.discard(type(here).__name__)  # this test's own frame
                    del dropped
    assert len(refs) == 300
    assert not holders, f"items the consumer dropped were still held by {sorted(holders)}"
