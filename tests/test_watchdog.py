"""The stall watchdog: a wait with nothing moving is reported once, and the wait goes on."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from feedline import ConfigurationError, DataLoader, PipelineBuilder

from ._system import starts_processes, zombies

pytestmark = starts_processes


def _when_reported(caplog: pytest.LogCaptureFixture, then: Callable[[], None]) -> threading.Thread:
    # Calls ``then`` once the watchdog has logged anew (or after 60 s, to end the test anyway).
    before = len(_reports(caplog))

    def wait() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(_reports(caplog)) > before:
                break
            time.sleep(0.02)
        then()

    thread = threading.Thread(target=wait)
    thread.start()
    return thread


def _reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "feedline.watchdog"]


def _blocked_op(gate: threading.Event) -> Callable[[int], int]:
    def decode(x: int) -> int:
        if x == 3:
            gate.wait()  # stuck here until the test lets go
        return x

    return decode


def test_a_pipeline_stuck_in_an_op_is_reported_once_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="feedline.watchdog")
    gate = threading.Event()
    pipeline = (
        PipelineBuilder()
        .add_source([f"img-{i}.jpg" for i in range(8)])
        .pipe(lambda key: int(key[4:-4]), name="parse")
        .pipe(_blocked_op(gate), concurrency=2, output_order="input", name="decode")
        .add_sink(2)
        .build(report_stall_after=0.5)
    )
    releaser = _when_reported(caplog, gate.set)
    assert list(pipeline) == list(range(8))  # the wait went on until the op returned
    releaser.join()
    (report,) = _reports(caplog)
    assert "has waited" in report
    assert "stage 'decode': 1 call(s) running" in report
    assert "on source item 3: 'img-3.jpg'" in report  # the item the stuck call works on
    assert "test_watchdog.py" in report  # where the stuck thread stands
    assert "in decode" in report


def test_no_report_without_a_stall_or_when_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="feedline.watchdog")

    def slow(x: int) -> int:
        time.sleep(0.05)  # items keep coming: never a stall
        return x

    quick = PipelineBuilder().add_source(range(30)).pipe(slow).build(report_stall_after=0.2)
    assert sorted(quick) == list(range(30))
    gate = threading.Event()
    off = PipelineBuilder().add_source(range(8)).pipe(_blocked_op(gate))
    timer = threading.Timer(1.5, gate.set)
    timer.start()
    assert sorted(off.build(report_stall_after=None)) == list(range(8))
    timer.join()
    assert _reports(caplog) == []


def test_a_timeout_still_raises_and_bad_settings_are_refused() -> None:
    gate = threading.Event()
    pipeline = (
        PipelineBuilder().add_source(range(8)).pipe(_blocked_op(gate)).build(report_stall_after=5)
    )
    with pipeline.auto_stop():
        got = [pipeline.get_item(timeout=5) for _ in range(3)]
        with pytest.raises(TimeoutError):
            pipeline.get_item(timeout=0.3)
        gate.set()
    assert got == [0, 1, 2]
    for bad in (0, -1, "60", True):
        with pytest.raises(ConfigurationError, match="report_stall_after must be"):
            PipelineBuilder().add_source(range(3)).build(report_stall_after=bad)
        if importlib.util.find_spec("torch") is not None:
            with pytest.raises(ConfigurationError, match="report_stall_after must be"):
                DataLoader(list(range(3)), report_stall_after=bad)


class _Blocking:
    """A map-style dataset whose item ``stuck`` waits for ``gate``."""

    def __init__(self, n: int, stuck: int, gate: Any) -> None:
        self.n, self.stuck, self.gate = n, stuck, gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.stuck:
            self.gate.wait()
        return index


def test_a_dataloader_with_a_blocked_item_names_its_index(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("torch")
    caplog.set_level(logging.WARNING, logger="feedline.watchdog")
    gate = threading.Event()
    loader = DataLoader(_Blocking(16, 5, gate), batch_size=4, report_stall_after=0.5)
    releaser = _when_reported(caplog, gate.set)
    assert [b.tolist() for b in loader][1] == [4, 5, 6, 7]
    releaser.join()
    (report,) = _reports(caplog)
    assert report.startswith("feedline.DataLoader has waited")
    assert "stage 'fetch'" in report
    assert "__getitem__(index=5)" in report  # the call that does not return, and where


class _Numbers:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        time.sleep(0.005)
        return index


def test_a_stopped_worker_is_named_and_the_epoch_goes_on_once_continued(
    caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    import multiprocessing

    pytest.importorskip("torch")
    caplog.set_level(logging.WARNING, logger="feedline.watchdog")
    loader = DataLoader(
        _Numbers(), batch_size=4, num_workers=2, prefetch_factor=1, report_stall_after=1.0
    )
    it = iter(loader)
    got = [next(it).tolist()]
    workers = loader._workers
    assert workers is not None
    stopped = workers._workers[1].pid  # batch 1 is worker 1's
    process = workers._workers[0]._child.process
    forked = type(process._popen).__module__.endswith("popen_fork")
    assert stopped is not None
    os.kill(stopped, signal.SIGSTOP)
    started = len(_reports(caplog))  # a slow start of the workers may have been reported
    releaser = _when_reported(caplog, lambda: os.kill(stopped, signal.SIGCONT))
    got += [b.tolist() for b in it]
    releaser.join()
    assert len(got) == 16
    assert sorted(x for batch in got for x in batch) == list(range(64))
    (report,) = _reports(caplog)[started:]
    assert f"DataLoader worker 1 (pid {stopped}): stopped" in report
    assert f"kill -CONT {stopped}" in report
    assert "DataLoader worker 0 (pid" in report
    assert "its threads' stacks follow on its standard error" in report
    if forked:  # its stderr is this test's (a fork server's children write to the server's)
        deadline = time.monotonic() + 5
        err = ""
        while "most recent call first" not in err and time.monotonic() < deadline:
            err += capfd.readouterr().err  # the running worker wrote its stacks there
            time.sleep(0.05)
        assert "most recent call first" in err
    loader.close()
    deadline = time.monotonic() + 5
    while (multiprocessing.active_children() or zombies()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []
    assert zombies() == []
