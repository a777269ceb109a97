"""The statistics every benchmark scenario shares."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from feedline.bench._common import Contender, alternate, paired_ratio
from feedline.bench._loaders import time_loader

from ._system import starts_processes


def _rates(values: list[float]) -> Callable[[], tuple[int, float]]:
    it: Iterator[float] = iter(values)
    return lambda: (int(next(it)), 1.0)


def test_alternate_runs_round_robin_and_pairs_ratios_by_round() -> None:
    order: list[str] = []

    def tracked(name: str, values: list[float]) -> Contender:
        run = _rates(values)

        def wrapped() -> tuple[int, float]:
            order.append(name)
            return run()

        return Contender(name, wrapped)

    # The machine slows in round 2: the baseline's median (90) and the contender's (150) are
    # from different rounds; round by round the contender is 1.5x, 2.0x and 2.2x as fast.
    found = alternate(
        "case",
        [tracked("base", [100, 60, 90]), tracked("fast", [150, 120, 200])],
        3,
        "base",
    )
    assert order == ["base", "fast"] * 3
    by_name = {m.contender: m for m in found}
    assert by_name["base"].items_per_s == 90
    assert by_name["fast"].items_per_s == 150
    assert by_name["fast"].runs == [150, 120, 200]
    assert by_name["base"].ratio == 1.0
    assert by_name["fast"].ratio == pytest.approx(2.0)
    # Each run's CPU time per 1000 items is measured too (these runs only return numbers).
    assert all(0 <= m.extra["cpu_s_per_1000"] < 1 for m in found)


def test_alternate_measures_cpu_per_item() -> None:
    def busy() -> tuple[int, float]:
        t0 = time.process_time()
        while time.process_time() - t0 < 0.05:  # 50 ms of CPU for 10 items
            pass
        return 10, 0.05

    found = alternate("case", [Contender("busy", busy)], 3, None)
    # 5 CPU-seconds per 1000 items, within the clock's granularity.
    assert found[0].extra["cpu_s_per_1000"] == pytest.approx(5.0, rel=0.3)


def test_alternate_refuses_duplicate_names_and_skips_invalid_rounds() -> None:
    with pytest.raises(ValueError, match="unique"):
        alternate("case", [Contender("a", _rates([1])), Contender("a", _rates([1]))], 1, None)
    assert paired_ratio([2.0, 4.0, float("nan")], [1.0, 0.0, 1.0]) == 2.0
    assert paired_ratio([1.0], [0.0]) is None


def test_alternate_without_a_baseline_leaves_ratios_unset() -> None:
    found = alternate("case", [Contender("only", _rates([5, 7]))], 2, None)
    assert found[0].ratio is None
    assert found[0].items_per_s == 6


def test_figures_are_written_without_exponents_and_with_their_spread() -> None:
    from feedline.bench._common import fmt, spread

    assert fmt(1784.2) == "1,784"
    assert fmt(43.21) == "43.2"
    assert fmt(2.5) == "2.50"
    assert fmt(0.01234) == "0.0123"
    assert fmt(0) == "0"
    assert "e" not in fmt(123456789.0)
    assert spread([3.0, 1.0, 2.0]) == "1.00-3.00"
    assert spread([5.0]) == ""  # one round has no spread


def test_charts_use_a_log_axis_only_where_values_span_more_than_10x() -> None:
    from feedline.bench._report import log_axis

    assert log_axis([24_000.0, 1_900.0, 300.0])
    assert not log_axis([800.0, 500.0, 410.0])
    assert not log_axis([])
    assert not log_axis([0.0, 5.0])  # a missing bar does not count


def test_generating_pictures_reports_its_steps(tmp_path: Path) -> None:
    pytest.importorskip("cv2")
    from feedline.bench._data import jpeg_files

    seen: list[tuple[str, int, int]] = []
    paths = jpeg_files(3, "imagenet", tmp_path, steps=lambda *a: seen.append(a))
    assert len(paths) == 3
    assert [(done, total) for _, done, total in seen] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    seen.clear()
    jpeg_files(3, "imagenet", tmp_path, steps=lambda *a: seen.append(a))
    assert seen == []  # cached: nothing to generate


def test_plain_progress_writes_a_line_per_tenth(capsys: pytest.CaptureFixture[str]) -> None:
    from feedline.cli import _Progress

    progress = _Progress(["decode"])
    for done in range(101):
        progress.steps("generating", done, 100)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 11
    assert lines[-1].endswith("generating: 100/100")


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


class _ForkServerLoader:
    """Batches until a fork server's worker (this process's grandchild) has burnt CPU, ended
    and been reaped by the fork server."""

    def __init__(self, seconds: float) -> None:
        ctx = multiprocessing.get_context("forkserver")
        self.worker = ctx.Process(target=_burn, args=(seconds,))
        self.worker.start()

    def __iter__(self) -> Iterator[list[int]]:
        # Two batches whatever the machine's speed: time_loader's memory sample after the first
        # one can outlast the worker (reading /proc of every process is slow on a loaded
        # machine, and slower on free-threaded 3.13, which specializes no bytecode).
        yield [0]
        while self.worker.exitcode is None:
            self.worker.join(0.05)
        yield [0]


@starts_processes
def test_time_loader_counts_the_cpu_of_a_fork_server_s_workers() -> None:
    # The fork server waits for its workers, this process never does: RUSAGE_CHILDREN alone
    # leaves their CPU out, and a reading of the live processes would miss those that ended.
    # The server itself starts first, with a process that ends at once: its imports (torch,
    # preloaded for the test run) are not the loader's.
    first = multiprocessing.get_context("forkserver").Process(target=_burn, args=(0.0,))
    first.start()
    first.join()
    run = time_loader(lambda: _ForkServerLoader(0.6), memory=True)
    assert run.items == 2
    assert 0.5 <= run.cpu_s < 3
    assert run.peak_rss > 0
