"""Failures name the source item a failed sample came from, through every kind of stage."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from feedline import PipelineBuilder
from feedline.errors import PipelineFailure
from feedline.pipeline import die_with_parent

KEYS = [f"train/{i:03d}.jpg" for i in range(12)]


def read(key: str) -> bytes:
    """A stand-in GET: bytes that no longer say which key they came from."""
    return b"\xff\xd8\xff" + bytes([KEYS.index(key)]) * 64


def decode(data: bytes) -> int:
    if data[3] == 5:
        raise ValueError("not a JPEG")
    return data[3]


async def aread(key: str) -> bytes:
    await asyncio.sleep(0)
    return read(key)


def test_a_failure_after_a_read_names_the_key_not_only_the_bytes() -> None:
    pipeline = PipelineBuilder().add_source(KEYS).pipe(read, concurrency=4).pipe(decode).build()
    with pytest.raises(PipelineFailure) as info:
        list(pipeline)
    message = str(info.value)
    assert "stage 'decode'" in message
    assert "(source item 5: 'train/005.jpg')" in message
    assert "ValueError: not a JPEG" in message
    assert info.value.source == "source item 5: 'train/005.jpg'"
    assert info.value.sample is not None
    assert info.value.sample.startswith("b'\\xff\\xd8\\xff")  # the value the stage got


def test_skipped_failures_are_logged_with_their_source_item(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="feedline.pipeline")
    pipeline = (
        PipelineBuilder()
        .add_source(KEYS)
        .pipe(aread, concurrency=4)
        .pipe(decode)
        .build(max_failures=1)
    )
    assert sorted(pipeline) == [i for i in range(12) if i != 5]  # values, never records
    assert "(source item 5: 'train/005.jpg')" in caplog.text


def test_a_batch_names_its_source_items_and_its_elements_their_own() -> None:
    def total(batch: list[bytes]) -> int:
        if any(d[3] == 9 for d in batch):
            raise ValueError("a bad batch")
        return len(batch)

    batches = PipelineBuilder().add_source(KEYS).pipe(read).aggregate(4).pipe(total).build()
    with pytest.raises(PipelineFailure) as info:
        list(batches)
    assert "(source items 8 ('train/008.jpg'), 9 ('train/009.jpg'), 10 (" in str(info.value)

    elements = (
        PipelineBuilder()
        .add_source(KEYS)
        .pipe(read)
        .aggregate(4)
        .disaggregate()
        .pipe(decode, concurrency=2)
        .build()
    )
    with pytest.raises(PipelineFailure, match=r"\(source item 5: 'train/005\.jpg'\)"):
        list(elements)


def test_generator_outputs_keep_the_source_of_their_input() -> None:
    def halves(key: str) -> Iterator[bytes]:
        data = read(key)
        yield data[:32]
        yield data[:3] + data[32:]

    async def ahalves(key: str) -> AsyncIterator[bytes]:
        for half in halves(key):
            yield half

    for split in (halves, ahalves):
        pipeline = PipelineBuilder().add_source(KEYS).pipe(split).pipe(decode).build()
        with pytest.raises(PipelineFailure, match=r"\(source item 5: 'train/005\.jpg'\)"):
            list(pipeline)


def test_a_process_pool_stage_names_the_source_item() -> None:
    with ProcessPoolExecutor(1, initializer=die_with_parent) as pool:
        pipeline = PipelineBuilder().add_source(KEYS).pipe(read).pipe(decode, executor=pool).build()
        with pytest.raises(PipelineFailure, match=r"\(source item 5: 'train/005\.jpg'\)"):
            list(pipeline)


def test_a_first_stage_failure_names_the_number_beside_the_item() -> None:
    pipeline = PipelineBuilder().add_source(KEYS).pipe(int).build()
    with pytest.raises(PipelineFailure) as info:
        list(pipeline)
    assert info.value.sample == "'train/000.jpg'"
    assert info.value.source == "source item 0"  # the sample is the source item itself


def test_the_source_item_survives_pickling_of_the_failure() -> None:
    import pickle

    pipeline = PipelineBuilder().add_source(KEYS).pipe(read).pipe(decode).build()
    with pytest.raises(PipelineFailure) as info:
        list(pipeline)
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.source == info.value.source == "source item 5: 'train/005.jpg'"
    assert str(copy) == str(info.value)


def test_consumers_only_ever_see_values() -> None:
    def build() -> Any:
        return (
            PipelineBuilder()
            .add_source(range(20))
            .pipe(lambda x: x + 1, concurrency=3, output_order="input")
            .aggregate(5)
            .build()
        )

    assert list(build()) == [list(range(1 + 5 * b, 6 + 5 * b)) for b in range(4)]
    pipeline = build()
    with pipeline.auto_stop():
        assert pipeline.get_item(timeout=10) == [1, 2, 3, 4, 5]
    # A pipeline as the source of another hands the outer one values, which get their own
    # source items there.
    outer = PipelineBuilder().add_source(build()).pipe(sum).build()
    assert list(outer) == [15, 40, 65, 90]
    failing = PipelineBuilder().add_source(build()).pipe(lambda b: 1 // (b[0] - 11)).build()
    with pytest.raises(PipelineFailure, match=r"sample \[11, 12, 13, 14, 15\] \(source item 2\)"):
        list(failing)


def test_an_async_source_is_numbered_too() -> None:
    async def keys() -> AsyncIterator[str]:
        for key in KEYS:
            yield key

    pipeline = PipelineBuilder().add_source(keys()).pipe(read).pipe(decode).build()
    with pytest.raises(PipelineFailure, match=r"\(source item 5: 'train/005\.jpg'\)"):
        list(pipeline)
