from __future__ import annotations

import asyncio
import gc
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from feedline import PipelineBuilder, PipelineFailure

from .._system import starts_processes


def fail_on_odd(x: int) -> int:
    if x % 2:
        raise ValueError(f"odd {x}")
    return x


async def afail_on_odd(x: int) -> int:
    await asyncio.sleep(0)
    return fail_on_odd(x)


def gen_fail_on_odd(x: int) -> Iterator[int]:
    yield fail_on_odd(x)


def ident(x: Any) -> Any:
    return x


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("feedline")]


@pytest.mark.parametrize("op", [fail_on_odd, afail_on_odd, gen_fail_on_odd])
def test_failures_within_budget_are_skipped_and_counted(op: Any) -> None:
    p = (
        PipelineBuilder()
        .add_source(range(20))
        .pipe(op, concurrency=2, name="f")
        .build(max_failures=10)
    )
    assert sorted(p) == list(range(0, 20, 2))
    assert p.stats()["f"].failures == 10


@pytest.mark.parametrize("op", [fail_on_odd, afail_on_odd, gen_fail_on_odd])
def test_failure_budget_raises_from_a_plain_for_loop(op: Any) -> None:
    p = PipelineBuilder().add_source(range(1000)).pipe(op, name="decode").build(max_failures=3)
    seen = []
    with pytest.raises(PipelineFailure, match="stage 'decode' failed on 4 of") as info:
        for x in p:
            seen.append(x)
    assert info.value.stage == "decode"
    assert info.value.num_failures == 4
    assert isinstance(info.value.last_error, ValueError)
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.sample is not None
    assert info.value.sample.isdigit()
    assert len(seen) < 1000
    assert pipeline_threads() == []


def test_default_budget_is_zero() -> None:
    p = PipelineBuilder().add_source(range(10)).pipe(fail_on_odd).build()
    with pytest.raises(PipelineFailure, match="sample 1"):
        list(p)


def test_fractional_budget() -> None:
    # 1 failure in 10 items: within 5% of max(10, 100) items.
    def one_bad(x: int) -> int:
        if x == 3:
            raise ValueError("bad")
        return x

    assert (
        len(list(PipelineBuilder().add_source(range(10)).pipe(one_bad).build(max_failures=0.05)))
        == 9
    )
    p = PipelineBuilder().add_source(range(1000)).pipe(fail_on_odd).build(max_failures=0.05)
    with pytest.raises(PipelineFailure, match=r"5\.00% of items"):
        list(p)


def test_unlimited_budget() -> None:
    p = PipelineBuilder().add_source(range(300)).pipe(fail_on_odd).build(max_failures=None)
    assert len(list(p)) == 150


def test_failures_are_logged_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    p = PipelineBuilder().add_source(range(400)).pipe(fail_on_odd).build(max_failures=None)
    with caplog.at_level(logging.WARNING, logger="feedline.pipeline"):
        list(p)
    failures = [r for r in caplog.records if "failed on sample" in r.message]
    assert 5 <= len(failures) < 15  # the first five at once, then one a second
    assert failures[0].exc_info is not None  # the first one carries its traceback
    assert all(r.exc_info is None for r in failures[1:])
    # What was held back is summed up when the run ends, with the last one named.
    (summed,) = [r.message for r in caplog.records if "not logged one by one" in r.message]
    held = sum(int(m) for r in failures for m in re.findall(r"\((\d+) more since", r.message))
    assert f"fail_on_odd': {200 - len(failures) - held} more failed" in summed
    assert "[200 failure(s) in all]" in summed


def test_a_few_failures_are_each_logged_with_their_source_item(
    caplog: pytest.LogCaptureFixture,
) -> None:
    paths = [f"img-{i}.jpg" for i in range(9)]
    p = (
        PipelineBuilder()
        .add_source(paths)
        .pipe(lambda path: fail_on_odd(int(path[4:-4])), name="decode")
        .build(max_failures=None)
    )
    with caplog.at_level(logging.WARNING, logger="feedline.pipeline"):
        assert len(list(p)) == 5
    logged = caplog.text
    for bad in ("img-1.jpg", "img-3.jpg", "img-5.jpg", "img-7.jpg"):
        assert f"'{bad}'" in logged
    assert "not logged one by one" not in logged


def test_failure_in_every_stage_kind() -> None:
    def bad_agg_input(x: int) -> Any:
        return 5 if x == 7 else [x]  # 5 is not iterable: disaggregate fails on it

    p = (
        PipelineBuilder()
        .add_source(range(10))
        .pipe(bad_agg_input)
        .disaggregate(name="flat")
        .build()
    )
    with pytest.raises(PipelineFailure, match="stage 'flat'"):
        list(p)


def test_ordered_stage_skips_failed_items_in_place() -> None:
    p = (
        PipelineBuilder()
        .add_source(range(30))
        .pipe(fail_on_odd, concurrency=4, output_order="input")
        .build(max_failures=None)
    )
    assert list(p) == list(range(0, 30, 2))


def test_source_error_propagates_as_is() -> None:
    def source() -> Iterator[int]:
        yield 1
        raise KeyError("broken source")

    p = PipelineBuilder().add_source(source()).pipe(ident).build(max_failures=None)
    with pytest.raises(KeyError, match="broken source"):
        list(p)
    assert pipeline_threads() == []


def test_async_source_error_propagates() -> None:
    async def source() -> Any:
        yield 1
        raise OSError("disk gone")

    p = PipelineBuilder().add_source(source()).pipe(ident).build()
    with pytest.raises(OSError, match="disk gone"):
        list(p)


def _slow_pipeline() -> Any:
    def slow(x: int) -> int:
        time.sleep(0.001)
        return x

    async def aslow(x: int) -> int:
        await asyncio.sleep(0.001)
        return x

    return (
        PipelineBuilder()
        .add_source(range(100_000))
        .pipe(slow, concurrency=4)
        .pipe(aslow, concurrency=4)
        .aggregate(3)
        .build()
    )


def test_no_threads_after_break() -> None:
    p = _slow_pipeline()
    for i, _ in enumerate(p):
        if i == 5:
            break
    assert pipeline_threads() == []


def test_no_threads_after_exception_in_consumer() -> None:
    p = _slow_pipeline()
    with pytest.raises(ZeroDivisionError):
        for i, _ in enumerate(p):
            if i == 5:
                raise ZeroDivisionError
    assert pipeline_threads() == []


def test_no_threads_after_del() -> None:
    p = _slow_pipeline()
    p.start()
    p.get_item(timeout=5)
    assert pipeline_threads() != []
    del p
    gc.collect()
    deadline = time.monotonic() + 5
    while pipeline_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipeline_threads() == []


def test_no_threads_after_stop() -> None:
    p = _slow_pipeline()
    with p.auto_stop():
        p.get_item(timeout=5)
    assert pipeline_threads() == []
    p.start()
    p.stop()
    assert pipeline_threads() == []


def test_stop_mid_epoch_from_another_thread() -> None:
    p = _slow_pipeline()
    p.start()
    p.get_item(timeout=5)
    timer = threading.Timer(0.1, p.stop)
    timer.start()
    with pytest.raises(EOFError):
        while True:
            p.get_item(timeout=5)
    timer.join()
    assert pipeline_threads() == []


@starts_processes
def test_stops_at_interpreter_exit(tmp_path: Any) -> None:
    import subprocess
    import sys

    script = tmp_path / "leave_running.py"
    script.write_text(
        "import time\n"
        "from feedline import PipelineBuilder\n"
        "def slow(x):\n"
        "    time.sleep(0.01)\n"
        "    return x\n"
        "p = PipelineBuilder().add_source(range(10**9)).pipe(slow, concurrency=4).build()\n"
        "p.start()\n"
        "print(p.get_item(timeout=5))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in {str(i) for i in range(8)}


async def agen_fail_on_odd(x: int) -> Any:
    yield x
    if x % 2:
        raise ValueError(f"odd {x}")
    yield -x


def test_async_generator_failure_counts_and_keeps_earlier_outputs() -> None:
    p = (
        PipelineBuilder()
        .add_source(range(6))
        .pipe(agen_fail_on_odd, name="ag")
        .build(max_failures=None)
    )
    assert sorted(p) == sorted([0, 0, 1, 2, -2, 3, 4, -4, 5])
    assert p.stats()["ag"].failures == 3


def test_process_pool_failures_are_counted_and_budgeted() -> None:
    from concurrent.futures import ProcessPoolExecutor

    from . import _helpers

    with ProcessPoolExecutor(2) as pool:
        p = (
            PipelineBuilder()
            .add_source(range(10))
            .pipe(_helpers.fail_on_odd, executor=pool, concurrency=2, name="remote")
            .build(max_failures=5)
        )
        assert sorted(p) == [0, 2, 4, 6, 8]
        assert p.stats()["remote"].failures == 5
        p = (
            PipelineBuilder()
            .add_source(range(10))
            .pipe(_helpers.fail_on_odd, executor=pool, name="remote")
            .build(max_failures=1)
        )
        with pytest.raises(PipelineFailure, match="stage 'remote'") as info:
            list(p)
        assert isinstance(info.value.last_error, ValueError)


def test_an_op_returning_none_passes_none_on_and_a_generator_drops_items() -> None:
    # Deliberately unlike SPDL, which drops None results: None is a value here.
    def none_on_threes(x: int) -> int | None:
        return None if x % 3 == 0 else x

    async def none_on_odds(x: int) -> int | None:
        return None if x % 2 else x

    def keep_even(x: int) -> Any:
        if x % 2 == 0:
            yield x

    p = PipelineBuilder().add_source(range(6)).pipe(none_on_threes, output_order="input")
    assert list(p.build()) == [None, 1, 2, None, 4, 5]
    p = PipelineBuilder().add_source(range(4)).pipe(none_on_odds, output_order="input")
    assert list(p.build()) == [0, None, 2, None]
    assert list(PipelineBuilder().add_source(range(6)).pipe(keep_even).build()) == [0, 2, 4]
