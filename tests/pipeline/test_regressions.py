"""Regression tests for concurrency bugs found in review, each once reproduced by a script."""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from feedline import PipelineBuilder, iterate_in_subprocess
from feedline.pipeline._engine import Run
from feedline.pipeline._pipeline import _wrap_source
from feedline.pipeline._shm import SHM_AVAILABLE, pack, release

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
    run = Run(p._config, _wrap_source)
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
        time.sleep(0.05)
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
    assert max(delays) < 0.04, delays


def test_release_removes_packed_segments() -> None:
    if not SHM_AVAILABLE:
        return
    before = set(os.listdir("/dev/shm"))
    packed = pack({"a": np.zeros(100_000), "b": [np.ones(50_000)]}, 1024)
    assert len(set(os.listdir("/dev/shm")) - before) == 2
    release(packed)
    assert set(os.listdir("/dev/shm")) - before == set()
