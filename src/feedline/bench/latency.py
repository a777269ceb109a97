"""The ``latency`` scenario: a dataset whose reads wait on a slow server.

Three cases, batches of 32: ``dataset[i]`` sleeps 20 ms (pure waiting); it GETs picture ``i``
from an HTTP server that waits 20 ms before replying, as object storage does; and it GETs with
a 30 ms wait and then decodes and resizes the JPEG to 224x224. The server runs in its own
process on asyncio (:mod:`._server`); each fetching thread keeps a keep-alive connection.
Contenders: PyTorch's DataLoader with 2 and 4 worker processes (the baseline is 2), feedline's
DataLoader (all reads of a batch at once, on threads), a plain ``ThreadPoolExecutor.map`` over
the indices, and with decoding a feedline pipeline: GETs in a stage of their own, 24 wide per
core, and decoding into pooled batch buffers in a stage as wide as the cores, so that only as
many threads decode as there are cores; and the same pipeline with its reads done by
:class:`feedline.RemoteStore` (obstore) on the event loop, when obstore is installed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest import mock

import numpy as np

from ._common import (
    Contender,
    Measurement,
    ScenarioResult,
    alternate,
    make_result,
    paired_ratio,
    round_ratios,
)
from ._data import jpeg_files, jpeg_source
from ._loaders import (
    HttpDataset,
    LoaderCosts,
    SleepDataset,
    SlotPipeline,
    decode_seconds,
    time_loader,
)
from ._registry import BenchOptions
from ._server import ServerProcess

__all__ = ["run"]

BATCH = 32
FETCH_CONCURRENCY = 128
TUNED = f"feedline, fetch_concurrency={FETCH_CONCURRENCY}"
FIXED = "feedline, fetch_concurrency=64"
NO_LEDGER = "feedline, no ledger"
# GETs in flight in the pipeline's read stage, per core: twice what one core's decode rate
# (about 400/s here) times the wait (31 ms) needs, so that reads never hold the decoders back.
READS_PER_CORE = 24


BEST = "best PyTorch (2 or 4 workers)"


def _against_best_pytorch(found: list[Measurement]) -> list[Measurement]:
    """Ratios to the faster PyTorch configuration of the case, per round."""
    best = max((m for m in found if m.contender.startswith("PyTorch")), key=lambda m: m.items_per_s)
    for m in found:
        m.ratio = paired_ratio(m.runs, best.runs)
        m.ratio_runs = round_ratios(m.runs, best.runs)
    return found


def _torch(dataset: Any, workers: int) -> Any:
    import torch.utils.data

    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers)


def _feedline(dataset: Any, tuned: bool = False, workers: int = 0, fixed: bool = False) -> Any:
    from feedline import DataLoader

    if fixed:  # a fixed setting to compare the tuner with: twice the batch, at most 64
        return DataLoader(dataset, batch_size=BATCH, fetch_concurrency=64)
    if not tuned:
        return DataLoader(dataset, batch_size=BATCH, num_workers=workers)
    return DataLoader(
        dataset, batch_size=BATCH, fetch_concurrency=FETCH_CONCURRENCY, prefetch_factor=4
    )


class _PoolLoader:
    """Batches from ThreadPoolExecutor.map over the indices: what one writes by hand."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Any:
        with ThreadPoolExecutor(FETCH_CONCURRENCY) as pool:
            batch: list[Any] = []
            for item in pool.map(self.dataset.__getitem__, range(len(self.dataset))):
                batch.append(item)
                if len(batch) == BATCH:
                    yield np.stack(batch)
                    batch = []
            if batch:
                yield np.stack(batch)


def _contenders(
    case: str,
    dataset: Any,
    big: Any,
    costs: LoaderCosts,
    decode: bool,
    workers: tuple[int, ...] = (2, 4),
) -> list[Contender]:
    """PyTorch over ``dataset``; the thread-based loaders over ``big``.

    ``big`` has more items, so that a faster loader's pass is not mostly its start-up. With
    ``decode``, a feedline pipeline (GETs in one stage, decoding in another) joins them. The
    loaders with worker processes run with each of ``workers``.
    """

    def timed(name: str, make: Any) -> tuple[int, float]:
        # The whole pass: a thread pool that submits every item at once would look
        # infinitely fast if timed from its first batch.
        result = costs.time(case, name, make)
        return result.items, result.seconds

    setups: list[tuple[str, Any]] = [
        (f"PyTorch workers={w}", functools.partial(_torch, dataset, w)) for w in workers
    ]
    # Worker processes over PyTorch's dataset: their first batch beside PyTorch's.
    setups += [
        (f"feedline workers={w}", functools.partial(_feedline, dataset, workers=w)) for w in workers
    ]
    setups += [
        ("feedline", lambda: _feedline(big)),
        # The epoch ledger's cost: the default with it turned off (FEEDLINE_LEDGER=0).
        (NO_LEDGER, lambda: _LedgerOff(_feedline(big))),
        (TUNED, lambda: _feedline(big, tuned=True)),
        (FIXED, lambda: _feedline(big, fixed=True)),
        ("ThreadPoolExecutor", lambda: _PoolLoader(big)),
    ]
    if decode:
        cores = os.cpu_count() or 1
        keys = range(len(big))
        at = 2 * len(workers) + 2  # after the default DataLoader and its ledger's cost
        setups.insert(
            at,
            (
                "feedline pipeline",
                lambda: SlotPipeline(
                    keys, big.get, BATCH, cores, read_concurrency=READS_PER_CORE * cores
                ),
            ),
        )
        store = _remote_store(big.url)
        if store is not None:
            setups.insert(
                at + 1,
                (
                    "feedline pipeline, RemoteStore",
                    lambda: SlotPipeline(
                        [str(k) for k in keys],
                        big.get,
                        BATCH,
                        cores,
                        read_concurrency=READS_PER_CORE * cores,
                        aread=store.read,
                    ),
                ),
            )
        setups.insert(
            at + 1,
            (
                "feedline pipeline, autotuned",
                lambda: SlotPipeline(
                    keys,
                    big.get,
                    BATCH,
                    cores,
                    read_concurrency=READS_PER_CORE * cores,
                    tuned=True,
                ),
            ),
        )
    return [Contender(name, functools.partial(timed, name, make)) for name, make in setups]


def _remote_store(url: str) -> Any:
    """A :class:`feedline.RemoteStore` on the server, or ``None`` without obstore.

    Read from once here, before any contender runs: obstore's runtime threads then run in
    every round alike (beside them, feedline's DataLoader workers start from the fork server).
    """
    try:
        from feedline import RemoteStore

        store = RemoteStore(url, retries=0)
    except ImportError:
        return None
    store.read_sync("0")
    return store


class _LedgerOff:
    """A DataLoader iterated with the epoch ledger turned off (``FEEDLINE_LEDGER=0``)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        with mock.patch.dict(os.environ, {"FEEDLINE_LEDGER": "0"}):
            iterator = iter(self.loader)  # the epoch's ledger is made (or not) here
        yield from iterator

    def close(self) -> None:
        """Close the loader."""
        self.loader.close()


def _http_cpu_per_item(server: ServerProcess, dataset: Any) -> float:
    """CPU seconds (this process and the server) per GET, measured over one feedline pass."""
    self0, server0 = time.process_time(), server.cpu_seconds()
    result = time_loader(lambda: _feedline(dataset))
    spent = time.process_time() - self0 + server.cpu_seconds() - server0
    return spent / max(result.items, 1)


def run(options: BenchOptions) -> ScenarioResult:
    """Run the latency scenario; ``options.quick`` shrinks it to a smoke test."""
    quick, progress = options.quick, options.progress
    repeats = 1 if quick else 5
    measurements: list[Measurement] = []
    count = options.size(640, 64, 32)
    workers = options.size((2, 4), (2, 4), (2,))  # a smoke test starts fewer processes
    files = jpeg_files(
        8 if quick else 64, "imagenet", options.data_dir, progress, options.steps, options.smoke_run
    )
    cases: list[tuple[str, float, bool | None]] = [
        ("20 ms sleep", 0.020, None),
        ("20 ms GET", 0.020, False),
        ("30 ms GET + decode", 0.030, True),
    ]
    http_cpu = 0.0
    costs = LoaderCosts()
    for label, delay, decode in cases:
        case = f"{label}, batch {BATCH}"
        with contextlib.ExitStack() as stack:
            if decode is None:
                dataset: Any = SleepDataset(count, delay)
                big: Any = SleepDataset(count * 5, delay)
            else:
                server = stack.enter_context(ServerProcess(files, delay))
                costs.exclude = {server.pid}  # the object store's memory is not the loaders'
                dataset = HttpDataset(server.url, count, decode=decode)
                big = HttpDataset(server.url, count * (2 if decode else 5), decode=decode)
                if not decode:
                    http_cpu = _http_cpu_per_item(server, big)
            contenders = _contenders(case, dataset, big, costs, bool(decode), workers)
            measurements += _against_best_pytorch(
                alternate(case, contenders, repeats, None, progress)
            )
    costs.attach(measurements)
    decode_cpu = decode_seconds([f.read_bytes() for f in files], max(3, repeats))
    cores = os.cpu_count() or 1
    bound = cores / (decode_cpu + http_cpu)
    last = measurements[-1].case
    measurements.append(
        Measurement(case=last, contender="machine bound", items_per_s=bound, runs=[bound])
    )
    base = max(
        (m for m in measurements if m.case == last and m.contender.startswith("PyTorch")),
        key=lambda m: m.items_per_s,
    )
    for m in measurements:
        if m.case == last:
            m.extra["of_bound"] = m.items_per_s / bound
    measurements[-1].ratio = bound / base.items_per_s
    notes = [
        jpeg_source(options.data_dir),
        f"machine bound for GET + decode: {cores} cores / (decode {decode_cpu * 1e3:.2f} ms + "
        f"HTTP client and server {http_cpu * 1e3:.2f} ms of CPU per item) = {bound:,.0f}/s; "
        "of_bound is each contender's share of it",
        f"{repeats} alternating run(s) per contender, medians; items/s over a whole pass, from "
        f"creating the loader to its last batch: {count} items for PyTorch, 5x as many for "
        "the thread-based loaders (2x with decoding), so that start-up weighs alike",
        f"feedline: DataLoader(batch_size={BATCH}) with its defaults (fetch_concurrency "
        "'auto': calls at once, up to 128, and batches in flight, from prefetch_factor's 2, "
        f"set by the tuner, from cold each pass); {FIXED}: fixed (twice the batch, at most "
        f"64), beside the tuned default; {TUNED}: also prefetch_factor=4; num_workers=0; "
        "the server is another process (asyncio, keep-alive)",
        "feedline workers=N: DataLoader(batch_size=32, num_workers=N) over PyTorch's items, "
        "for its first batch beside PyTorch's with as many workers; the process has read "
        "through a RemoteStore (for the pipeline's contender), so they start from the fork "
        "server, as for any user of obstore (PyTorch's fork them: its dataset does not read "
        "through obstore)",
        f"{NO_LEDGER}: the default with the epoch ledger turned off (FEEDLINE_LEDGER=0): its "
        "ratio to feedline is the ledger's cost",
        f"feedline pipeline: a read stage {READS_PER_CORE * cores} wide, then a decode stage "
        f"{cores} wide writing into pooled batch buffers (feedline.io.BufferPool); with "
        "RemoteStore, the reads are feedline.RemoteStore.read (obstore) awaited on the event "
        "loop instead of http.client calls on threads; autotuned: both stages "
        f"concurrency='auto' (reads from {cores}, at most {2 * READS_PER_CORE * cores}; "
        f"decode from {cores}, at most {2 * cores}), the tuner starting cold each pass",
        "CPU s per 1000 items: this process and every process under it (a fork server's "
        "workers included), not the server's; peak "
        "PSS / RSS: this process and its children but the server, sampled every 100 ms",
    ]
    return make_result(
        "latency",
        BEST,
        measurements,
        notes,
        True,
        headline=["feedline", "feedline pipeline"],
    )
