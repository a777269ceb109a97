"""A store that throttles: refusals lower the requests in flight, are retried, lose nothing.

The limit itself (``_throttle.Throttle``) is tested with a clock of its own; the store against
servers on loopback that refuse requests as S3 does (``503 SlowDown``) or as a proxy does
(``429``): the benchmarks' server in a process of its own, capping the GETs per second, and
small handlers that refuse a key a set number of times.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from feedline import PipelineBuilder, RemoteReadError, RemoteStore
from feedline.source._throttle import BETA, GROWTH, Throttle

from .._system import starts_processes
from ._http import Handler, serving

pytest.importorskip("obstore")

_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please '
    b"reduce your request rate.</Message></Error>"
)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the limit -----------------------------------------------------------------------------------


def test_a_refusal_cuts_the_limit_once_per_round_and_it_grows_back_on_the_cubic() -> None:
    clock = _Clock()
    throttle = Throttle(64, clock=clock)
    assert throttle.limit() == 64
    cuts = [throttle.take_sync() for _ in range(20)]
    assert set(cuts) == {0}
    assert throttle.refused(cuts[0])  # 20 in flight: the limit drops to 14
    assert throttle.limit() == int(BETA * 20)
    assert not throttle.refused(cuts[1])  # sent before that cut: no second cut
    assert throttle.limit() == int(BETA * 20)
    for _ in range(20):
        throttle.give()
    k = (20 * (1 - BETA) / GROWTH) ** (1 / 3)
    clock.now += k / 2
    assert int(BETA * 20) < throttle.limit() < 20  # quickly back near where it was refused
    clock.now += k / 2
    assert throttle.limit() == 20  # there at K
    clock.now += 1.0
    assert throttle.limit() == 20 + int(GROWTH)  # then past it, slowly at first
    clock.now += 100.0
    assert throttle.limit() == 64  # never past the store's max_in_flight
    # A request sent after the cut may cut again, from what is in flight then.
    assert throttle.take_sync() == 1
    assert throttle.refused(1)
    assert throttle.limit() == 1  # one in flight: never below one
    throttle.give()


def test_waiters_get_room_in_turn_whether_threads_or_coroutines() -> None:
    throttle = Throttle(2)
    throttle.take_sync()
    throttle.take_sync()
    order: list[str] = []

    def thread_waits() -> None:
        throttle.take_sync()
        order.append("thread")

    async def main() -> None:
        waiter = threading.Thread(target=thread_waits)
        waiter.start()
        while not throttle._waiters:
            await asyncio.sleep(0.001)
        task = asyncio.ensure_future(throttle.take())
        while len(throttle._waiters) < 2:
            await asyncio.sleep(0.001)
        throttle.give()  # from this loop's thread: the thread waited first, it goes first
        await asyncio.to_thread(waiter.join, 10)
        assert not task.done()
        await asyncio.to_thread(throttle.give)  # from another thread: wakes this loop
        await asyncio.wait_for(task, 10)
        order.append("coroutine")

    asyncio.run(main())
    assert order == ["thread", "coroutine"]
    assert throttle.in_flight == 2


def test_a_cancelled_waiter_leaves_no_room_taken() -> None:
    throttle = Throttle(1)
    throttle.take_sync()

    async def main() -> None:
        waiting = asyncio.ensure_future(throttle.take())
        await asyncio.sleep(0.01)
        waiting.cancel()  # never granted: it leaves the queue
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not throttle._waiters
        granted = asyncio.ensure_future(throttle.take())
        await asyncio.sleep(0.01)
        throttle.give()  # granted the room, then cancelled before it ran: the room comes back
        granted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await granted

    asyncio.run(main())
    assert throttle.in_flight == 0
    assert throttle.take_sync() == 0  # and is free


def test_a_waiter_whose_event_loop_closed_passes_its_room_on() -> None:
    throttle = Throttle(1)
    throttle.take_sync()
    loop = asyncio.new_event_loop()
    gone = loop.create_task(throttle.take())
    loop.run_until_complete(asyncio.sleep(0.01))  # the task waits in the queue now
    loop.close()
    assert gone.done() is False
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(throttle.take_sync()))
    waiter.start()
    while len(throttle._waiters) < 2:
        time.sleep(0.001)
    throttle.give()  # the closed loop's waiter cannot take it: the thread behind it does
    waiter.join(10)
    assert got == [0]
    assert throttle.in_flight == 1
    del gone  # its coroutine closes: the room it passed on is not given back twice
    gc.collect()
    assert throttle.in_flight == 1


def test_a_waiter_gets_room_as_the_limit_grows_back_with_nothing_ending() -> None:
    clock = _Clock()
    throttle = Throttle(8, clock=clock)
    for _ in range(4):
        throttle.take_sync()
    throttle.refused(0)  # the limit drops to 2, with 4 in flight for a long while
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(throttle.take_sync()))
    waiter.start()
    time.sleep(0.05)
    assert got == []
    clock.now += 60  # the curve is back at the ceiling; no request has ended
    waiter.join(5)
    assert got == [1]
    assert throttle.in_flight == 5


# -- a store that refuses ------------------------------------------------------------------------


class _Busy(Handler):
    """``/slowdown-<n>-*`` and ``/busy-<n>-*`` refuse ``n`` times (503 SlowDown, 429), then
    answer; ``/down-*`` fails with a bare 503; ``/bucket/<key>`` is the same, for S3."""

    attempts: ClassVar[Counter[str]] = Counter()

    def do_GET(self) -> None:
        path = self.path.removeprefix("/bucket")
        self.attempts[path] += 1
        kind, _, rest = path.strip("/").partition("-")
        times = int(rest.split("-")[0]) if kind in ("slowdown", "busy") else 0
        if kind == "slowdown" and self.attempts[path] <= times:
            self.reply(503, _SLOW_DOWN, {"Content-Type": "application/xml"})
        elif kind == "busy" and self.attempts[path] <= times:
            self.reply(429, b"Too Many Requests")
        elif kind == "down":
            self.reply(503, b"try later")
        else:
            self.reply(200, b"ok:" + path.encode())


@pytest.fixture
def busy() -> Iterator[str]:
    _Busy.attempts.clear()
    with serving(_Busy) as url:
        yield url


def test_refusals_are_sent_again_without_spending_the_retries(busy: str) -> None:
    store = RemoteStore(busy, retries=0, backoff=0.01)
    assert bytes(store.read_sync("slowdown-3-a")) == b"ok:/slowdown-3-a"
    assert bytes(asyncio.run(store.read("busy-2-b"))) == b"ok:/busy-2-b"
    assert (_Busy.attempts["/slowdown-3-a"], _Busy.attempts["/busy-2-b"]) == (4, 3)
    stats = store.stats()
    assert (stats.reads, stats.refusals, stats.retried, stats.failures) == (2, 5, 0, 0)
    # A bare 503 is a server error: retried as many times as asked, then an error.
    with pytest.raises(RemoteReadError, match=r"HTTP 503 Service Unavailable: try later\)"):
        store.read_sync("down-c")
    assert _Busy.attempts["/down-c"] == 1
    assert store.stats().failures == 1


def test_an_s3_slowdown_is_a_refusal(busy: str) -> None:
    store = RemoteStore(
        "s3://bucket",
        endpoint=busy,
        access_key_id="test",
        secret_access_key="test",
        region="us-east-1",
        retries=0,
        backoff=0.01,
    )
    assert bytes(store.read_sync("slowdown-2-s3")) == b"ok:/slowdown-2-s3"
    assert store.stats().refusals == 2


def test_a_store_that_refuses_for_longer_than_retry_timeout_says_it_throttles(busy: str) -> None:
    store = RemoteStore(busy, retry_timeout=0.5, backoff=0.05, max_backoff=0.1)
    t0 = time.monotonic()
    with pytest.raises(RemoteReadError) as info:
        store.read_sync("slowdown-1000-d")
    assert time.monotonic() - t0 < 5
    message = str(info.value)
    assert "(HTTP 503 Service Unavailable: SlowDown: Please reduce your request rate., after " in (
        message
    )
    assert message.split("after ", 1)[1].split(")")[0].endswith(" refusals")
    assert "refused requests as too many (throttling) for 0.5 s" in message
    assert "retry_timeout=" in message
    assert "\n" not in message
    stats = store.stats()
    assert (stats.failures, stats.retried) == (1, 0)
    assert stats.refusals >= 3


@starts_processes
def test_a_pipeline_over_a_throttled_store_loses_nothing_and_sends_fewer_at_once(
    tmp_path: Path,
) -> None:
    from feedline.bench._server import ServerProcess

    body = tmp_path / "object"
    body.write_bytes(bytes(range(256)) * 8)
    with ServerProcess([body], 0.005, requests=200) as server:
        store = RemoteStore(server.url, hedge=False)  # one request per read: counts that match
        limits: list[int] = []

        def read(key: str) -> int:
            return len(store.read_sync(key))

        async def read_async(key: str) -> int:
            limits.append(store._throttle.limit())
            return len(await store.read(key))

        pipeline = (
            PipelineBuilder()
            .add_source([str(i) for i in range(800)])
            .pipe(read_async, concurrency=32)
            .add_sink(32)
            .build(max_failures=0)  # not one read may fail
        )
        sizes = list(pipeline)
        # And from threads, as a DataLoader's dataset reads, sharing the same limit.
        threads_got: list[int] = []
        readers = [
            threading.Thread(target=lambda i=i: threads_got.append(read(f"{i}"))) for i in range(16)
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(60)
        served = server.served()
    assert sizes == [2048] * 800
    assert threads_got == [2048] * 16
    stats = store.stats()
    assert (stats.failures, stats.retried) == (0, 0)
    assert stats.reads == served["gets"] == 816
    assert stats.refusals == served["refused"] > 0  # each refusal seen, counted once
    assert min(limits) < 32  # the limit went below what the stage would send
