"""Process regions: a run of stages in worker processes, nothing pickled between them."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest

from feedline import ConfigurationError, PipelineBuilder, PipelineFailure

from .._system import own_segments, starts_processes
from ._helpers import (
    Counted,
    fail_on_three,
    processes_gone,
    square,
    unwrap_with_pid,
    value_of,
    wrap,
)

pytestmark = starts_processes


def test_a_run_of_stages_runs_in_workers_and_nothing_between_them_is_pickled() -> None:
    before = own_segments()
    pipeline = (
        PipelineBuilder()
        .add_source(range(12))
        .pipe_in_processes([wrap, unwrap_with_pid], processes=2, output_order="input")
        .add_sink()
        .build()
    )
    first = list(pipeline)
    second = list(pipeline)  # the next epoch, on the same workers
    assert [v for v, _, _ in first] == list(range(12))
    pids = {pid for _, pid, _ in first + second}
    assert os.getpid() not in pids
    assert 1 <= len(pids) <= 2
    arrays = [a for _, _, a in first]
    assert all(a.shape == (200, 200) and a[0, 0] == v for v, (_, _, a) in enumerate(first))
    arrays[0][0, 0] = -1  # writable, and this process's own
    del first, second, arrays
    del pipeline
    processes_gone()
    assert own_segments() <= before  # the shared memory went with the arrays


def test_an_epoch_left_early_ends_the_workers_and_the_next_starts_new_ones() -> None:
    pipeline = PipelineBuilder().add_source(range(50)).pipe_in_processes(square).add_sink().build()
    for k, _ in enumerate(pipeline):
        if k == 3:
            break
    assert multiprocessing.active_children() == []  # ended with the epoch, no GC needed
    assert sorted(pipeline) == [i * i for i in range(50)]
    del pipeline
    processes_gone()


def test_inputs_cross_once_each() -> None:
    Counted.pickled = 0
    pipeline = (
        PipelineBuilder()
        .add_source([Counted(i) for i in range(9)])
        .pipe_in_processes(value_of, processes=2)
        .add_sink()
        .build()
    )
    assert sorted(pipeline) == [i * 10 for i in range(9)]
    assert Counted.pickled == 9
    del pipeline
    processes_gone()


def test_results_match_threads_and_a_failure_names_the_source_item() -> None:
    threads = PipelineBuilder().add_source(range(20)).pipe(square, concurrency=2).add_sink().build()
    region = PipelineBuilder().add_source(range(20)).pipe_in_processes(square).add_sink().build()
    assert sorted(region) == sorted(threads)
    failing = (
        PipelineBuilder()
        .add_source(range(6))
        .pipe_in_processes([fail_on_three, square], name="checks")
        .add_sink()
        .build()
    )
    with pytest.raises(PipelineFailure, match=r"stage 'checks'.*source item"):
        list(failing)
    skipping = (
        PipelineBuilder()
        .add_source(range(6))
        .pipe_in_processes([fail_on_three])
        .add_sink()
        .build(max_failures=1)
    )
    assert sorted(skipping) == [0, 1, 2, 4, 5]
    del region, failing, skipping
    processes_gone()


def test_a_resumable_pipeline_with_a_region_resumes() -> None:
    def build() -> object:
        return (
            PipelineBuilder()
            .add_source(range(30))
            .pipe_in_processes(square, processes=2)
            .add_sink()
            .build(resumable=True)
        )

    pipeline = build()
    got = []
    for item in pipeline:  # type: ignore[attr-defined]
        got.append(item)
        if len(got) == 11:
            break
    state = pipeline.state_dict()  # type: ignore[attr-defined]
    pipeline.stop()  # type: ignore[attr-defined]
    resumed = build()
    resumed.load_state_dict(state)  # type: ignore[attr-defined]
    assert sorted(got + list(resumed)) == [i * i for i in range(30)]  # type: ignore[call-overload]
    del pipeline, resumed
    processes_gone()


def _generator(x: int) -> object:
    yield x


@pytest.mark.parametrize(
    ("ops", "kwargs", "match"),
    [
        ([], {}, "non-empty list"),
        ([lambda x: x], {}, "cannot be sent"),
        ([_generator], {}, "plain functions"),
        ([square], {"processes": 0}, "processes"),
        ([square], {"mp_context": "fork"}, "fork unsafe"),
    ],
)
def test_bad_regions_say_what_to_do(
    ops: list[object], kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        PipelineBuilder().add_source([1]).pipe_in_processes(ops, **kwargs)  # type: ignore[arg-type]


def test_arrays_of_the_result_are_numpy() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(range(3))
        .pipe_in_processes([wrap, unwrap_with_pid])
        .add_sink()
        .build()
    )
    assert all(isinstance(a, np.ndarray) for _, _, a in pipeline)
    del pipeline
    processes_gone()
