"""ObjectCache on its own, and RemoteStore reading through it from a server that counts GETs."""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import pytest

from feedline import ConfigurationError, PipelineBuilder
from feedline.source import ObjectCache

from ._http import Handler, serving

pytest.importorskip("obstore")


HEADER = 12  # bytes before each object in its file: its length and CRC-32


def _files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if not p.name.startswith(".")]


def _payload(directory: Path) -> int:
    return sum(p.stat().st_size - HEADER for p in _files(directory))


def test_memory_tier_keeps_the_most_recently_used_within_its_budget() -> None:
    cache = ObjectCache(memory_bytes=250)
    for key in "abc":
        cache.put(key, key.encode() * 100)
    # 300 bytes do not fit in 250: "a", the oldest, went
    assert cache.get("a") is None
    assert cache.get("b") == b"b" * 100
    cache.put("d", b"d" * 100)  # "c" is now the least recently used
    assert cache.get("c") is None
    assert cache.get("b") is not None
    s = cache.stats()
    assert (s.memory_hits, s.misses, s.evictions, s.memory_bytes) == (2, 2, 2, 200)


def test_an_object_larger_than_the_budget_is_not_kept_and_evicts_nothing() -> None:
    cache = ObjectCache(memory_bytes=100)
    cache.put("small", b"x" * 60)
    cache.put("big", b"y" * 101)
    assert cache.get("big") is None
    assert cache.get("small") == b"x" * 60
    assert cache.stats().evictions == 0


def test_disk_tier_survives_a_new_cache_and_keeps_its_budget(tmp_path: Path) -> None:
    first = ObjectCache(memory_bytes=0, directory=tmp_path, disk_bytes=350)
    for i in range(5):
        first.put(f"k{i}", bytes([i]) * 100)
    files = _files(tmp_path)
    assert len(files) == 3  # 3 x 100 bytes within 350; the two oldest deleted
    assert first.stats().disk_bytes == 300
    assert first.get("k0") is None
    assert first.get("k4") == bytes([4]) * 100

    second = ObjectCache(memory_bytes=1000, directory=tmp_path, disk_bytes=350)
    assert second.stats().disk_bytes == 300
    assert second.get("k2") == bytes([2]) * 100  # from disk
    assert second.get("k2") == bytes([2]) * 100  # now from memory
    s = second.stats()
    assert (s.disk_hits, s.memory_hits) == (1, 1)
    smaller = ObjectCache(memory_bytes=0, directory=tmp_path, disk_bytes=150)
    assert smaller.stats().disk_bytes == 100  # trimmed to its own budget on start
    assert len(_files(tmp_path)) == 1


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:-3],  # cut short
        lambda b: bytes(len(b)),  # zeroed, as a power loss can leave an unsynced file
        lambda b: b[:-1] + bytes([b[-1] ^ 1]),  # one bit flipped
    ],
)
def test_a_damaged_file_is_dropped_not_returned(tmp_path: Path, damage: Any) -> None:
    cache = ObjectCache(memory_bytes=0, directory=tmp_path)
    cache.put("k", b"0123456789")
    (path,) = _files(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    fresh = ObjectCache(memory_bytes=0, directory=tmp_path)
    assert fresh.get("k") is None
    assert not path.exists()
    assert fresh.stats().disk_bytes == 0


def test_stray_and_stale_files_are_told_apart(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / ("z" * 64)).write_text("not ours either: not a hex name")
    stale, fresh = tmp_path / ".partial-old", tmp_path / ".partial-new"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"being written")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    cache = ObjectCache(memory_bytes=0, directory=tmp_path, disk_bytes=0)
    cache.put("k", b"data")  # larger than a zero budget: not written
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".partial-new", "notes.txt", "z" * 64]  # the stale partial file went


def test_many_threads_share_one_cache_and_keep_its_books(tmp_path: Path) -> None:
    # Small budgets and mixed sizes, so that evictions race with reads and rewrites.
    cache = ObjectCache(memory_bytes=2_000, directory=tmp_path, disk_bytes=6_000)

    def data(k: int) -> bytes:
        return bytes([k]) * (50 + 37 * k)

    def work(i: int) -> bool:
        k = (i * 7) % 40
        got = cache.get(f"k{k}")
        if got is None:
            cache.put(f"k{k}", data(k))
            return True
        return got == data(k)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(3000)))
    s = cache.stats()
    assert s.evictions > 0
    assert s.memory_bytes <= 2_000
    assert s.disk_bytes <= 6_000
    assert _payload(tmp_path) == s.disk_bytes  # the index agrees with the directory


def test_a_file_another_process_wrote_is_found_and_counted(tmp_path: Path) -> None:
    mine = ObjectCache(memory_bytes=0, directory=tmp_path)
    theirs = ObjectCache(memory_bytes=0, directory=tmp_path)  # as another worker's copy
    theirs.put("k", b"x" * 300)
    assert mine.file_size("k") == 300  # not in its index: asked the file system
    assert mine.get("k") == b"x" * 300
    theirs.put("k", b"y" * 50)  # replaced under mine's feet
    assert mine.get("k") == b"y" * 50
    assert mine.stats().disk_bytes == 50 == _payload(tmp_path)
    assert mine.file_size("nothing") is None


def test_an_object_too_big_to_keep_still_replaces_the_old_one(tmp_path: Path) -> None:
    cache = ObjectCache(memory_bytes=100, directory=tmp_path, disk_bytes=100)
    cache.put("k", b"old")
    cache.put("k", b"n" * 500)
    assert cache.get("k") is None
    assert _files(tmp_path) == []
    assert cache.stats().disk_bytes == cache.stats().memory_bytes == 0


def test_a_vanished_directory_makes_writes_no_ops_not_errors(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    cache = ObjectCache(memory_bytes=0, directory=directory)
    directory.rmdir()
    cache.put("k", b"data")  # best effort: nothing raised, nothing kept
    assert cache.get("k") is None


def test_pickled_cache_shares_the_directory_not_the_memory(tmp_path: Path) -> None:
    cache = ObjectCache(memory_bytes=1000, directory=tmp_path)
    cache.put("k", b"v")
    clone = pickle.loads(pickle.dumps(cache))
    assert clone.stats().memory_bytes == 0
    assert clone.get("k") == b"v"


def test_bad_budgets_say_what_to_pass() -> None:
    with pytest.raises(ConfigurationError, match="memory_bytes"):
        ObjectCache(memory_bytes=-1)
    with pytest.raises(ConfigurationError, match="disk_bytes"):
        ObjectCache(disk_bytes=1.5)  # type: ignore[arg-type]


# -- through RemoteStore -------------------------------------------------------------------------


def _body(path: str) -> bytes:
    # "/big..." objects are larger than what an event loop reads from the cache itself
    return path.encode() * (60_000 if path.startswith("/big") else 50)


class _Counting(Handler):
    gets: ClassVar[Counter[str]] = Counter()

    def do_GET(self) -> None:
        self.gets[self.path] += 1
        body = _body(self.path)
        asked = self.headers.get("Range")  # "bytes=first-last", as obstore sends it
        if not asked:
            self.reply(200, body)
            return
        first, last = (int(v) for v in asked.removeprefix("bytes=").split("-"))
        span = {"Content-Range": f"bytes {first}-{last}/{len(body)}"}
        self.reply(206, body[first : last + 1], span)


@pytest.fixture
def server() -> Iterator[str]:
    _Counting.gets.clear()
    with serving(_Counting) as url:
        yield url


def test_second_epoch_is_served_from_the_cache(server: str, tmp_path: Path) -> None:
    from feedline import RemoteStore

    store = RemoteStore(server, cache=ObjectCache(memory_bytes=10_000, directory=tmp_path))
    keys = [f"obj{i}" for i in range(30)]

    def epoch() -> list[bytes]:
        p = (
            PipelineBuilder()
            .add_source(keys)
            .pipe(store.read, concurrency=8, output_order="input")
            .pipe(bytes)
            .build()
        )
        return list(p)

    first, second = epoch(), epoch()
    assert first == second == [_body(f"/{k}") for k in keys]
    assert sum(_Counting.gets.values()) == 30  # one GET per object, all in the first epoch
    s = store.stats()
    assert (s.reads, s.cache_hits) == (30, 30)
    assert len(_files(tmp_path)) == 30

    # A new store (another process, a restart) finds them on disk, also with read_sync.
    again = RemoteStore(server, cache=ObjectCache(memory_bytes=0, directory=tmp_path))
    assert bytes(again.read_sync("obj3")) == b"/obj3" * 50
    assert bytes(asyncio.run(again.read("obj4"))) == b"/obj4" * 50
    assert sum(_Counting.gets.values()) == 30
    # byte ranges bypass the cache
    assert bytes(again.read_sync("obj3", start=0, end=5)) == b"/obj3"
    assert _Counting.gets["/obj3"] == 2


class _Recording(ObjectCache):
    """Notes which threads read its files (its memory tier is empty: every hit is a file)."""

    threads: ClassVar[set[str]] = set()

    def get(self, key: str) -> bytes | None:
        data = super().get(key)
        if data is not None:  # a file was read (misses read nothing)
            self.threads.add(threading.current_thread().name)
        return data


def test_stores_sharing_a_cache_each_get_their_own_objects(server: str, tmp_path: Path) -> None:
    # train/ and val/ both hold "x": one cache (in memory, then on disk for new stores)
    # must never answer one store's read with the other's object.
    from feedline import RemoteStore

    cache = ObjectCache(memory_bytes=10_000, directory=tmp_path)
    train, val = (RemoteStore(f"{server}/{part}", cache=cache) for part in ("train", "val"))
    assert bytes(train.read_sync("x")) == _body("/train/x")
    assert bytes(val.read_sync("x")) == _body("/val/x")
    assert bytes(asyncio.run(val.read("x"))) == _body("/val/x")
    assert sum(_Counting.gets.values()) == 2
    fresh = ObjectCache(memory_bytes=0, directory=tmp_path)
    for part in ("val", "train"):
        store = RemoteStore(f"{server}/{part}", cache=fresh)
        assert bytes(store.read_sync("x")) == _body(f"/{part}/x")
        assert store.stats().cache_hits == 1
    assert sum(_Counting.gets.values()) == 2


def test_large_objects_are_cached_through_a_thread(server: str, tmp_path: Path) -> None:
    from feedline import RemoteStore

    _Recording.threads.clear()
    store = RemoteStore(server, cache=_Recording(memory_bytes=0, directory=tmp_path))
    keys = [f"big{i}" for i in range(6)]

    def epoch() -> list[bytes]:
        p = PipelineBuilder().add_source(keys).pipe(store.read, concurrency=3).pipe(bytes).build()
        return sorted(p)

    first = epoch()
    deadline = time.monotonic() + 10  # the writes finish in a thread, after the reads
    while len(_files(tmp_path)) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert epoch() == first == sorted(_body(f"/{k}") for k in keys)
    assert len(first[0]) > 256 << 10
    assert sum(_Counting.gets.values()) == 6
    assert store.stats().cache_hits == 6
    assert _Recording.threads  # the second epoch read the files...
    assert "feedline-event-loop" not in _Recording.threads  # ...never on the event loop


def test_a_store_takes_only_an_object_cache() -> None:
    from feedline import RemoteStore

    with pytest.raises(ConfigurationError, match="takes an ObjectCache"):
        RemoteStore("memory:///", cache={})  # type: ignore[arg-type]
