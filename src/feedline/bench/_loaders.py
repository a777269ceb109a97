"""What the DataLoader scenarios share: datasets, a slow HTTP server, and timing a loader.

Datasets live at module level so that PyTorch's worker processes can unpickle them.
"""

from __future__ import annotations

import http.client
import os
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._common import process_cpu_seconds, threaded_loop

__all__ = [
    "DecodeDataset",
    "HttpDataset",
    "LoaderCosts",
    "LoaderRun",
    "MemorySampler",
    "PathsDataset",
    "SlotPipeline",
    "SleepDataset",
    "decode_seconds",
    "descendants_cpu",
    "process_tree_memory",
    "time_loader",
    "tree_cpu_seconds",
]

SIZE = (224, 224)


def _decode_feedline(data: bytes) -> np.ndarray[Any, Any]:
    from feedline.io import decode_image

    return decode_image(data, size=SIZE)


def _decode_pil(data: bytes) -> np.ndarray[Any, Any]:
    from .decode import pil_decode

    return np.array(pil_decode(data))  # writable, as PyTorch's collation wants


def decode_seconds(pictures: list[bytes], repeats: int) -> float:
    """Seconds per picture of feedline's decode on one thread, in memory (median of runs)."""
    runs = []
    for _ in range(repeats):
        items, seconds = threaded_loop(_decode_feedline, pictures, 1)
        runs.append(seconds / items)
    return statistics.median(runs)


DECODERS: dict[str, Callable[[bytes], np.ndarray[Any, Any]]] = {
    "feedline": _decode_feedline,
    "PIL": _decode_pil,
}


class DecodeDataset:
    """``dataset[i]``: decode and resize picture ``i`` (bytes held in memory) to 224x224."""

    def __init__(self, pictures: list[bytes], decoder: str, length: int | None = None) -> None:
        self.pictures = pictures
        self.decoder = decoder
        self.length = length or len(pictures)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return DECODERS[self.decoder](self.pictures[i % len(self.pictures)])


class HttpDataset:
    """``dataset[i]``: GET picture ``i`` from a server (which delays each reply), decode it.

    Each thread keeps one keep-alive connection, as a client library's session would.
    """

    def __init__(self, url: str, length: int, decode: bool = True) -> None:
        self.url = url
        self.length = length
        self.decode = decode
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "length": self.length, "decode": self.decode}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["length"], state["decode"])  # type: ignore[misc]

    def __len__(self) -> int:
        return self.length

    def get(self, i: int) -> bytes:
        """The encoded picture ``i``, fetched over this thread's connection."""
        connection = getattr(self._local, "connection", None)
        if connection is None:
            host, port = self.url.removeprefix("http://").split(":")
            connection = self._local.connection = http.client.HTTPConnection(host, int(port))
        connection.request("GET", f"/{i}")
        response = connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise OSError(f"GET /{i}: HTTP {response.status}")
        return data

    def __getitem__(self, i: int) -> Any:
        data = self.get(i)
        return _decode_feedline(data) if self.decode else np.frombuffer(data, np.uint8)[:16].copy()


class SlotPipeline:
    """Batches of pictures decoded straight into slots of pooled batch buffers: feedline's way.

    Each pass builds a pipeline over ``keys``: ``read(key)`` gives a picture's bytes, decoded
    to 224x224 into its slot of a ``(batch, 224, 224, 3)`` buffer from a
    :class:`~feedline.io.BufferPool` (no collation copy). With ``read_concurrency``, reads are
    their own stage that many wide (reads that wait on a server), ahead of a decode stage
    ``decode_concurrency`` wide (about the number of cores: more decoding threads than cores
    only evict each other's caches); without it, each decode task reads its own file. With
    ``aread`` (a coroutine function, such as :meth:`feedline.RemoteStore.read`), the read
    stage awaits it on the event loop instead of calling ``read`` on threads.

    With ``tuned``, each stage's concurrency is ``"auto"`` from its default start (the cores
    for threads, 4 on the event loop) up to twice the figure given: the pipeline's tuner sets
    it while it runs.

    A batch is handed on when its last slot is written (the decode stage keeps input order,
    so every earlier slot is written by then). That needs every read and decode to succeed:
    the pipeline has no failure budget, and a failure ends the pass with ``PipelineFailure``.
    """

    def __init__(
        self,
        keys: Sequence[Any],
        read: Callable[[Any], bytes],
        batch: int,
        decode_concurrency: int,
        read_concurrency: int | None = None,
        aread: Callable[[Any], Awaitable[Any]] | None = None,
        tuned: bool = False,
    ) -> None:
        self.tuned = tuned
        self.keys = keys
        self.read = read
        self.aread = aread
        self.batch = batch
        self.decode_concurrency = decode_concurrency
        self.read_concurrency = read_concurrency

    def __len__(self) -> int:
        return -(-len(self.keys) // self.batch)

    def __iter__(self) -> Iterator[Any]:
        from feedline import Auto, PipelineBuilder
        from feedline.io import BufferPool, decode_image

        # Buffers in use at once: the one with the consumer, two in the sink, and those with
        # slots in flight: up to twice each stage's concurrency ahead (ordered stages) plus
        # the queues between them.
        most = 2 if self.tuned else 1  # a tuned stage goes up to twice its start
        in_flight = 3 * most * ((self.read_concurrency or 0) + self.decode_concurrency)
        pool = BufferPool((self.batch, *SIZE, 3), count=4 + -(-in_flight // self.batch))
        keys, read, batch = self.keys, self.read, self.batch

        def slots() -> Iterator[list[Any]]:
            for start in range(0, len(keys), batch):
                chunk = keys[start : start + batch]
                buffer = pool.acquire()[: len(chunk)]
                for j, key in enumerate(chunk):
                    yield [buffer, j, key]

        def fetch(task: list[Any]) -> list[Any]:
            task[2] = read(task[2])
            return task

        fetch_op: Callable[[list[Any]], Any] = fetch
        aread = self.aread
        if aread is not None:

            async def afetch(task: list[Any]) -> list[Any]:
                task[2] = await aread(task[2])
                return task

            fetch_op = afetch

        def decode(task: list[Any]) -> Any:
            buffer, j, data = task
            decode_image(data if self.read_concurrency else read(data), size=SIZE, out=buffer[j])
            return buffer if j == len(buffer) - 1 else None

        def width(n: int) -> int | Auto:
            return Auto(high=2 * n) if self.tuned else n

        builder: PipelineBuilder[Any] = PipelineBuilder()
        builder.add_source(slots())
        threads = most * self.decode_concurrency + 2  # and one each for the source, batching
        if self.read_concurrency:
            builder.pipe(
                fetch_op,
                concurrency=width(self.read_concurrency),
                output_order="input",
                name="read",
            )
            if aread is None:
                threads += most * self.read_concurrency
        pipeline = (
            builder.pipe(
                decode,
                concurrency=width(self.decode_concurrency),
                output_order="input",
                name="decode",
            )
            .pipe(_full_batches, name="batch")
            .add_sink(2)
            .build(num_threads=threads)
        )
        with pipeline.auto_stop():
            yield from pipeline


def _full_batches(batch: Any) -> Iterator[Any]:
    # Only the slot that completes a batch passes the batch on; the others yield nothing.
    if batch is not None:
        yield batch


class SleepDataset:
    """``dataset[i]``: sleep ``delay`` seconds (pure waiting, no CPU), return ``i``."""

    def __init__(self, length: int, delay: float) -> None:
        self.length = length
        self.delay = delay

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delay)
        return i


class PathsDataset:
    """``dataset[i]``: the length of path ``i`` (stands for opening it)."""

    def __init__(self, paths: Any) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        return len(self.paths[i])


def _children(pid: int) -> list[int]:
    return [child for child, stat in _stats() if int(_fields(stat)[1]) == pid]


def _stats() -> Iterator[tuple[int, str]]:
    """``(pid, text of /proc/pid/stat)`` for every process still there."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), (entry / "stat").read_text()
        except OSError:
            continue


def _fields(stat: str) -> list[str]:
    """The fields of a stat line after the command (which may hold spaces): state, ppid..."""
    return stat.rsplit(")", 1)[1].split()


_TICKS = os.sysconf("SC_CLK_TCK")


def descendants_cpu(pid: int, exclude: Collection[int] = ()) -> float:
    """CPU seconds of ``pid``'s live descendants, with what each has waited for.

    Each one's user and system time, and its children's once it waited for them (its
    ``cutime`` and ``cstime``): what a fork server's workers used counts once the fork
    server reaps them, though it never ends. ``exclude``: processes left out with their
    descendants. Added to :func:`process_cpu_seconds`, the sum only grows as processes end.
    """
    table = {p: _fields(text) for p, text in _stats()}
    kids: dict[int, list[int]] = {}
    for p, fields in table.items():
        kids.setdefault(int(fields[1]), []).append(p)
    total = 0.0
    todo = [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in exclude:
                fields = table[child]  # utime, stime, cutime, cstime: stat's fields 14-17
                total += sum(int(f) for f in fields[11:15]) / _TICKS
                todo.append(child)
    return total


def tree_cpu_seconds() -> float:
    """CPU seconds of this process and all its descendants, live ones included."""
    return process_cpu_seconds() + descendants_cpu(os.getpid())


def process_tree_memory(pid: int, exclude: Collection[int] = ()) -> tuple[int, int]:
    """(PSS, RSS) in bytes of ``pid`` and all its descendants but ``exclude`` (Linux ``/proc``).

    ``exclude``: processes left out with their descendants (a benchmark's helper server).
    """
    pss = rss = 0
    todo = [pid]
    while todo:
        current = todo.pop()
        if current in exclude:
            continue
        try:
            text = Path(f"/proc/{current}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Pss:"):
                pss += int(line.split()[1]) * 1024
            elif line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
        todo += _children(current)
    return pss, rss


class MemorySampler:
    """Samples the PSS and RSS of this process and its children.

    Every ``interval`` seconds from a thread of its own (``None``: only when :meth:`sample` is
    called), leaving out the processes in ``exclude``. ``cpu_s`` is the CPU time the samples
    took (reading ``/proc`` is not free), for the caller to subtract from what it measures.
    """

    def __init__(self, interval: float | None = 0.1, exclude: Collection[int] = ()) -> None:
        self.peak_pss = self.peak_rss = 0
        self.cpu_s = 0.0
        self._interval = interval
        self._exclude = frozenset(exclude)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def sample(self) -> None:
        """Take a sample now, on the calling thread."""
        t0 = time.thread_time()
        pss, rss = process_tree_memory(os.getpid(), self._exclude)
        with self._lock:
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            self.cpu_s += time.thread_time() - t0

    def _run(self) -> None:
        assert self._interval is not None
        # The first sample waits one interval: at the start it would only slow the loader
        # being timed, and the process has not grown yet.
        while not self._stop.wait(self._interval):
            self.sample()

    def __enter__(self) -> MemorySampler:
        if self._interval is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (waits for a sample under way: its CPU time counts in ``cpu_s``)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LoaderRun:
    """One pass of a loader: items, seconds, the first batch, and when each batch came."""

    items: int
    seconds: float
    first_batch_s: float
    cpu_s: float
    batch_times: list[float]
    batch_items: list[int]
    peak_pss: int = 0
    peak_rss: int = 0

    def steady(self) -> tuple[int, float]:
        """(items, seconds) over the last three quarters of the batches.

        The first quarter is left out: there a loader hands out what it prefetched while the
        clock was not running, which would flatter it.
        """
        n = len(self.batch_times)
        if n < 4:
            return self.items, self.seconds
        k = n // 4
        return sum(self.batch_items[k + 1 :]), self.batch_times[-1] - self.batch_times[k]


def time_loader(
    make: Callable[[], Iterable[Any]],
    max_batches: int | None = None,
    memory: bool = False,
    periodic: bool = True,
    exclude: Collection[int] = (),
) -> LoaderRun:
    """Build a loader with ``make()``, iterate it, and time the pass (building included).

    With ``memory``, also sample the peak PSS and RSS of this process and its children but
    ``exclude``: once when the first batch has arrived (after its time is taken), so that a
    short pass is sampled with its workers running, and with ``periodic`` every 100 ms. The
    CPU time the sampling takes is not counted in ``cpu_s``.
    """
    if not memory:
        return _time_loader(make, max_batches, exclude, None)
    with MemorySampler(0.1 if periodic else None, exclude) as sampler:
        run = _time_loader(make, max_batches, exclude, sampler)
    run.peak_pss, run.peak_rss = sampler.peak_pss, sampler.peak_rss
    run.cpu_s -= sampler.cpu_s
    return run


def _time_loader(
    make: Callable[[], Iterable[Any]],
    max_batches: int | None,
    exclude: Collection[int],
    sampler: MemorySampler | None,
) -> LoaderRun:
    # The whole tree's CPU: this process, the children it waited for (a loader's close()
    # joins its workers), and each live descendant with the children it waited for.
    me = os.getpid()
    tree0 = descendants_cpu(me, exclude)  # first: reading /proc costs this process CPU
    cpu0 = process_cpu_seconds() + tree0
    t0 = time.perf_counter()
    loader = make()
    times: list[float] = []
    sizes: list[int] = []
    for i, batch in enumerate(loader):
        times.append(time.perf_counter() - t0)
        sizes.append(len(batch))
        if i == 0 and sampler is not None:
            sampler.sample()
        if max_batches is not None and i + 1 >= max_batches:
            break
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    del loader
    seconds = time.perf_counter() - t0
    if sampler is not None:
        sampler.stop()  # before the last reading: each sample it takes is taken off cpu_s
    cpu = process_cpu_seconds() + descendants_cpu(me, exclude) - cpu0
    first = times[0] if times else seconds
    return LoaderRun(sum(sizes), seconds, first, cpu, times, sizes)


class LoaderCosts:
    """Times loaders with :func:`time_loader` and keeps what each contender's runs cost.

    :meth:`attach` writes the medians into each measurement's ``extra``: ``first_batch_ms``,
    ``cpu_s_per_1000`` (this process and its children), and with ``memory`` the peak
    ``peak_pss_mib`` and ``peak_rss_mib`` (children included, ``exclude`` left out), sampled
    when the first batch arrives and, with ``periodic``, every 100 ms.
    """

    def __init__(self, memory: bool = True, periodic: bool = True) -> None:
        self.memory = memory
        self.periodic = periodic
        self.exclude: set[int] = set()  # processes whose memory is not the contenders' (a server)
        self._runs: dict[tuple[str, str], dict[str, list[float]]] = {}

    def time(
        self,
        case: str,
        contender: str,
        make: Callable[[], Iterable[Any]],
        max_batches: int | None = None,
    ) -> LoaderRun:
        """One timed pass of ``make()``'s loader, recorded under ``(case, contender)``."""
        result = time_loader(make, max_batches, self.memory, self.periodic, self.exclude)
        record = self._runs.setdefault((case, contender), {})
        costs = {
            "first_batch_ms": 1000 * result.first_batch_s,
            "cpu_s_per_1000": 1000 * result.cpu_s / max(result.items, 1),
        }
        if self.memory:
            costs["peak_pss_mib"] = result.peak_pss / 2**20
            costs["peak_rss_mib"] = result.peak_rss / 2**20
        for key, value in costs.items():
            record.setdefault(key, []).append(value)
        return result

    def attach(self, measurements: Iterable[Any]) -> None:
        """Put the median of each recorded cost into the matching measurements' ``extra``."""
        for m in measurements:
            for key, values in self._runs.get((m.case, m.contender), {}).items():
                m.extra[key] = statistics.median(values)
