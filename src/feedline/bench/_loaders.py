"""What the DataLoader scenarios share: datasets, a slow HTTP server, and timing a loader.

Datasets live at module level so that PyTorch's worker processes can unpickle them.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DecodeDataset",
    "HttpDataset",
    "LoaderRun",
    "MemorySampler",
    "PathsDataset",
    "SleepDataset",
    "decode_seconds",
    "process_tree_memory",
    "time_loader",
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
    from ._common import threaded_loop

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

    def _get(self, i: int) -> bytes:
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
        data = self._get(i)
        return _decode_feedline(data) if self.decode else np.frombuffer(data, np.uint8)[:16].copy()


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
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def process_tree_memory(pid: int) -> tuple[int, int]:
    """(PSS, RSS) in bytes of ``pid`` and all its descendants (Linux ``/proc``)."""
    pss = rss = 0
    todo = [pid]
    while todo:
        current = todo.pop()
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
    """Samples the PSS and RSS of this process and its children every ``interval`` s."""

    def __init__(self, interval: float = 0.1) -> None:
        self.peak_pss = self.peak_rss = 0
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            pss, rss = process_tree_memory(pid)
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            if self._stop.wait(self._interval):
                return

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


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
    make: Callable[[], Iterable[Any]], max_batches: int | None = None, memory: bool = False
) -> LoaderRun:
    """Build a loader with ``make()``, iterate it, and time the pass (building included).

    With ``memory``, also sample the peak PSS and RSS of this process and its children.
    """
    sampler = MemorySampler() if memory else contextlib.nullcontext()
    with sampler:
        run = _time_loader(make, max_batches)
    if isinstance(sampler, MemorySampler):
        run.peak_pss, run.peak_rss = sampler.peak_pss, sampler.peak_rss
    return run


def _time_loader(make: Callable[[], Iterable[Any]], max_batches: int | None) -> LoaderRun:
    def cpu() -> float:
        t = os.times()  # children's CPU counts once they are waited for
        return t.user + t.system + t.children_user + t.children_system

    cpu0 = cpu()
    t0 = time.perf_counter()
    loader = make()
    times: list[float] = []
    sizes: list[int] = []
    for i, batch in enumerate(loader):
        times.append(time.perf_counter() - t0)
        sizes.append(len(batch))
        if max_batches is not None and i + 1 >= max_batches:
            break
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    del loader
    seconds = time.perf_counter() - t0
    first = times[0] if times else seconds
    return LoaderRun(sum(sizes), seconds, first, cpu() - cpu0, times, sizes)
