"""Reads from object storage (S3, GCS, Azure, HTTP(S), local files) for a pipeline stage.

:class:`RemoteStore` stands on obstore, the Python face of the Rust ``object_store`` crate:
requests run on its own runtime, outside the GIL, over pooled keep-alive connections. This
module picks defaults for training data (short timeouts, a few retries, bounded in-flight
reads), sends again what is worth it (server errors, dropped connections, timed-out reads,
and refusals of a store that throttles, which also lower the requests in flight:
``_throttle.py``), counts what it reads, and turns failures into errors that name the object
and say what to change.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from feedline._proc.forking import PerProcess, note_obstore_request, obstore_started_in
from feedline._watchdog import register
from feedline.errors import ConfigurationError, RemoteReadError
from feedline.loader.paths import PathList

from ._failures import bad_range, describe, failure
from ._hedge import Hedger, Progress, Runners, due
from ._listing import listed_once, save_manifest, shared_listing
from ._parts import PartSizer
from ._throttle import Attempts, Throttle
from ._verify import Verifier
from .cache import ObjectCache

__all__ = ["RemoteStats", "RemoteStore"]

_INLINE_FILE_BYTES = 256 << 10
"""Cache files up to this size are read and written on the event loop (see ``read``)."""

LISTING_MAX_AGE = 3600.0
"""Seconds a prefix's manifest of keys serves before :meth:`RemoteStore.keys` lists again."""

_PART_THREADS = 16
"""The most threads one ``read_sync`` uses for its parts at once."""


@dataclass(frozen=True)
class RemoteStats:
    """What a :class:`RemoteStore` has read so far.

    Attributes:
        reads: Reads that returned data (a hedged read, or one in parts, counts once).
        bytes: Bytes those reads returned.
        failures: Requests that failed (after the store's retries).
        in_flight: Reads under way now.
        cache_hits: Whole-object reads answered by the ``cache`` (not counted in ``reads``).
        joined: Whole-object reads that found the same key already being read and waited
            for that read's result (its bytes, or its error) instead of sending another
            request (not in ``reads`` nor ``failures``).
        verified: Bodies whose MD5 was computed and matched the ETag.
        mismatches: Bodies that failed a check (length or checksum) and were thrown away;
            each was read again, up to ``retries`` times.
        part_size: Bytes per range request of a whole-object ``read`` now (``None``: one
            request per object).
        latency: With ``part_size="auto"``: seconds to a reply's headers, smoothed.
        connection_rate: With ``part_size="auto"``: bytes per second one connection carried
            a body (of 256 KiB or more), smoothed.
        listings: Prefixes this process listed from the store (:meth:`RemoteStore.keys`).
        listings_reused: Prefixes whose keys came from a manifest another call (or process)
            wrote into the cache directory, with no request.
        refusals: Requests the store refused as too many (HTTP 429, 503 ``SlowDown``), each
            sent again later with fewer in flight; not in ``failures``.
        retried: Requests sent again after an error that may pass (a server error, a
            timeout, a dropped connection).
        in_flight_limit: How many requests may be in flight now: ``max_in_flight``, lower
            for a while after a refusal.
        hedged: Second requests sent for whole-object reads slower than most (see
            ``RemoteStore(hedge=...)``).
        hedges_won: Of those, the ones that answered first (the first request was dropped).
        hedge_delay: Seconds without a reply's headers after which a read is hedged now
            (``None``: reads are not hedged: not learned yet, no tail to cut, or hedging
            pauses after hedges that did not win).

    """

    reads: int
    bytes: int
    failures: int
    in_flight: int
    cache_hits: int = 0
    joined: int = 0
    verified: int = 0
    mismatches: int = 0
    part_size: int | None = None
    latency: float | None = None
    connection_rate: float | None = None
    listings: int = 0
    listings_reused: int = 0
    refusals: int = 0
    retried: int = 0
    in_flight_limit: int | None = None
    hedged: int = 0
    hedges_won: int = 0
    hedge_delay: float | None = None


class _Flight:
    """One whole-object read that later readers of the same key may wait for (threads)."""

    __slots__ = ("done", "error", "view", "waiters")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.view: memoryview | None = None  # a view of the result that no caller holds
        self.error: RemoteReadError | None = None
        self.waiters = 0  # threads that joined (under the store's lock)


def _copy_error(error: RemoteReadError) -> RemoteReadError:
    # Each joiner raises its own copy: one object raised in several threads would gather
    # all their frames in one traceback.
    return type(error)(error.url, error.key, str(error))


_RETRY: Any = object()  # an async read's owner was cancelled: its joiners read again


def _obstore() -> Any:
    try:
        import obstore
    except ImportError as error:
        raise ImportError("RemoteStore needs obstore: pip install 'feedline[remote]'") from error
    return obstore


def _positive(name: str, value: float, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        what = "a positive int" if integer else "a positive number of seconds"
        raise ConfigurationError(f"RemoteStore({name}=...) must be {what}, got {value!r}")


class RemoteStore:
    """Reads objects under one URL, from coroutines (``read``) or threads (``read_sync``).

    Use ``read`` as an async stage: the event loop keeps many reads in flight at no thread
    cost, and the stage's ``concurrency`` says how many::

        store = RemoteStore("s3://bucket/train", region="us-east-1")
        pipeline = (
            PipelineBuilder()
            .add_source(keys)
            .pipe(store.read, concurrency=64)  # waits on the network, on the loop
            .pipe(decode, concurrency=2)  # uses the cores, in threads
            .aggregate(32)
            .build()
        )

    A ``Dataset.__getitem__`` (for :class:`feedline.DataLoader`) calls ``read_sync``. The
    store can be pickled (it is rebuilt from its arguments), so datasets holding one work
    with worker processes; what they return must pickle too: decode the bytes there, or
    return ``bytes(view)`` (a ``memoryview`` cannot be pickled).

    Worker processes must not be forked from a process that has read through obstore: its
    runtime's threads start with the first request, a forked child has none, and obstore
    cannot run there (a read raises :class:`~feedline.ConfigurationError` at once, where it
    would hang). Start them with ``"spawn"`` or ``"forkserver"`` (feedline's DataLoader
    does, PyTorch's needs ``multiprocessing_context="forkserver"``). A store that was only
    constructed forks fine; a forked copy rebuilds its locks, limits and counters.

    Args:
        url: Where the objects are: ``s3://bucket/prefix``, ``gs://...``, ``az://...``,
            ``https://host/prefix``, ``file:///path`` or ``memory:///``. Keys are relative
            to it.
        max_in_flight: The most requests at once in this process, ``read`` and
            ``read_sync`` together; further requests wait their turn. A store that
            refuses requests as too many lowers it for a while (see ``retries``).
        timeout: Seconds a request may go without receiving anything (a stalled server or
            connection); each chunk that arrives restarts the clock, so large objects on a
            slow link are not cut off.
        request_timeout: Seconds one request may take in all, from connecting to the last
            byte (``None``: no limit, only ``timeout``).
        connect_timeout: Seconds to establish a connection.
        retries: How many times a failed request is retried (0: never). Only errors that
            may pass are retried: server errors (5xx), dropped connections, timeouts. A
            missing object or a refused credential fails at once. A refusal (HTTP 429, or
            503 ``SlowDown``: the store throttles) is not one of them: it cuts the requests
            in flight (by 30 %, then they come back while refusals stay away) and is sent
            again, for as long as ``retry_timeout`` allows; ``stats()`` counts refusals
            apart, and a read that gets through in the end is no failure.
        retry_timeout: Seconds after the first attempt past which no retry starts.
        backoff: The least wait before a retry, in seconds; each wait is drawn at random
            between it and three times the last one (decorrelated jitter: requests refused
            together do not all come back together), up to ``max_backoff``.
        max_backoff: The longest wait between two attempts (at least ``backoff``).
        verify: Check each whole object's bytes before they are returned or cached: the
            length against the size the response declares, and on ``s3://`` and HTTP(S)
            stores the MD5 against an ETag that is one (see ``_verify.py``). A body that
            fails is read again (up to ``retries`` times), then the read raises
            :class:`~feedline.RemoteReadError`. ``False`` turns the checks off (objects
            encrypted with SSE-KMS or SSE-C have ETags that look like MD5s and are not).
        cache: Keep what whole-object reads return, and answer later reads of the same key
            from it (:class:`~feedline.source.ObjectCache`: memory and local disk within
            byte budgets). Reads of a byte range bypass it. With or without a cache, a
            whole-object read of a key that is being read already (on the same event loop,
            or by another thread for ``read_sync``) waits for that read and shares its
            result (and its error) rather than sending a second request.
        part_size: With it, ``read`` fetches a whole object larger than this many bytes
            as parallel range requests of this size (the first tells the object's size;
            the others ask for the same version, by its ETag), into one buffer, checked as
            a whole: one connection's bandwidth is often far below the store's (a few
            tens of MB/s on S3). Counts against ``max_in_flight`` like any request.
            ``"auto"``: the size follows what the store measures on every request, its
            latency ``L`` (to the reply's headers) and one connection's rate ``B``: parts of
            ``L B / 4`` bytes, 1 to 64 MiB (see ``_parts.py``): a read takes at most about
            1.25 ``L`` where connections are many, and a fast connection gets objects whole.
            ``None`` (default): one request per object. ``read_sync`` sends the parts after
            the first at once too, on threads (at most 16 per read, each request within
            ``max_in_flight``).
        hedge: Send a second request for a whole-object read (without parts) whose reply's
            headers are later than most, and take whichever answers first: a batch waits for
            its slowest object, and a store's latency has a long tail. The delay is the p95
            of the store's own times to headers, and only while its p99 is two medians or
            more and hedges win; the hedges stay under 4 % of the reads (see ``_hedge.py``);
            ``stats()`` counts them. Bytes are checked as any read's. Local stores
            (``file://``, ``memory://``) are never hedged. ``None`` (default): ``read`` is
            hedged (a race of coroutines, the loser cancelled), ``read_sync`` is not: its
            race hands every read to another thread and back, and on 2 cores it neither raised
            a DataLoader's rate over 16 KiB objects nor cut its p99 wait per batch by much
            (the loader's batches drawn ahead ride most of the tail). ``True``:
            ``read_sync`` races too, on threads of the store's (for machines with cores to
            spare). ``False``: one request per read.
        **options: Passed to ``obstore.store.from_url``: the store's settings (``region``,
            ``endpoint``, ``access_key_id``, ``skip_signature``, ...) and, if needed,
            ``client_options`` (merged over the timeouts above). HTTP without TLS is allowed
            when the URL or an endpoint option starts with ``http://``; otherwise obstore's
            own rule applies (``allow_http`` in ``client_options``, ``AWS_ALLOW_HTTP``).

    Raises:
        ConfigurationError: An argument is out of range, or obstore refused the URL or an
            option (its message is included). From a read or a listing: this process was
            forked from one that had made obstore requests.
        ImportError: obstore is not installed (``pip install 'feedline[remote]'``).

    """

    def __init__(
        self,
        url: str,
        *,
        max_in_flight: int = 256,
        timeout: float = 30.0,
        request_timeout: float | None = None,
        connect_timeout: float = 5.0,
        retries: int = 5,
        retry_timeout: float = 120.0,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        cache: ObjectCache | None = None,
        verify: bool = True,
        part_size: int | str | None = None,
        hedge: bool | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigurationError(
                f"RemoteStore(url=...) must be a URL such as 's3://bucket/prefix' or "
                f"'file:///data', got {url!r}"
            )
        _positive("max_in_flight", max_in_flight, integer=True)
        if (
            part_size is not None
            and part_size != "auto"
            and (isinstance(part_size, bool) or not isinstance(part_size, int) or part_size <= 0)
        ):
            raise ConfigurationError(
                "RemoteStore(part_size=...) must be a positive number of bytes, 'auto' or "
                f"None, got {part_size!r}"
            )
        for name, value in (
            ("timeout", timeout),
            ("connect_timeout", connect_timeout),
            ("retry_timeout", retry_timeout),
            ("backoff", backoff),
            ("max_backoff", max_backoff),
        ):
            _positive(name, value)
        if request_timeout is not None:
            _positive("request_timeout", request_timeout)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(
                f"RemoteStore(retries=...) must be an int >= 0, got {retries!r}"
            )
        if cache is not None and not isinstance(cache, ObjectCache):
            raise ConfigurationError(
                f"RemoteStore(cache=...) takes an ObjectCache, got {type(cache).__name__}"
            )
        self.url = url
        self._local = url.startswith(("file:", "memory:"))  # no network: nothing to wait out
        self.retries = retries
        self.retry_timeout = retry_timeout
        self._args: dict[str, Any] = {
            "max_in_flight": max_in_flight,
            "timeout": timeout,
            "request_timeout": request_timeout,
            "connect_timeout": connect_timeout,
            "retries": retries,
            "retry_timeout": retry_timeout,
            "backoff": backoff,
            "max_backoff": max_backoff,
            "cache": cache,
            "verify": verify,
            "part_size": part_size,
            "hedge": hedge,
            **options,
        }
        if not isinstance(verify, bool):
            raise ConfigurationError(f"RemoteStore(verify=...) must be a bool, got {verify!r}")
        if hedge is not None and not isinstance(hedge, bool):
            raise ConfigurationError(
                f"RemoteStore(hedge=...) must be None (the default: read hedged, read_sync "
                f"not), True or False, got {hedge!r}"
            )
        self._ob = _obstore()
        options = dict(options)
        client: dict[str, Any] = {
            "read_timeout": timedelta(seconds=timeout),
            # obstore's own default is 30 s for the whole request, too short for a large
            # object on a slow link; a day stands for "no limit".
            "timeout": timedelta(seconds=request_timeout or 86400.0),
            "connect_timeout": timedelta(seconds=connect_timeout),
        }
        if _plain_http(url, options):
            client["allow_http"] = True
        client.update(options.pop("client_options", None) or {})
        retry = {
            "max_retries": retries,
            "retry_timeout": timedelta(seconds=retry_timeout),
            "backoff": {
                "init_backoff": timedelta(seconds=backoff),
                "max_backoff": timedelta(seconds=max(backoff, max_backoff)),
                "base": 2,
            },
        }
        # Reads are retried here (see _throttle.py), listings by obstore (a listing is paged:
        # a failed page must be asked again, not the whole listing).
        self._open_with = {"client_options": client, **options}
        self._retry = retry
        self._backoff = (backoff, max(backoff, max_backoff))
        self.cache = cache
        self._part_size = part_size if isinstance(part_size, int) else None
        self._verifier = Verifier(url, verify)
        self._max_in_flight = max_in_flight
        store = self._open()  # a URL or an option obstore refuses raises here, not later
        self._process = PerProcess()
        self._start()
        self._store: Any = store  # building one starts no thread: it serves this process
        self._lister: Any = None
        register(self)  # its requests in flight appear in stall reports

    def _open(self, retries: int = 0) -> Any:
        # A new obstore store (no request: its first request starts obstore's runtime).
        from obstore.store import from_url as _from_url

        from_url: Any = _from_url  # its overloads, one per scheme, cannot see our **options
        retry = {**self._retry, "max_retries": retries}
        try:
            return from_url(self.url, retry_config=retry, **self._open_with)
        except Exception as error:
            raise ConfigurationError(
                f"obstore could not open {self.url!r} ({describe(error)}). Check the URL's "
                "scheme and the options passed on to obstore.store.from_url"
            ) from error

    def _start(self) -> None:
        # The state of one process: built here, and again in each process that uses a copy
        # of the store made by fork (see _here), whose locks and semaphores may have been
        # held by the parent's threads. The obstore store too: it is built on the first
        # request in a process (its connection pool is the parent's otherwise).
        self._store = None
        self._lister = None
        self._lock = threading.Lock()
        self._sizer = PartSizer() if self._args["part_size"] == "auto" else None
        self._verified = 0
        self._mismatches = 0
        self._cache_hits = 0
        self._loops: set[asyncio.AbstractEventLoop] = set()  # those with flights, maybe
        self._throttle = Throttle(self._max_in_flight)
        self._refusals = 0
        self._retried = 0
        # (local: no tail worth a second request)
        self._hedger = Hedger() if self._args["hedge"] is not False and not self._local else None
        self._hedge_sync = self._args["hedge"] is True  # read_sync races too
        self._hedges = [0, 0]  # sent, won
        self._runners: Runners | None = None  # threads for read_sync's races
        self._main_reads: Runners | None = None  # threads for read_sync on the main thread
        self._reads = 0
        self._bytes = 0
        self._failures = 0
        self._in_flight = 0
        self._joined = 0
        self._listings = [0, 0]  # listed from the store, read from a manifest
        self._ticket = 0  # numbers the requests in flight, kept with their key and start
        self._requests: dict[int, tuple[str, float]] = {}
        # Whole-object reads under way, by key: per event loop for read (touched only on that
        # loop's thread), across threads for read_sync (under _lock).
        self._loop_flights: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Future[Any]] = {}
        self._thread_flights: dict[str, _Flight] = {}

    def _here(self) -> None:
        """Make the store ready to read in this process; raises where obstore cannot run.

        One ``getpid`` per call: called once per read or listing, never per request.
        """
        pid = os.getpid()
        started = obstore_started_in()
        if started is not None and started != pid:
            raise ConfigurationError(
                f"{self!r} cannot read in process {pid}: this process was forked (directly "
                f"or not) from process {started} after obstore's runtime started there, and "
                "obstore cannot run in a forked copy of it (its requests would wait forever). "
                "Start worker processes with the 'spawn' or 'forkserver' method "
                "(multiprocessing_context='forkserver' for PyTorch's DataLoader; feedline's "
                "DataLoader picks it itself), or use the store only inside the workers: "
                "constructing one starts nothing, its first request starts the runtime"
            )
        self._process.check(self._start, pid)

    def _client(self) -> Any:
        # The obstore store, right before a request (this process's, built on its first).
        note_obstore_request()
        store = self._store
        if store is None:
            with self._lock:
                if self._store is None:
                    self._store = self._open()
                store = self._store
        return store

    def _listing_client(self) -> Any:
        # As _client, for listings: obstore retries their pages.
        note_obstore_request()
        with self._lock:
            if self._lister is None:
                self._lister = self._open(self.retries)
            return self._lister

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    def _entry(self, key: str) -> str:
        # The cache's name for the object: stores sharing a cache (train/ and val/ under
        # one directory) each find only their own objects, whatever their keys.
        return f"{self.url}\x00{key}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.url, self._args))

    async def read(
        self, key: str, *, start: int | None = None, end: int | None = None
    ) -> memoryview:
        """Read one object (or the bytes ``start`` to ``end`` of it) from a coroutine.

        Args:
            key: The object's path under the store's URL.
            start: First byte to read (default: the beginning).
            end: Byte after the last to read (default: the end of the object).

        Returns:
            The bytes, without a copy (a view of the buffer obstore filled).

        Raises:
            RemoteNotFoundError: There is no such object (also a ``FileNotFoundError``).
            RemoteReadError: The read failed after the retries; names the key and the cause.
            ValueError: ``start`` or ``end`` is negative, or ``end`` is not past ``start``.
            ConfigurationError: This process was forked from one that had made obstore
                requests: obstore cannot run here (the message says what to do instead).

        """
        options = _range_options(start, end)
        self._here()
        cache = self.cache if options is None else None
        entry = self._entry(key)
        if cache is not None:
            # Memory, and small files, here on the event loop: a hop to a thread and back
            # costs more than reading 100 KB from the page cache. Large files in a thread.
            data = cache.peek(entry)
            if data is None:
                size = cache.file_size(entry)
                if size is not None and size > _INLINE_FILE_BYTES:
                    data = await asyncio.get_running_loop().run_in_executor(None, cache.get, entry)
                else:
                    data = cache.get(entry)  # without a file: counts the miss, reads nothing
            if data is not None:
                return self._hit(data)
        if options is not None:
            return await self._fetch(key, options)
        flights = self._loop_flights
        slot = (asyncio.get_running_loop(), key)
        if slot[0] not in self._loops:
            self._new_loop(slot[0])
        while True:
            flight = flights.get(slot)
            if flight is None:
                break
            try:
                # Shielded: a joiner that is cancelled must not cancel the owner's future.
                shared = await asyncio.shield(flight)
            except RemoteReadError as error:
                self._count_joined()
                raise _copy_error(error) from error.__cause__
            if shared is not _RETRY:
                self._count_joined()
                return memoryview(shared)  # its own view: releasing it harms no other
        flight = asyncio.get_running_loop().create_future()
        flights[slot] = flight
        try:
            # Filled while this read looked (see read_sync)?
            data = cache.peek(entry) if cache is not None else None
            if data is not None:
                flight.set_result(memoryview(data))
                return self._hit(data)
            try:
                view = await self._fetch(key, None)
            except Exception as error:
                flight.set_exception(error)
                flight.exception()  # retrieved: no "never retrieved" warning without joiners
                raise
            except BaseException:
                flight.set_result(_RETRY)  # cancelled: one of the joiners reads it instead
                raise
            # The joiners go now; the flight stays listed while the cache is filled, so that
            # a reader arriving meanwhile joins it rather than sending a second request.
            flight.set_result(memoryview(view))
            if cache is not None and (cache.directory is None or view.nbytes <= _INLINE_FILE_BYTES):
                cache.put(entry, view)
            elif cache is not None:
                # Awaited, not left running: the writes in flight stay as many as the reads,
                # and none outlives the pipeline's event loop.
                await asyncio.get_running_loop().run_in_executor(None, cache.put, entry, view)
        finally:
            flights.pop(slot, None)
        return view

    async def _fetch(self, key: str, options: Any) -> memoryview:
        attempt = 0
        while True:
            part = self._part()
            if options is None and part is not None:
                view, meta = await self._get_parts(key, part)
            elif options is None:
                view, meta = await self._get_whole(key)
            else:
                view, meta = await self._get(key, options)
            if options is not None or not self._verifier.enabled:
                return view
            if view.nbytes > _INLINE_FILE_BYTES:  # hashing releases the GIL: off the loop
                loop = asyncio.get_running_loop()
                checked = await loop.run_in_executor(None, self._verifier.problem, view, meta)
            else:
                checked = self._verifier.problem(view, meta)
            if self._checked(key, checked, attempt):
                return view
            attempt += 1

    async def _get(
        self,
        key: str,
        options: Any,
        first: bool = False,
        progress: Progress | None = None,
        part: bool = False,
    ) -> tuple[memoryview, Any]:
        # One request, sent again as Attempts says: the body and the object's metadata.
        # ``first``: the first part of a whole-object read, which an empty object refuses
        # (no byte 0): then read it whole. ``progress``: how far it got (for a race).
        # A race's requests, and the ``part``s of a read, are counted by the read, not each.
        attempts = Attempts(self, key, counted=progress is None)
        while True:
            cuts = await self._throttle.take()
            attempts.sending()
            ticket = self._begin(key)
            view = wait = None
            try:
                sent = self._sent(progress)
                result = await self._ob.get_async(self._client(), key, options=options)
                headers = time.perf_counter()
                self._answered(options, headers - sent, progress)
                view = memoryview(await result.bytes_async())
                self._observe(sent, headers, view)
            except Exception as error:
                if not (first and bad_range(error)):
                    wait = attempts.after(error, cuts)  # raises when it is not sent again
            finally:  # also when cancelled (a pipeline that stops cancels its reads)
                self._end(ticket, view if progress is None and not part else None)
                self._throttle.give()
            if view is not None:
                return view, result.meta
            if wait is None:
                return await self._get(key, None, progress=progress, part=part)
            await asyncio.sleep(wait)

    @staticmethod
    def _sent(progress: Progress | None) -> float:
        # A request goes out now.
        now = time.perf_counter()
        if progress is not None:
            progress.sent = now
        return now

    def _answered(self, options: Any, seconds: float, progress: Progress | None) -> None:
        # A reply's headers came: a whole-object request's time to them teaches the hedger.
        if options is None and self._hedger is not None:
            self._hedger.observe(seconds)
        if progress is not None:
            progress.answered = True

    def _may_hedge(self) -> bool:
        # Not while the store throttles (its limit cut: a hedge is one request more), and
        # within the hedges' budget; counted when it goes.
        if self._hedger is None or self._throttle.limit() < self._max_in_flight:
            return False
        if not self._hedger.spend():
            return False
        with self._lock:
            self._hedges[0] += 1
        return True

    def _answer(
        self, done: Any, first: Any, errors: dict[Any, BaseException], hedged: bool
    ) -> tuple[memoryview, Any] | None:
        # Of the racers that ended (futures of either kind), the answer of one that did,
        # counted as the read's (and a hedge's as won, or lost, for the hedger to judge);
        # the others' errors are kept.
        for racer in done:
            error = racer.exception()
            if error is None:
                if hedged and self._hedger is not None:
                    self._hedger.judge(won=racer is not first)
                return self._won(racer.result(), hedge=racer is not first)
            errors[racer] = error
        return None

    def _won(self, answer: tuple[memoryview, Any], hedge: bool) -> tuple[memoryview, Any]:
        # A race's answer, or a read's in parts: counted once (its requests count none).
        with self._lock:
            self._reads += 1
            self._bytes += answer[0].nbytes
            self._hedges[1] += hedge
        return answer

    def _lost_race(self, errors: dict[Any, BaseException], first: Any) -> BaseException:
        # Both requests failed: the read fails once, with the first request's error.
        with self._lock:
            self._failures += 1
        return errors.get(first) or next(iter(errors.values()))

    async def _get_whole(self, key: str) -> tuple[memoryview, Any]:
        # A whole object in one request, hedged if it is slower than most (see _hedge.py).
        delay = None if self._hedger is None else self._hedger.begin()
        if delay is None:
            return await self._get(key, None)
        return await self._race(key, delay)

    def _get_whole_sync(self, key: str) -> tuple[memoryview, Any]:
        # As _get_whole from a thread, with hedge=True: a race runs on the store's threads.
        delay = None if self._hedger is None or not self._hedge_sync else self._hedger.begin()
        if delay is None:
            return self._get_sync(key, None)
        return self._race_sync(key, delay)

    def _race_sync(self, key: str, delay: float) -> tuple[memoryview, Any]:
        # As _race, on the store's threads. A request sent from a thread cannot be dropped:
        # the loser's runs on to its end there, unread, uncounted and not sent again.
        runners = self._race_runners()
        first_progress = Progress()
        first = runners.submit(self._get_sync, key, None, False, first_progress)
        racers: dict[Any, Progress] = {first: first_progress}
        errors: dict[Any, BaseException] = {}
        try:
            wait: float | None = delay
            while wait is not None and wait > 0:
                try:
                    return self._won(first.result(timeout=wait), hedge=False)
                except concurrent.futures.TimeoutError:
                    wait = due(first_progress, delay, time.perf_counter())
                except Exception as error:  # failed before its hedge was due: the read's
                    raise self._lost_race({first: error}, first) from error.__cause__
            if wait is not None and self._may_hedge():
                hedge = Progress()
                racers[runners.submit(self._get_sync, key, None, False, hedge)] = hedge
            pending = set(racers)
            while pending:
                done, pending = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                answer = self._answer(done, first, errors, len(racers) > 1)
                if answer is not None:
                    return answer
            raise self._lost_race(errors, first)
        finally:
            for racer, racing in racers.items():
                racing.dropped = True  # a loser stops: no retry, no count
                racer.cancel()  # and a hedge not started yet never starts

    async def _race(self, key: str, delay: float) -> tuple[memoryview, Any]:
        # The request, and after ``delay`` without its reply's headers a second one (within
        # the budget); the first whole answer wins, the other is cancelled. Both failing:
        # the first request's error.
        first_progress = Progress()
        first = asyncio.ensure_future(self._get(key, None, progress=first_progress))
        racers: dict[Any, Progress] = {first: first_progress}
        errors: dict[Any, BaseException] = {}
        pending: set[Any] = {first}
        try:
            wait: float | None = delay
            while wait is not None and wait > 0:
                done, _ = await asyncio.wait(pending, timeout=wait)
                wait = None if done else due(first_progress, delay, time.perf_counter())
            if wait is not None and self._may_hedge():
                hedge = Progress()
                second = asyncio.ensure_future(self._get(key, None, progress=hedge))
                racers[second] = hedge
                pending.add(second)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                answer = self._answer(done, first, errors, len(racers) > 1)
                if answer is not None:
                    return answer
            raise self._lost_race(errors, first)
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    def _race_runners(self) -> Runners:
        # The threads read_sync's races run on, in this process (daemon threads, started as
        # needed, each ending after a few seconds without work).
        with self._lock:
            if self._runners is None:
                self._runners = Runners(2 * self._max_in_flight)
            return self._runners

    def _part(self) -> int | None:
        # Bytes per part of a whole-object read now (None: one request).
        return self._sizer.size() if self._sizer is not None else self._part_size

    def _observe(self, sent: float, headers: float, view: memoryview) -> None:
        # With part_size="auto": time the request (to its headers) and its body.
        if self._sizer is not None:
            self._sizer.observe(headers - sent, view.nbytes, time.perf_counter() - headers)

    async def _get_parts(self, key: str, part: int) -> tuple[memoryview, Any]:
        # The first part tells the size; the rest come at once, of the same version. With
        # part_size="auto", the first part timed the connection: the rest take the size that
        # says.
        first, meta = await self._get(key, {"range": (0, part)}, first=True, part=True)
        size = int(meta["size"])
        if size <= first.nbytes:
            return self._won((first, meta), hedge=False)
        plan = _Parts(self, key, first, meta, part)

        async def fetch(start: int) -> None:
            view, _ = await self._get(key, plan.options(start), part=True)
            plan.put(start, view)

        starts = iter(plan.starts)

        async def fetch_each() -> None:  # the parts in turn: as many at once as these
            for start in starts:
                await fetch(start)

        lanes = min(len(plan.starts), self._max_in_flight)
        tasks = [asyncio.ensure_future(fetch_each()) for _ in range(lanes)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one failed (or the read was cancelled): the rest stop
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # and are retrieved
            raise
        return self._won((memoryview(plan.buffer), meta), hedge=False)

    def read_sync(
        self, key: str, *, start: int | None = None, end: int | None = None
    ) -> memoryview:
        """Read one object, blocking the calling thread (not the GIL) until it arrives.

        Same arguments, result and errors as :meth:`read`.
        """
        options = _range_options(start, end)
        self._here()
        cache = self.cache if options is None else None
        entry = self._entry(key)
        if cache is not None:
            data = cache.get(entry)
            if data is not None:
                return self._hit(data)
        if options is not None:
            return self._fetch_interruptible(key, options)
        mine: _Flight | None = None
        try:
            while True:
                with self._lock:
                    flight = self._thread_flights.get(key)
                    if flight is None:
                        mine = _Flight()
                        self._thread_flights[key] = mine
                        break
                    flight.waiters += 1
                flight.done.wait()
                if flight.error is not None:
                    self._count_joined()
                    error = flight.error
                    raise _copy_error(error) from error.__cause__
                if flight.view is not None:
                    self._count_joined()
                    return memoryview(flight.view)  # its own view (see read)
                # The reading thread was interrupted (not a read error): read it here.
            if cache is not None:
                # This thread missed the cache, then found no read of the key in flight: a
                # read by another thread may have filled the cache in between, and ended.
                # Look again (memory only) before sending a request; the miss counted above
                # stands beside this hit.
                data = cache.peek(entry)
                if data is not None:
                    mine.view = memoryview(data)
                    return self._hit(data)
            try:
                view = self._fetch_interruptible(key, None)
            except RemoteReadError as error:
                mine.error = error
                raise
            mine.view = memoryview(view)
            mine.done.set()  # the joiners go; the flight stays listed while the cache fills
            if cache is not None:
                cache.put(entry, view)
            return view
        finally:
            if mine is not None:
                mine.done.set()
                with self._lock:
                    if self._thread_flights.get(key) is mine:
                        del self._thread_flights[key]

    def _fetch_interruptible(self, key: str, options: Any) -> memoryview:
        # On the main thread, the request runs on a daemon thread that this one waits for:
        # a request blocks in obstore's native code, which never returns to Python to see a
        # Ctrl-C (a server that drips its body kept it waiting past two of them). A read
        # left so ends on its own. On other threads (which signals never reach), and for
        # local files (the hop would cost a 1 KB read a third more), here.
        if self._local or threading.current_thread() is not threading.main_thread():
            return self._fetch_sync(key, options)
        with self._lock:
            if self._main_reads is None:
                # Ending soon after: the main thread's reads come one at a time, and a
                # thread left idle a second is a thread more for a fork, or a test, to see.
                self._main_reads = Runners(self._max_in_flight, "feedline-read", _MAIN_IDLE)
            runners = self._main_reads
        future = runners.submit(self._fetch_sync, key, options)
        while True:  # in slices: a signal that reached another thread is seen here too
            try:
                return future.result(timeout=_INTERRUPT_SLICE)
            except TimeoutError:
                if future.done():
                    raise  # the read's own error

    def _fetch_sync(self, key: str, options: Any) -> memoryview:
        attempt = 0
        while True:
            part = self._part()
            if options is None and part is not None:
                view, meta = self._get_parts_sync(key, part)
            elif options is None:
                view, meta = self._get_whole_sync(key)
            else:
                view, meta = self._get_sync(key, options)
            if options is not None or not self._verifier.enabled:
                return view
            if self._checked(key, self._verifier.problem(view, meta), attempt):
                return view
            attempt += 1

    def _get_sync(
        self,
        key: str,
        options: Any,
        first: bool = False,
        progress: Progress | None = None,
        part: bool = False,
    ) -> tuple[memoryview, Any]:
        # One request from this thread (see _get).
        attempts = Attempts(self, key, counted=progress is None)
        while True:
            if progress is not None and progress.dropped:
                raise concurrent.futures.CancelledError(f"{key!r}: the other request answered")
            cuts = self._throttle.take_sync()
            attempts.sending()
            ticket = self._begin(key)
            view = wait = None
            try:
                sent = self._sent(progress)
                result = self._ob.get(self._client(), key, options=options)
                headers = time.perf_counter()
                self._answered(options, headers - sent, progress)
                view = memoryview(result.bytes())
                self._observe(sent, headers, view)
            except Exception as error:
                if not (first and bad_range(error)):
                    wait = attempts.after(error, cuts)
            finally:
                self._end(ticket, view if progress is None and not part else None)
                self._throttle.give()
            if view is not None:
                return view, result.meta
            if wait is None:
                return self._get_sync(key, None, progress=progress, part=part)
            time.sleep(wait)

    def _get_parts_sync(self, key: str, part: int) -> tuple[memoryview, Any]:
        # As _get_parts, the parts after the first at once on threads of their own; each
        # request takes a slot of max_in_flight, like any of read_sync's.
        first, meta = self._get_sync(key, {"range": (0, part)}, first=True, part=True)
        if int(meta["size"]) <= first.nbytes:
            return self._won((first, meta), hedge=False)
        plan = _Parts(self, key, first, meta, part)

        def fetch(start: int) -> None:
            view, _ = self._get_sync(key, plan.options(start), part=True)
            plan.put(start, view)

        threads = min(len(plan.starts), self._max_in_flight, _PART_THREADS)
        pool = ThreadPoolExecutor(threads, thread_name_prefix="feedline-parts")
        window: collections.deque[concurrent.futures.Future[None]] = collections.deque()
        try:
            # A window of parts asked for at once, not every part (a size that a server
            # declares may be huge): the first error raises; the parts not begun are dropped.
            for start in plan.starts:
                window.append(pool.submit(fetch, start))
                if len(window) >= 2 * threads:
                    window.popleft().result()
            while window:
                window.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return self._won((memoryview(plan.buffer), meta), hedge=False)

    def _checked(self, key: str, checked: tuple[str | None, bool], attempt: int) -> bool:
        """Count a verification; ``False``: read again; raises once the retries are spent."""
        problem, hashed = checked
        with self._lock:
            if problem is None:
                self._verified += hashed
            else:
                self._mismatches += 1
        if problem is None:
            return True
        if attempt < self.retries:
            return False
        with self._lock:
            self._failures += 1
        raise RemoteReadError(
            self.url,
            key,
            f"reading {key!r} from {self.url} returned damaged bytes {attempt + 1} time(s) "
            f"({problem}); nothing was returned or cached. A proxy or the network corrupts "
            "bodies, or the ETag is not the MD5 it looks like (an S3 object encrypted with "
            "SSE-KMS or SSE-C, or an HTTP server's own kind of ETag): then read it with "
            "RemoteStore(..., verify=False)",
        )

    def keys(
        self,
        prefix: str = "",
        *,
        suffix: str | tuple[str, ...] = (),
        max_age: float | None = LISTING_MAX_AGE,
        refresh: bool = False,
        group: Any = None,
    ) -> PathList:
        """List the keys under the store's URL, sorted, as a compact :class:`PathList`.

        Sorted so that every process, and every run, sees the same order: a sampler's seed
        then picks the same items everywhere. The listing is paged by the store (1,000 keys
        per request on S3) and retried like a read.

        With a ``cache`` that has a directory, a prefix is listed once: the keys are kept
        there as a manifest, and later calls, and other processes sharing the directory
        (DataLoader workers, the ranks of a job on a shared file system), read it instead of
        listing (those that ask at once wait for the first one's listing). ``stats()``
        counts both. With ``group``, the ranks of a job share one listing: the group's first
        rank lists (or reads its manifest) and sends the keys to the others, which keep them
        in their own cache directory for their workers.

        Args:
            prefix: Only keys under this path (by whole segments: ``"train"`` matches
                ``train/x.jpg``, not ``training/x.jpg``).
            suffix: Only keys ending with this (or one of these), e.g. ``(".jpg", ".png")``.
            max_age: Seconds after which a manifest is listed again (default an hour;
                ``None``: never): keys added to the prefix since are seen then.
            refresh: List again now, whatever the manifest's age (and update it).
            group: A ``torch.distributed`` process group (``torch.distributed.group.WORLD``
                for every rank) whose ranks all call ``keys`` with the same arguments: one
                lists for all of them. ``None``: this process lists (or reads its manifest).

        Returns:
            The keys, relative to the store's URL (what :meth:`read` takes).

        Raises:
            RemoteReadError: The listing failed (names the store and the prefix).
            ConfigurationError: This process was forked from one that had made obstore
                requests (see :meth:`read`).

        Example::

            store = RemoteStore("s3://bucket/imagenet", region="us-east-1")
            files = store.keys("train", suffix=".JPEG")  # 1.28 million keys in ~60 MB

        """
        if not isinstance(suffix, str | tuple):
            raise TypeError(f"suffix must be a str or a tuple of str, got {suffix!r}")
        if max_age is not None and (isinstance(max_age, bool) or max_age < 0):
            raise ConfigurationError(
                f"keys(max_age=...) must be seconds >= 0 or None, got {max_age!r}"
            )
        self._here()
        directory = self.cache.directory if self.cache is not None else None

        def listing() -> tuple[list[str], bool]:
            # Every key of the prefix (as a manifest keeps them, for any suffix asked later),
            # and whether this process listed them.
            if directory is None:
                return self._list(prefix, () if group is not None else suffix), True
            return listed_once(
                directory,
                self.url,
                prefix,
                lambda: self._list(prefix, ()),
                max_age=max_age,
                refresh=refresh,
            )

        if group is None:
            found, listed = listing()
        else:
            found, listed = shared_listing(group, listing, self._failed_listing(prefix))
            if directory is not None and not listed:  # for this rank's workers
                save_manifest(directory, self.url, prefix, found)
        if suffix and (directory is not None or group is not None):
            found = [key for key in found if key.endswith(suffix)]
        with self._lock:
            self._listings[0 if listed else 1] += 1
        return PathList(found)

    def _failed_listing(self, prefix: str) -> Callable[[str], RemoteReadError]:
        # What another rank raises when the rank that listed for it failed.
        def failed(message: str) -> RemoteReadError:
            return RemoteReadError(
                self.url,
                prefix,
                f"{self.url}: listing {prefix!r} failed on the rank that lists for the group: "
                f"{message}",
            )

        return failed

    def _list(self, prefix: str, suffix: str | tuple[str, ...]) -> list[str]:
        # The keys under ``prefix`` (ending with ``suffix``), sorted: requests to the store.
        # obstore retries a page's request, not an error in its body (a connection cut
        # mid-way, a stall): the listing is then asked again, as a read would be.
        attempts = Attempts(self, prefix, listing=True)
        while True:
            found: list[str] = []
            attempts.sending()
            try:
                pages = self._ob.list(self._listing_client(), prefix or None, chunk_size=1000)
                for page in pages:
                    found += (m["path"] for m in page if not suffix or m["path"].endswith(suffix))
            except Exception as error:
                time.sleep(attempts.after(error, 0))  # raises once not to be sent again
                continue
            found.sort()
            return found

    def stats(self) -> RemoteStats:
        """How many reads and bytes so far, how many failed, how many are under way.

        Counted per process: a copy of the store in a forked process counts from zero.
        """
        self._process.check(self._start)
        sizer = self._sizer
        with self._lock:
            return RemoteStats(
                self._reads,
                self._bytes,
                self._failures,
                self._in_flight,
                self._cache_hits,
                self._joined,
                self._verified,
                self._mismatches,
                self._part(),
                None if sizer is None else sizer.latency,
                None if sizer is None else sizer.rate,
                self._listings[0],
                self._listings[1],
                self._refusals,
                self._retried,
                self._throttle.limit(),
                self._hedges[0],
                self._hedges[1],
                None if self._hedger is None else self._hedger.delay,
            )

    # -- internals -----------------------------------------------------------------------------

    def _new_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        # Each pipeline run has an event loop of its own. A loop closed mid-read leaves its
        # flights behind: they are dropped when another loop first reads.
        with self._lock:
            for old in [lp for lp in self._loops if lp.is_closed()]:
                self._loops.discard(old)
            for slot in [s for s in self._loop_flights if s[0].is_closed()]:
                self._loop_flights.pop(slot, None)
            self._loops.add(loop)

    def _hit(self, data: bytes) -> memoryview:
        with self._lock:
            self._cache_hits += 1
        return memoryview(data)

    def _count_joined(self) -> None:
        with self._lock:
            self._joined += 1

    def _begin(self, key: str) -> int:
        # A request goes out: counted, and its key and start kept for a stall report.
        with self._lock:
            self._in_flight += 1
            self._ticket += 1
            self._requests[self._ticket] = (key, time.monotonic())
            return self._ticket

    def _end(self, ticket: int, view: memoryview | None) -> None:
        with self._lock:
            self._in_flight -= 1
            self._requests.pop(ticket, None)
            if view is not None:
                self._reads += 1
                self._bytes += view.nbytes

    def stall_report(self) -> list[str]:
        """For the stall watchdog: the requests in flight in this process, the oldest first."""
        self._process.check(self._start)  # a forked copy's are its parent's
        with self._lock:
            requests = sorted(self._requests.values(), key=lambda r: r[1])
        if not requests:
            return []
        key, since = requests[0]
        return [
            f"{self!r}: {len(requests)} request(s) waiting on the store, the oldest for "
            f"{time.monotonic() - since:.0f} s (key {key!r}; timeout={self._args['timeout']} s "
            "applies to each request's silence, retries= to failed ones)"
        ]

    def _failed(
        self,
        key: str,
        error: Exception,
        retried: int | None = None,
        refused: int = 0,
        counted: bool = True,
        listing: bool = False,
    ) -> RemoteReadError:
        # ``counted``: a failure of the read (a race's requests are not: it counts its own).
        if counted:
            with self._lock:
                self._failures += 1
        return failure(self, key, error, self._ob.exceptions, listing, retried, refused)

    def _count_refusal(self, cuts: int) -> None:
        # A request refused as too many: fewer in flight (see _throttle.py).
        self._throttle.refused(cuts)
        with self._lock:
            self._refusals += 1

    def _count_retry(self) -> None:
        with self._lock:
            self._retried += 1


_ENDPOINT_KEYS = (
    "endpoint",
    "aws_endpoint",
    "endpoint_url",
    "aws_endpoint_url",
    "aws_endpoint_url_s3",
)


class _Parts:
    """The parts of one whole-object read after its first: where they go, what they ask for.

    Each asks for the version the first part came from (``If-Match`` on its ETag: a changed
    object fails rather than mixing two versions), and must come back at its full length.
    """

    def __init__(self, store: RemoteStore, key: str, first: memoryview, meta: Any, part: int):
        self._store, self._key = store, key
        self.size = int(meta["size"])
        # With part_size="auto", the first part timed the connection: the rest are sized anew.
        self._size = store._part() or part
        self._etag = meta.get("e_tag")
        try:
            # Pages taken as the parts are written (a bytearray writes zeros over them all
            # first): a size that a server declared falsely costs only the parts read.
            self.buffer = mmap.mmap(-1, self.size)
        except (MemoryError, OverflowError, OSError):
            raise RemoteReadError(
                store.url,
                key,
                f"reading {key!r} in parts: it declares {self.size:,} bytes, more than this "
                "process can hold; read it in byte ranges (read_sync(key, start=, end=))",
            ) from None
        self.buffer[: first.nbytes] = first
        self.starts = range(first.nbytes, self.size, self._size)

    def options(self, start: int) -> dict[str, Any]:
        """The request for the part from ``start``."""
        options: dict[str, Any] = {"range": (start, min(self.size, start + self._size))}
        if self._etag:
            options["if_match"] = self._etag
        return options

    def put(self, start: int, view: memoryview) -> None:
        """Copy the part from ``start`` into place, after checking its length."""
        end = min(self.size, start + self._size)
        if view.nbytes != end - start:
            raise RemoteReadError(
                self._store.url,
                self._key,
                f"reading {self._key!r} in parts: bytes {start}-{end} came back as "
                f"{view.nbytes} bytes (the object changed, or the store ignored the range)",
            )
        self.buffer[start:end] = view


def _plain_http(url: str, options: dict[str, Any]) -> bool:
    """Whether the URL or an endpoint option (given directly or in ``config``) is http://."""
    places = [options, options.get("config") or {}]
    endpoints = [str(place.get(k, "")) for place in places for k in _ENDPOINT_KEYS]
    return any(u.lower().startswith("http://") for u in (url, *endpoints))


_INTERRUPT_SLICE = 0.1
"""Seconds between two looks for a Ctrl-C while the main thread waits for a read."""

_MAIN_IDLE = 0.05
"""Seconds the thread that sends the main thread's reads waits for the next before it ends."""


def _range_options(start: int | None, end: int | None) -> Any:
    if start is None and end is None:
        return None
    first = 0 if start is None else start
    if first < 0 or (end is not None and end <= first):
        raise ValueError(
            f"a byte range needs 0 <= start < end, got start={start!r}, end={end!r} "
            "(leave end out to read to the end of the object)"
        )
    return {"range": {"offset": first} if end is None else (first, end)}


def _rebuild(url: str, args: dict[str, Any]) -> RemoteStore:
    return RemoteStore(url, **args)
