"""Hedged reads: a read whose reply is later than most gets a second request; the first wins.

The delay and budget (``_hedge.Hedger``) are tested with times given by hand; the race against
a server on loopback whose first request for a key stalls until released, the second
answering at once, so that which request won is certain.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest

from feedline import ConfigurationError, RemoteNotFoundError, RemoteStore
from feedline.source import _hedge
from feedline.source._hedge import (
    BURST,
    JUDGED,
    LEARNED,
    PAUSE,
    SHARE,
    WINS,
    Hedger,
    Progress,
    due,
)
from feedline.source._throttle import Throttle

from ._http import Handler, serving

pytest.importorskip("obstore")


def _learned(hedger: Hedger, median: float, tail: float) -> None:
    # A store whose times to headers are ``median`` but for one in ten, ``tail``.
    for i in range(LEARNED * 2):
        hedger.observe(tail if i % 10 == 0 else median)


def test_the_delay_is_the_p95_once_learned_and_only_where_there_is_a_tail() -> None:
    hedger = Hedger()
    for _ in range(LEARNED - 1):
        hedger.observe(0.01)
    assert hedger.begin() is None  # not learned yet
    flat = Hedger()
    _learned(flat, 0.010, 0.015)  # p99 1.5 medians: no tail to cut
    assert flat.begin() is None
    tailed = Hedger()
    _learned(tailed, 0.010, 0.100)
    assert tailed.begin() == pytest.approx(0.100)  # the p95 falls among the slow tenth
    assert tailed.delay == pytest.approx(0.100)


def test_hedges_stay_within_their_share_of_the_reads() -> None:
    hedger = Hedger()
    assert not hedger.spend()  # no read yet: nothing earned
    spent = 0
    for _ in range(1000):
        hedger.begin()
        spent += hedger.spend()  # a hedge wanted for every read
    assert spent == int(1000 * SHARE)
    for _ in range(10_000):
        hedger.begin()  # a quiet spell banks at most BURST
    assert sum(hedger.spend() for _ in range(100)) == int(BURST)


def test_hedging_pauses_while_its_hedges_do_not_win(monkeypatch: pytest.MonkeyPatch) -> None:
    winning, losing = Hedger(), Hedger()
    for hedger in (winning, losing):
        _learned(hedger, 0.010, 0.100)
    wins = math.ceil(WINS * JUDGED)
    for k in range(JUDGED):
        winning.judge(won=k < wins)  # enough won: hedging goes on
        losing.judge(won=k < wins - 1)  # one fewer: it pauses
    assert winning.begin() == pytest.approx(0.100)
    assert not winning.paused
    assert losing.begin() is None
    assert losing.paused
    assert losing.delay is None  # what stats() reports
    now = time.monotonic()
    monkeypatch.setattr(_hedge.time, "monotonic", lambda: now + PAUSE + 1)
    assert losing.begin() == pytest.approx(0.100)  # tried again after the pause
    assert not losing.paused


def test_a_request_is_due_its_hedge_the_delay_after_it_was_sent() -> None:
    progress = Progress()
    assert due(progress, 0.1, 5.0) == 0.1  # not sent (held by the store's limit): look later
    progress.sent = 5.0
    assert due(progress, 0.1, 5.04) == pytest.approx(0.06)
    assert due(progress, 0.1, 6.0) == 0.0
    progress.answered = True
    assert due(progress, 0.1, 6.0) is None  # headers came: its body is coming


class _Stalling(Handler):
    """``/stall-*``: the first request waits for ``release`` (10 s at most), later ones answer
    at once; ``/missing-*`` is not found; anything else answers at once."""

    attempts: ClassVar[Counter[str]] = Counter()
    release: ClassVar[threading.Event] = threading.Event()

    def do_GET(self) -> None:
        self.attempts[self.path] += 1
        if self.path.startswith("/missing"):
            self.reply(404, b"no such key")
            return
        if self.path.startswith("/stall") and self.attempts[self.path] == 1:
            self.release.wait(10)
        self.reply(200, b"body of " + self.path.encode())


@pytest.fixture
def stalling() -> Iterator[str]:
    _Stalling.attempts.clear()
    _Stalling.release.clear()
    with serving(_Stalling, before_stop=_Stalling.release.set) as url:
        yield url


def _tailed(store: RemoteStore, delay: float = 0.05) -> None:
    # The store has learned a tail (a hedge after ``delay``) and has hedges to spend.
    assert store._hedger is not None
    _learned(store._hedger, delay / 10, delay)
    store._hedger._tokens = BURST


def test_a_stalled_read_sync_is_answered_by_its_hedge(stalling: str) -> None:
    store = RemoteStore(stalling, hedge=True)
    _tailed(store)
    t0 = time.monotonic()
    assert bytes(store.read_sync("stall-a")) == b"body of /stall-a"
    assert time.monotonic() - t0 < 5  # not the 10 s the first request waits
    assert _Stalling.attempts["/stall-a"] == 2
    stats = store.stats()
    assert (stats.hedged, stats.hedges_won) == (1, 1)
    assert stats.hedge_delay == pytest.approx(0.05)
    # The race's threads hold up no exit while the loser waits on the server.
    assert all(t.daemon for t in threading.enumerate() if t.name == "feedline-hedges")
    _Stalling.release.set()  # the loser ends; its room in the limit comes back
    deadline = time.monotonic() + 10
    while store.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = store.stats()
    assert stats.in_flight == 0
    assert (stats.reads, stats.bytes) == (1, len(b"body of /stall-a"))  # one read, not two


def test_a_stalled_read_is_answered_by_its_hedge_and_the_loser_cancelled(stalling: str) -> None:
    store = RemoteStore(stalling, hedge=True)
    _tailed(store)

    async def main() -> bytes:
        return bytes(await store.read("stall-b"))

    assert asyncio.run(main()) == b"body of /stall-b"
    stats = store.stats()
    assert (stats.hedged, stats.hedges_won, stats.in_flight) == (1, 1, 0)  # dropped at once
    assert (stats.reads, stats.failures) == (1, 0)


def test_reads_that_answer_in_time_and_stores_without_hedges_send_one_request(
    stalling: str,
) -> None:
    store = RemoteStore(stalling, hedge=True)
    _tailed(store, delay=2.0)
    for i in range(20):
        store.read_sync(f"quick-{i}")
    assert store.stats().hedged == 0
    plain = RemoteStore(stalling, hedge=False)
    assert plain._hedger is None
    _Stalling.release.set()
    assert bytes(plain.read_sync("stall-c")) == b"body of /stall-c"
    assert _Stalling.attempts["/stall-c"] == 1
    assert plain.stats().hedge_delay is None


def test_no_hedge_while_the_store_throttles(stalling: str) -> None:
    store = RemoteStore(stalling, max_in_flight=8, hedge=True)
    _tailed(store)
    store._throttle = Throttle(8, clock=lambda: 0.0)  # its limit stays where a cut puts it
    store._throttle.take_sync()
    store._throttle.refused(0)  # a refusal cut the limit: a hedge would add to the load
    store._throttle.give()
    threading.Timer(0.5, _Stalling.release.set).start()  # well past the delay
    assert bytes(store.read_sync("stall-d")) == b"body of /stall-d"
    assert store.stats().hedged == 0
    assert _Stalling.attempts["/stall-d"] == 1


def test_a_raced_read_that_fails_counts_one_failure_and_names_its_key(stalling: str) -> None:
    store = RemoteStore(stalling, hedge=True)
    _tailed(store, delay=2.0)
    with pytest.raises(RemoteNotFoundError) as info:
        store.read_sync("missing-a")
    assert info.value.key == "missing-a"

    async def main() -> None:
        await store.read("missing-b")

    with pytest.raises(RemoteNotFoundError):
        asyncio.run(main())
    stats = store.stats()
    assert (stats.failures, stats.reads, stats.hedged) == (2, 0, 0)


def test_by_default_read_is_hedged_and_read_sync_is_not(stalling: str) -> None:
    # A race from a thread hands each read to another thread and back: read_sync goes the
    # plain way unless hedge=True (see RemoteStore's hedge).
    store = RemoteStore(stalling)
    _tailed(store)

    async def main() -> bytes:
        return bytes(await store.read("stall-f"))

    assert asyncio.run(main()) == b"body of /stall-f"
    assert (store.stats().hedged, _Stalling.attempts["/stall-f"]) == (1, 2)
    threading.Timer(0.5, _Stalling.release.set).start()  # well past the delay
    assert bytes(store.read_sync("stall-g")) == b"body of /stall-g"
    assert (store.stats().hedged, _Stalling.attempts["/stall-g"]) == (1, 1)
    assert not any(t.name.startswith("feedline-hedges") for t in threading.enumerate())
    with pytest.raises(ConfigurationError, match="hedge"):
        RemoteStore(stalling, hedge="yes")  # type: ignore[arg-type]


def test_local_stores_are_not_hedged(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"local")
    store = RemoteStore(tmp_path.as_uri())
    assert store._hedger is None
    assert bytes(store.read_sync("a")) == b"local"
    assert store.stats().hedge_delay is None


def test_the_race_threads_end_when_idle(stalling: str) -> None:
    store = RemoteStore(stalling, hedge=True)
    _tailed(store)
    _Stalling.release.set()
    store.read_sync("stall-e")  # a race: its threads start
    assert any(t.name.startswith("feedline-hedges") for t in threading.enumerate())
    deadline = time.monotonic() + 10
    while any(t.name.startswith("feedline-hedges") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the race threads stayed on without work"
        time.sleep(0.01)
    assert bytes(store.read_sync("stall-e")) == b"body of /stall-e"  # and start again


class _HedgesLose(Handler):
    """Every first request answers in 50 ms, every second one (a hedge) in 200 ms."""

    attempts: ClassVar[Counter[str]] = Counter()

    def do_GET(self) -> None:
        self.attempts[self.path] += 1
        time.sleep(0.05 if self.attempts[self.path] == 1 else 0.2)
        self.reply(200, b"body of " + self.path.encode())


def test_a_store_whose_hedges_lose_stops_sending_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tail of the client's own making (its cores busy) is no tail a hedge cuts: the first
    # request keeps answering first, and after JUDGED such hedges the store sends no more
    # (each race costs a hand-off between threads).
    monkeypatch.setattr(_hedge, "SHARE", 1.0)  # a hedge for every read
    monkeypatch.setattr(_hedge, "BURST", float(JUDGED))
    _HedgesLose.attempts.clear()
    with serving(_HedgesLose) as url:
        store = RemoteStore(url, hedge=True)
        _tailed(store, delay=0.01)
        # The delay stays as learned: measured again after 32 of these replies (50 and 200
        # ms), it would rise to 50 ms, and the reads that begin after that go unhedged.
        monkeypatch.setattr(_hedge, "_EVERY", 10**6)
        keys = [f"k{i}" for i in range(JUDGED)]
        with ThreadPoolExecutor(8) as pool:
            bodies = list(pool.map(lambda k: bytes(store.read_sync(k)), keys))
        assert bodies == [b"body of /" + k.encode() for k in keys]
        stats = store.stats()
        assert (stats.hedged, stats.hedges_won, stats.reads) == (JUDGED, 0, JUDGED)
        assert stats.hedge_delay is None  # paused
        assert bytes(store.read_sync("after")) == b"body of /after"
        assert store.stats().hedged == JUDGED  # no hedge for it
        assert _HedgesLose.attempts["/after"] == 1
