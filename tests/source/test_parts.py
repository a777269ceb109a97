"""``RemoteStore(part_size="auto")``: parts sized from the latency and rate it measures."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from pathlib import Path

import pytest

from feedline import ConfigurationError, RemoteStore
from feedline.bench._server import ServerProcess
from feedline.source._parts import MAX_PART, MIN_PART, TIMED_BODY, PartSizer

pytest.importorskip("obstore")


def test_sizer_starts_small_and_follows_latency_times_rate() -> None:
    sizer = PartSizer()
    assert sizer.size() == MIN_PART  # nothing measured: the first part times the connection
    sizer.observe(0.1, 1000, 0.001)  # a small body: its time is not the connection's rate
    assert sizer.rate is None
    assert sizer.size() == MIN_PART
    sizer.observe(0.1, 8 << 20, 0.1)  # 80 MiB/s after 100 ms
    assert sizer.size() == int(0.25 * 0.1 * (8 << 20) / 0.1)
    for _ in range(50):  # a faster link, a longer wait: whole objects up to the largest part
        sizer.observe(2.0, 64 << 20, 0.05)
    assert sizer.size() == MAX_PART
    for _ in range(50):  # a slow link
        sizer.observe(0.01, TIMED_BODY, 1.0)
    assert sizer.size() == MIN_PART


def _object(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / "object.bin"
    path.write_bytes(data)
    return path, data


def _sizes_asked(store: RemoteStore) -> list[int]:
    """The part sizes the store's reads take from its sizer, as they ask."""
    sizer = store._sizer
    assert sizer is not None
    real, asked = sizer.size, []

    def size() -> int:
        asked.append(real())
        return asked[-1]

    sizer.size = size  # type: ignore[method-assign]
    return asked


def test_slow_connections_get_small_parts_and_fast_ones_the_object_whole(tmp_path: Path) -> None:
    path, data = _object(tmp_path, 4 << 20)
    # 4 MB/s a connection after 20 ms: parts of L B / 4 = 20 kB, so the smallest, 1 MiB.
    with ServerProcess([path], 0.02, connection_rate=4e6) as server:
        store = RemoteStore(server.url, retries=0, part_size="auto")
        assert bytes(asyncio.run(store.read("0"))) == data
        assert server.served()["gets"] == 4
        stats = store.stats()
        assert stats.part_size == MIN_PART
        assert stats.latency is not None
        assert 0.015 < stats.latency < 1.0
        assert stats.connection_rate is not None
        assert 0 < stats.connection_rate < 5e6  # (a loaded machine's is lower still)
    # No cap, 200 ms: the first MiB times the connection, the rest of the object comes in
    # parts of the size that says (one part where this machine's loopback carries over
    # 63 MB/s; a loaded machine's may not). The rule, from rates given, is the sizer's test.
    with ServerProcess([path], 0.2) as server:
        store = RemoteStore(server.url, retries=0, part_size="auto")
        asked = _sizes_asked(store)
        assert bytes(asyncio.run(store.read("0"))) == data
        first, rest = asked
        assert first == MIN_PART
        assert server.served()["gets"] == 1 + -(-(len(data) - first) // rest)
        # A connection measured fast (640 MB/s): the object whole, in one request.
        assert store._sizer is not None
        for _ in range(30):
            store._sizer.observe(0.2, 64 << 20, 0.1)
        gets = server.served()["gets"]
        assert bytes(asyncio.run(store.read("1"))) == data
        assert server.served()["gets"] == gets + 1


def test_a_store_without_auto_parts_reports_its_fixed_size() -> None:
    assert RemoteStore("memory:///").stats().part_size is None
    assert RemoteStore("memory:///", part_size=1 << 20).stats().part_size == 1 << 20
    stats = RemoteStore("memory:///", part_size="auto").stats()
    assert (stats.part_size, stats.latency, stats.connection_rate) == (MIN_PART, None, None)


@pytest.mark.parametrize("value", ["big", "AUTO", 0, -5, 1.5])
def test_part_size_must_be_bytes_or_auto(value: object) -> None:
    with pytest.raises(ConfigurationError, match="part_size"):
        RemoteStore("memory:///", part_size=value)  # type: ignore[arg-type]


def test_the_bench_server_answers_ranges(tmp_path: Path) -> None:
    path, data = _object(tmp_path, 1000)
    with ServerProcess([path], 0.0) as server:
        request = urllib.request.Request(f"{server.url}/0", headers={"Range": "bytes=10-19"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.status == 206
            assert reply.headers["Content-Range"] == "bytes 10-19/1000"
            assert reply.read() == data[10:20]
        request = urllib.request.Request(f"{server.url}/0", headers={"Range": "bytes=990-"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.read() == data[990:]
        with urllib.request.urlopen(f"{server.url}/0", timeout=30) as reply:
            assert reply.status == 200
            assert reply.read() == data


def test_read_sync_parts_from_many_threads_keep_within_max_in_flight(tmp_path: Path) -> None:
    import threading

    path, data = _object(tmp_path, 2 << 20)
    with ServerProcess([path], 0.01, connection_rate=8e6) as server:
        store = RemoteStore(server.url, retries=0, part_size=256 << 10, max_in_flight=3)
        peak, done = [0], threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], store.stats().in_flight)
                done.wait(0.001)

        def read(i: int) -> None:
            assert bytes(store.read_sync(str(i))) == data

        watcher = threading.Thread(target=watch)
        watcher.start()
        readers = [threading.Thread(target=read, args=(i,)) for i in range(6)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        done.set()
        watcher.join()
    assert 2 <= peak[0] <= 3, peak[0]
    assert server_threads() == []


def server_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("feedline-parts")]


@pytest.mark.parametrize("part", [1024, "auto"])
def test_an_empty_object_read_in_parts_is_empty_not_an_error(tmp_path: Path, part: object) -> None:
    (tmp_path / "empty.bin").write_bytes(b"")
    store = RemoteStore(tmp_path.as_uri(), part_size=part)  # type: ignore[arg-type]
    assert bytes(asyncio.run(store.read("empty.bin"))) == b""
    assert bytes(store.read_sync("empty.bin")) == b""
    assert store.stats().failures == 0


def test_the_bench_server_refuses_ranges_it_cannot_serve(tmp_path: Path) -> None:
    import urllib.error

    path, data = _object(tmp_path, 100)
    with ServerProcess([path], 0.0) as server:
        for asked in ("bytes=100-", "bytes=200-300"):
            request = urllib.request.Request(f"{server.url}/0", headers={"Range": asked})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=30)
            assert info.value.code == 416
        request = urllib.request.Request(f"{server.url}/0", headers={"Range": "bytes=-10"})
        with urllib.request.urlopen(request, timeout=30) as reply:  # still serving
            assert reply.read() == data[-10:]
