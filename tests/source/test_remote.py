"""RemoteStore against real servers on loopback: moto's S3 and a small HTTP server that fails."""

from __future__ import annotations

import _thread
import asyncio
import errno
import pickle
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest

from feedline import (
    ConfigurationError,
    PathList,
    PipelineBuilder,
    PipelineFailure,
    RemoteNotFoundError,
    RemoteReadError,
    RemoteStore,
)
from feedline.source import RemoteStats

from .._system import starts_processes
from ._http import Handler, serving

pytest.importorskip("obstore")
moto_server = pytest.importorskip("moto.server")

from ._s3 import BUCKET, CREDENTIALS, _body  # noqa: E402


def _store(endpoint: str, **kwargs: Any) -> RemoteStore:
    return RemoteStore(f"s3://{BUCKET}/data", endpoint=endpoint, **CREDENTIALS, **kwargs)


def test_async_stage_reads_every_object_in_order(s3: str) -> None:
    store = _store(s3)
    p = (
        PipelineBuilder()
        .add_source(str(i) for i in range(40))
        .pipe(store.read, concurrency=16, output_order="input")
        .pipe(bytes)
        .build()
    )
    assert list(p) == [_body(i) for i in range(40)]
    stats = store.stats()
    assert (stats.reads, stats.failures, stats.in_flight) == (40, 0, 0)
    assert stats.bytes == sum(len(_body(i)) for i in range(40))


def test_read_sync_and_byte_ranges(s3: str) -> None:
    store = _store(s3)
    assert bytes(store.read_sync("7")) == _body(7)
    assert bytes(store.read_sync("7", start=10, end=50)) == _body(7)[10:50]
    assert bytes(asyncio.run(store.read("7", start=100))) == _body(7)[100:]
    assert bytes(asyncio.run(store.read("7", end=5))) == _body(7)[:5]
    with pytest.raises(ValueError, match="0 <= start < end"):
        store.read_sync("7", start=5, end=5)


def test_reads_from_many_threads_share_one_store(s3: str) -> None:
    store = _store(s3, max_in_flight=3)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: bytes(store.read_sync(str(i))), range(40)))
    assert got == [_body(i) for i in range(40)]
    assert store.stats().in_flight == 0


def test_missing_object_is_skipped_and_named_then_the_budget_raises(s3: str) -> None:
    store = _store(s3)
    keys = ["1", "missing-a", "2", "missing-b", "3"]
    ok = PipelineBuilder().add_source(keys).pipe(store.read, name="read").build(max_failures=2)
    assert [bytes(b) for b in ok] == [_body(1), _body(2), _body(3)]
    assert store.stats().failures == 2

    strict = PipelineBuilder().add_source(keys).pipe(store.read, name="read").build(max_failures=1)
    with pytest.raises(PipelineFailure) as info:
        list(strict)
    assert info.value.stage == "read"
    assert info.value.sample is not None
    assert "missing-b" in info.value.sample
    assert isinstance(info.value.last_error, RemoteNotFoundError)
    assert isinstance(info.value.last_error, FileNotFoundError)
    assert info.value.last_error.key == "missing-b"
    assert "Check the key" in str(info.value.last_error)


def test_plain_http_endpoint_is_found_wherever_it_is_given(s3: str) -> None:
    store = RemoteStore(
        f"s3://{BUCKET}/data",
        config={"aws_endpoint": s3, "aws_access_key_id": "test", "aws_secret_access_key": "x"},
        region="us-east-1",
    )
    assert bytes(store.read_sync("4")) == _body(4)


def test_store_pickles_for_worker_processes(s3: str) -> None:
    store = _store(s3, retries=2)
    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == store.url
    assert clone.retries == 2
    assert bytes(clone.read_sync("3")) == _body(3)


class RemoteHeads:
    """``dataset[i]``: the first 16 bytes of object ``i``, read with ``read_sync``."""

    def __init__(self, store: RemoteStore, n: int) -> None:
        self.store, self.n = store, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.frombuffer(self.store.read_sync(str(i), end=16), np.uint8).copy()


@starts_processes
def test_dataloader_workers_read_through_their_own_copy_of_the_store(s3: str) -> None:
    pytest.importorskip("torch")
    from feedline import DataLoader

    loader = DataLoader(RemoteHeads(_store(s3), 40), batch_size=8, num_workers=2)
    got = np.concatenate([b.numpy() for b in loader])
    assert got.tolist() == [list(_body(i)[:16]) for i in range(40)]


def test_local_files_through_the_same_interface(tmp_path: Any) -> None:
    (tmp_path / "a.bin").write_bytes(b"local bytes")
    store = RemoteStore(tmp_path.as_uri())
    assert bytes(store.read_sync("a.bin")) == b"local bytes"
    with pytest.raises(RemoteNotFoundError, match=r"no object 'b\.bin'") as info:
        store.read_sync("b.bin")
    assert info.value.errno == errno.ENOENT  # as code that checks a FileNotFoundError expects
    assert info.value.filename == "b.bin"


def test_keys_lists_a_bucket_sorted_relative_to_the_url(s3: str) -> None:
    store = _store(s3)
    keys = store.keys()
    assert isinstance(keys, PathList)
    assert list(keys) == sorted(str(i) for i in range(40))  # "0", "1", "10", ...
    assert list(store.keys(suffix="9")) == ["19", "29", "39", "9"]
    assert list(store.keys(suffix=("1", "2"))) == ["1", "11", "12", "2", "21", "22", "31", "32"]
    root = RemoteStore(f"s3://{BUCKET}", endpoint=s3, **CREDENTIALS)
    assert list(root.keys("data"))[:3] == ["data/0", "data/1", "data/10"]
    assert len(root.keys("dat")) == 0  # prefixes match whole segments
    assert bytes(store.read_sync(keys[5])) == _body(int(keys[5]))  # what read takes


def test_keys_of_local_files_are_sorted_and_filtered(tmp_path: Any) -> None:
    for name in ("b/2.jpg", "b/1.png", "a.jpg", "c/d/e.jpg", "notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    store = RemoteStore(tmp_path.as_uri())
    assert list(store.keys()) == ["a.jpg", "b/1.png", "b/2.jpg", "c/d/e.jpg", "notes.txt"]
    assert list(store.keys(suffix=(".jpg", ".png"))) == ["a.jpg", "b/1.png", "b/2.jpg", "c/d/e.jpg"]
    assert list(store.keys("b")) == ["b/1.png", "b/2.jpg"]
    assert len(store.keys("nothing-here")) == 0
    with pytest.raises(TypeError, match="tuple of str"):
        store.keys(suffix=[".jpg"])  # type: ignore[arg-type]


def test_a_listing_that_fails_names_the_store_and_the_prefix(s3: str) -> None:
    store = RemoteStore("s3://no-such-bucket/x", endpoint=s3, **CREDENTIALS, retries=0)
    with pytest.raises(
        RemoteReadError, match=r"listing keys under 'train' from s3://no-such-bucket"
    ) as info:
        store.keys("train")
    assert store.stats().failures == 1
    # S3's XML error body comes out as its code and message, on one line.
    message = str(info.value)
    assert "HTTP 404 Not Found: NoSuchBucket: " in message
    assert "<" not in message
    assert "\n" not in message


def test_a_missing_bucket_is_named_as_such_in_one_line(s3: str) -> None:
    store = RemoteStore("s3://no-such-bucket/x", endpoint=s3, **CREDENTIALS)
    calls = {
        "keys": store.keys,
        "read_sync": lambda: store.read_sync("k"),
        "read": lambda: asyncio.run(store.read("k")),
    }
    for name, call in calls.items():
        with pytest.raises(RemoteReadError) as info:
            call()
        message = str(info.value)
        assert f"The bucket 'no-such-bucket' does not exist at {s3} (not retried)" in message
        assert "HTTP 404 Not Found: NoSuchBucket: " in message  # the server's words
        for wrong in ("raise timeout=", "Check the key", "Debug source", "\n"):
            assert wrong not in message, (name, wrong)
        assert "Debug source" in str(info.value.__cause__)  # obstore's whole text stays there
        assert isinstance(info.value, FileNotFoundError) == (name != "keys")
    assert store.stats().failures == 3


def test_no_server_at_the_endpoint_says_to_check_the_endpoint() -> None:
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))  # bound, not listening: every connection is refused
        endpoint = f"http://127.0.0.1:{bound.getsockname()[1]}"
        store = _store(endpoint, retries=1, backoff=0.01)
        for call in (store.keys, lambda: store.read_sync("1")):
            with pytest.raises(RemoteReadError) as info:
                call()
            message = str(info.value)
            assert "(no connection: tcp connect error: Connection refused, after 1 retry)" in (
                message
            )
            assert f"Nothing accepted a connection at {endpoint}: check the endpoint" in message
            assert "raise timeout=" not in message
            assert "\n" not in message


class _Resetting(Handler):
    """Sends the headers and a few bytes of the body, then resets the connection."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"a" * 10)
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True


def test_a_connection_reset_mid_body_is_retried_and_said_so() -> None:
    with serving(_Resetting) as url:
        store = RemoteStore(url, retries=1, backoff=0.01)
        with pytest.raises(RemoteReadError) as info:
            store.read_sync("k")
    message = str(info.value)
    assert "(the connection was reset, after 1 retry)" in message
    assert "Nothing accepted a connection" not in message
    assert store.stats().retried == 1


class _Refusing(Handler):
    """An S3 endpoint that refuses every request's credentials, as AWS does a wrong key."""

    def do_GET(self) -> None:
        body = (
            b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
            b"<Message>The AWS Access Key Id you provided does not exist in our records."
            b"</Message></Error>"
        )
        self.reply(403, body, {"Content-Type": "application/xml"})


def test_a_refused_credential_says_to_check_the_credentials() -> None:
    with serving(_Refusing) as endpoint:
        store = _store(endpoint, retries=2, backoff=0.01)
        for call in (store.keys, lambda: store.read_sync("1")):  # a listing is no exception
            with pytest.raises(RemoteReadError) as info:
                call()
            message = str(info.value)
            assert "(HTTP 403 Forbidden: InvalidAccessKeyId: The AWS Access Key Id" in message
            assert "The store refused the request (not retried): check the credentials" in (message)
            assert "raise timeout=" not in message


def test_error_descriptions_keep_status_retries_and_the_servers_words() -> None:
    from feedline.source._failures import describe as _describe

    xml = (
        "Generic S3 error: Error performing GET http://x/b/k in 5ms, after 3 retries, "
        "max_retries: 3 - Server returned non-2xx status code: 403 Forbidden: <?xml "
        'version="1.0"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message>'
        "<RequestId>1</RequestId></Error>\n\nDebug source:\nGeneric {\n}"
    )
    assert _describe(OSError(xml)) == "HTTP 403 Forbidden: AccessDenied: Access Denied, " + (
        "after 3 retries"
    )
    long = "word " * 200
    described = _describe(ValueError(long + "\nDebug source: ..."))
    assert described.startswith("ValueError: word word")
    assert described.endswith("word ...")  # cut between words, and marked
    assert len(described) < 320


# -- a server that fails -----------------------------------------------------------------------


class _Flaky(Handler):
    """``/flaky-*`` fails twice (503) then answers, ``/down*`` always fails, ``/slow*`` stalls."""

    attempts: ClassVar[Counter[str]] = Counter()
    release: ClassVar[threading.Event] = threading.Event()

    def do_GET(self) -> None:
        self.attempts[self.path] += 1
        if self.path.startswith("/down") or (
            self.path.startswith("/flaky") and self.attempts[self.path] <= 2
        ):
            self.reply(503, b"try later")
        elif self.path.startswith("/slow"):
            self.release.wait(10)
            self.reply(200, b"late")
        else:
            self.reply(200, b"ok:" + self.path.encode())


@pytest.fixture
def flaky() -> Iterator[str]:
    _Flaky.attempts.clear()
    _Flaky.release.clear()
    with serving(_Flaky, before_stop=_Flaky.release.set) as url:
        yield url


def test_server_errors_are_retried_until_the_read_succeeds(flaky: str) -> None:
    store = RemoteStore(flaky, retries=3, backoff=0.01)
    assert bytes(store.read_sync("flaky-1")) == b"ok:/flaky-1"
    assert bytes(asyncio.run(store.read("flaky-2"))) == b"ok:/flaky-2"
    assert _Flaky.attempts["/flaky-1"] == 3  # two failures, then the answer
    assert _Flaky.attempts["/flaky-2"] == 3


def test_a_server_that_stays_down_gives_an_error_naming_key_and_retries(flaky: str) -> None:
    store = RemoteStore(flaky, retries=2, backoff=0.01)
    with pytest.raises(RemoteReadError) as info:
        store.read_sync("down")
    assert not isinstance(info.value, FileNotFoundError)
    assert info.value.key == "down"
    assert "retried up to 2 time(s)" in str(info.value)
    assert _Flaky.attempts["/down"] == 3
    # One line: the key, the status, the server's words; obstore's debug dump stays in the
    # __cause__.
    message = str(info.value)
    assert "\n" not in message
    assert "reading 'down' from" in message
    assert "(HTTP 503 Service Unavailable: try later, after 2 retries)" in message
    assert "Debug source" in str(info.value.__cause__)
    assert store.stats().failures == 1


class _Chunked(Handler):
    """Every reply chunked, without a Content-Length (a server that compresses on the fly)."""

    attempts: ClassVar[Counter[str]] = Counter()
    protocol_version = "HTTP/1.1"  # chunked replies are HTTP/1.1's

    def do_GET(self) -> None:
        self.attempts[self.path] += 1
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")  # no thread left waiting on the connection
        self.end_headers()
        self.wfile.write(b"5\r\nhello\r\n0\r\n\r\n")
        self.close_connection = True


def test_a_chunked_reply_is_named_at_once_not_retried() -> None:
    _Chunked.attempts.clear()
    with serving(_Chunked) as url:
        store = RemoteStore(url, retries=3, backoff=0.2)
        with pytest.raises(RemoteReadError, match="without a Content-Length") as info:
            store.read_sync("a")
        assert "serve the objects as static files" in str(info.value)
        with pytest.raises(RemoteReadError, match="not retried"):
            asyncio.run(store.read("b"))
    assert (_Chunked.attempts["/a"], _Chunked.attempts["/b"]) == (1, 1)
    assert store.stats().failures == 2


def test_no_retries_means_one_attempt(flaky: str) -> None:
    store = RemoteStore(flaky, retries=0)
    with pytest.raises(RemoteReadError):
        store.read_sync("flaky-3")
    assert _Flaky.attempts["/flaky-3"] == 1


def test_ctrl_c_during_read_sync_on_the_main_thread_comes_at_once(flaky: str) -> None:
    # The request blocks in obstore's native code; the main thread waits for it on a thread
    # of its own, so the interrupt is raised at once, not when the 10 s stall ends.
    assert threading.current_thread() is threading.main_thread()
    store = RemoteStore(flaky, retries=0)
    threading.Timer(0.3, _thread.interrupt_main).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        store.read_sync("slow-interrupted")
    assert time.monotonic() - t0 < 3
    _Flaky.release.set()
    assert bytes(store.read_sync("after")) == b"ok:/after"  # the store goes on


def test_a_stalled_read_times_out(flaky: str) -> None:
    store = RemoteStore(flaky, timeout=0.3, retries=0)
    t0 = time.monotonic()
    with pytest.raises(RemoteReadError, match=r"timed out\].*raise timeout="):
        asyncio.run(store.read("slow"))
    assert time.monotonic() - t0 < 9  # well before the server's own 10 s stall ends


def test_a_whole_request_limit_applies_when_asked_for(flaky: str) -> None:
    store = RemoteStore(flaky, timeout=20, request_timeout=0.3, retries=0)
    with pytest.raises(RemoteReadError, match=r"timed out\]"):
        store.read_sync("slow")


def test_a_cancelled_read_is_not_left_counted_in_flight(flaky: str) -> None:
    store = RemoteStore(flaky, timeout=20)

    async def main() -> None:
        task = asyncio.ensure_future(store.read("slow"))
        while store.stats().in_flight == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert store.stats() == RemoteStats(
        reads=0, bytes=0, failures=0, in_flight=0, in_flight_limit=256
    )


def test_in_flight_reads_are_capped_in_the_process(flaky: str) -> None:
    store = RemoteStore(flaky, max_in_flight=2, timeout=20)
    peak = 0

    async def main() -> list[bytes]:
        nonlocal peak
        peak = 0
        _Flaky.release.clear()

        async def watch() -> None:
            nonlocal peak
            while not _Flaky.release.is_set():
                peak = max(peak, store.stats().in_flight)
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        # Five keys: reads of one key would share one request (see the next tests).
        reads = [asyncio.ensure_future(store.read(f"slow-{i}")) for i in range(5)]
        await asyncio.sleep(0.3)
        _Flaky.release.set()
        got = await asyncio.gather(*reads)
        await watcher
        return [bytes(g) for g in got]

    assert asyncio.run(main()) == [b"late"] * 5
    assert peak == 2
    # A second event loop, as the next pipeline run has, shares the limit with the first
    # (closed) one, and with read_sync's threads.
    _Flaky.release.clear()
    from_threads: list[bytes] = []
    threads = [
        threading.Thread(
            target=lambda i=i: from_threads.append(bytes(store.read_sync(f"slow-t{i}")))
        )
        for i in range(3)
    ]
    for thread in threads:
        thread.start()
    assert asyncio.run(main()) == [b"late"] * 5
    for thread in threads:
        thread.join(10)
    assert peak == 2
    assert from_threads == [b"late"] * 3
    assert len(store._loops) == 1  # the first loop went when the second one read


async def _until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.005)


def test_concurrent_reads_of_one_key_share_one_request(flaky: str) -> None:
    store = RemoteStore(flaky, timeout=20)

    async def main() -> list[bytes]:
        reads = [asyncio.ensure_future(store.read("slow-a")) for _ in range(5)]
        await _until(lambda: store.stats().in_flight == 1)
        await asyncio.sleep(0.05)  # the other four are waiting, not sending
        _Flaky.release.set()
        views = await asyncio.gather(*reads)
        # Each reader has a view of its own: one released breaks no other.
        views[0].release()
        return [bytes(v) for v in views[1:]]

    assert asyncio.run(main()) == [b"late"] * 4
    assert _Flaky.attempts["/slow-a"] == 1
    assert store.stats() == RemoteStats(
        reads=1, bytes=4, failures=0, in_flight=0, cache_hits=0, joined=4, in_flight_limit=256
    )
    assert not store._loop_flights

    # The same across threads for read_sync.
    _Flaky.release.clear()
    got: list[bytes] = []

    def read() -> None:
        got.append(bytes(store.read_sync("slow-b")))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until one reads and three wait for it
        flight = store._thread_flights.get("slow-b")
        if flight is not None and flight.waiters == 3:
            break
        time.sleep(0.005)
    _Flaky.release.set()
    for t in threads:
        t.join(10)
    assert got == [b"late"] * 4
    assert _Flaky.attempts["/slow-b"] == 1
    assert store.stats().joined == 4 + 3
    assert not store._thread_flights


def test_a_shared_read_survives_its_first_reader_being_cancelled(flaky: str) -> None:
    store = RemoteStore(flaky, timeout=20)

    async def main() -> list[bytes]:
        first = asyncio.ensure_future(store.read("slow-c"))
        await _until(lambda: store.stats().in_flight == 1)
        others = [asyncio.ensure_future(store.read("slow-c")) for _ in range(3)]
        await asyncio.sleep(0.05)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await _until(lambda: store.stats().in_flight == 1)  # one of the others took over
        _Flaky.release.set()
        return [bytes(v) for v in await asyncio.gather(*others)]

    assert asyncio.run(main()) == [b"late"] * 3
    assert _Flaky.attempts["/slow-c"] == 2
    assert (store.stats().reads, store.stats().joined, store.stats().in_flight) == (1, 2, 0)


def test_a_reader_arriving_while_the_cache_fills_joins_the_read(flaky: str) -> None:
    from feedline.source import ObjectCache

    class SlowCache(ObjectCache):
        """Holds each put until released: the first reader is filling the cache."""

        entered = threading.Event()
        go_on = threading.Event()

        def put(self, key: str, data: Any) -> None:
            self.entered.set()
            self.go_on.wait(10)
            super().put(key, data)

    _Flaky.release.set()  # the server answers at once
    store = RemoteStore(flaky, cache=SlowCache(memory_bytes=1 << 20))
    first = threading.Thread(target=store.read_sync, args=("slow-d",))
    first.start()
    assert SlowCache.entered.wait(10)
    assert bytes(store.read_sync("slow-d")) == b"late"  # neither the cache nor a second GET
    SlowCache.go_on.set()
    first.join(10)
    assert _Flaky.attempts["/slow-d"] == 1
    assert store.stats().joined == 1
    assert bytes(store.read_sync("slow-d")) == b"late"  # now from the cache
    assert store.stats().cache_hits == 1


def _late_after_miss_cache(memory_bytes: int) -> Any:
    """An ObjectCache whose first miss waits until released: the reader that missed is
    overtaken by a whole read of the same key, which fills the cache and ends."""
    from feedline.source import ObjectCache

    class Cache(ObjectCache):
        missed = threading.Event()
        go_on = threading.Event()
        first = True

        def get(self, key: str) -> bytes | None:
            data = super().get(key)
            if data is None and Cache.first:
                Cache.first = False
                Cache.missed.set()
                Cache.go_on.wait(10)
            return data

        def file_size(self, key: str) -> int | None:
            return None  # so that read() calls get() on the event loop

    return Cache(memory_bytes=memory_bytes)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_reader_overtaken_after_its_miss_takes_the_cached_result(flaky: str, mode: str) -> None:
    _Flaky.release.set()
    cache = _late_after_miss_cache(1 << 20)
    store = RemoteStore(flaky, cache=cache)
    got: list[bytes] = []

    def late_reader() -> None:
        if mode == "sync":
            got.append(bytes(store.read_sync("slow-e")))
        else:
            got.append(bytes(asyncio.run(store.read("slow-e"))))

    late = threading.Thread(target=late_reader)
    late.start()
    assert cache.missed.wait(10)
    assert bytes(store.read_sync("slow-e")) == b"late"  # the whole read, cache filled
    cache.go_on.set()
    late.join(10)
    assert got == [b"late"]
    assert _Flaky.attempts["/slow-e"] == 1  # the late reader sent no second GET
    stats = store.stats()
    assert (stats.reads, stats.cache_hits, stats.joined) == (1, 1, 0)


def test_a_shared_read_shares_its_error(flaky: str) -> None:
    store = RemoteStore(flaky, retries=1, backoff=0.2)

    async def main() -> list[BaseException]:
        reads = [asyncio.ensure_future(store.read("down-a")) for _ in range(3)]
        return await asyncio.gather(*reads, return_exceptions=True)

    errors = asyncio.run(main())
    assert all(isinstance(e, RemoteReadError) and e.key == "down-a" for e in errors)
    assert len({id(e) for e in errors}) == 3  # copies: one traceback each
    assert len({str(e) for e in errors}) == 1
    assert _Flaky.attempts["/down-a"] == 2  # one read, retried once
    assert (store.stats().failures, store.stats().joined) == (1, 2)


def test_bad_arguments_say_what_to_pass() -> None:
    with pytest.raises(ConfigurationError, match="must be a URL"):
        RemoteStore("bucket/prefix")
    with pytest.raises(ConfigurationError, match="max_in_flight"):
        RemoteStore("memory:///", max_in_flight=0)
    with pytest.raises(ConfigurationError, match="timeout"):
        RemoteStore("memory:///", timeout=-1)
    with pytest.raises(ConfigurationError, match="retries"):
        RemoteStore("memory:///", retries=-1)
    with pytest.raises(ConfigurationError, match="obstore could not open"):
        RemoteStore("nosuch://x")
    with pytest.raises(ConfigurationError, match="'nosuch' is not valid for store 'S3'") as info:
        RemoteStore("s3://bucket/x", nosuch=1)
    assert "\n" not in str(info.value)  # obstore's debug dump stays in the __cause__
    assert "Debug source" in str(info.value.__cause__)


def test_missing_obstore_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)
    with pytest.raises(ImportError, match=r"feedline\[remote\]"):
        RemoteStore("memory:///")


def test_a_range_past_the_end_is_not_blamed_on_a_slow_store(s3: str, tmp_path: Any) -> None:
    (tmp_path / "a.bin").write_bytes(b"0123456789")
    local = RemoteStore(tmp_path.as_uri())
    for store, key in ((local, "a.bin"), (_store(s3), "7")):
        with pytest.raises(RemoteReadError) as info:
            store.read_sync(key, start=10**9)
        assert "raise timeout=" not in str(info.value)
        assert "The request itself is wrong" in str(info.value)


def test_a_large_object_is_read_in_parallel_parts_and_checked_whole() -> None:
    from ._s3 import moto_bucket

    big = np.random.default_rng(5).integers(0, 256, 3_000_000 + 123, dtype=np.uint8).tobytes()
    objects = {"data/big": big, "data/small": big[:1000]}
    with moto_bucket(BUCKET, objects) as (endpoint, counts):
        store = _store(endpoint, part_size=1 << 20)
        assert bytes(asyncio.run(store.read("big"))) == big
        assert counts["GET"] == 3  # 1 MiB, then the other two parts at once
        assert bytes(asyncio.run(store.read("small"))) == big[:1000]
        assert counts["GET"] == 4  # smaller than a part: one request
        stats = store.stats()
        assert stats.verified == 2  # each object's MD5 against its ETag, over the whole
        assert (stats.reads, stats.bytes) == (2, len(big) + 1000)  # a read, not its parts
        # A range read is one request, parts or not; read_sync reads whole objects in parts.
        assert bytes(asyncio.run(store.read("big", start=5, end=3_000_000))) == big[5:3_000_000]
        assert counts["GET"] == 5
        assert bytes(store.read_sync("big")) == big
        assert counts["GET"] == 8
        stats = store.stats()
        assert (stats.verified, stats.reads) == (3, 4)
        assert stats.bytes == 2 * len(big) + 1000 + 3_000_000 - 5


def test_read_sync_called_on_an_event_loop_still_reads_in_parts() -> None:
    from ._s3 import moto_bucket

    big = np.random.default_rng(6).integers(0, 256, 3_000_000, dtype=np.uint8).tobytes()
    with moto_bucket(BUCKET, {"data/big": big}) as (endpoint, counts):
        store = _store(endpoint, part_size=1 << 20)

        async def blocking() -> bytes:  # blocks its loop; the parts go on threads
            return bytes(store.read_sync("big"))

        assert asyncio.run(blocking()) == big
        assert counts["GET"] == 3


def test_part_size_must_be_a_positive_int() -> None:
    with pytest.raises(ConfigurationError, match="part_size"):
        RemoteStore("memory:///", part_size=0)


class _FalseTotal(Handler):
    """Byte ranges of a 6 KB object, each reply claiming a 16 GiB object."""

    served: ClassVar[Counter[str]] = Counter()

    def do_GET(self) -> None:
        self.served[self.path] += 1
        body = bytes(6000)
        first, last = (int(v) for v in self.headers.get("Range", "bytes=0-5999")[6:].split("-"))
        part = body[first : last + 1]
        span = {"Content-Range": f"bytes {first}-{first + len(part) - 1}/{1 << 34}"}
        self.reply(206, part, span)


def test_a_size_a_server_declares_falsely_costs_only_the_parts_asked_for() -> None:
    # Read in parts of 1 KB, the object "is" 16 GiB: the read fails at the first short part,
    # after a window of requests, not 16 million of them; no 16 GiB buffer is filled.
    _FalseTotal.served.clear()
    with serving(_FalseTotal) as url:
        store = RemoteStore(url, part_size=1024, retries=0)
        for read in (store.read_sync, lambda key: asyncio.run(store.read(key))):
            t0 = time.monotonic()
            with pytest.raises(RemoteReadError):
                read("big")
            assert time.monotonic() - t0 < 10
        assert sum(_FalseTotal.served.values()) < 1000


class _NoRanges(Handler):
    """A server that answers every request with the whole object, ranges or not."""

    def do_GET(self) -> None:
        self.reply(200, bytes(range(256)) * 20)


def test_a_server_without_byte_ranges_is_read_whole_despite_part_size() -> None:
    with serving(_NoRanges) as url:
        store = RemoteStore(url, part_size=1024, retries=0)
        assert bytes(store.read_sync("k")) == bytes(range(256)) * 20
        assert bytes(asyncio.run(store.read("k"))) == bytes(range(256)) * 20
        with pytest.raises(RemoteReadError, match=r"does not support the request.*ranges"):
            store.read_sync("k", start=0, end=10)  # asked for: said why it cannot be


class _ChangedMidway(Handler):
    """The first part of an object, then 412: it was replaced before the next part."""

    def do_GET(self) -> None:
        body = bytes(4096)
        if self.headers.get("If-Match"):
            self.reply(412, b"")
            return
        first, last = (int(v) for v in self.headers.get("Range", "bytes=0-4095")[6:].split("-"))
        span = {"Content-Range": f"bytes {first}-{last}/{len(body)}", "ETag": '"v1"'}
        self.reply(206, body[first : last + 1], span)


def test_an_object_changed_between_its_parts_says_to_read_it_again() -> None:
    with serving(_ChangedMidway) as url:
        store = RemoteStore(url, part_size=1024, retries=0, verify=False)
        with pytest.raises(RemoteReadError, match=r"changed while it was read in parts"):
            store.read_sync("k")
