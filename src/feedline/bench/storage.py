"""The ``storage`` scenario: a store that throttles, and a store whose latency has a long tail.

A server on loopback (``_server.py``, in a process of its own) answers each GET after 20 ms
and refuses the GETs above :data:`CAP` per second with ``503 SlowDown``, as S3 refuses a
prefix's requests above its rate. Part-way, the cap is lifted (the store scaled the prefix
up). Each contender reads small objects the whole time with :data:`READERS` reads at once:

* **feedline**: a pipeline of ``RemoteStore.read`` (``concurrency=64``) with its defaults,
  the default failure budget included: a refusal lowers the requests in flight, and refused
  requests are sent again without counting as failures (``source/_throttle.py``);
* **obstore thread pool**: 64 threads calling ``obstore.get`` on a store with obstore's
  retries (5, with backoff; what one writes with obstore alone): each refused GET is retried
  on its own schedule while the others stay in flight.

Reported per contender (the medians of alternating rounds): objects delivered per second
once throttled for a while (the first :data:`SETTLE` seconds, or half the throttled time in
a quick run, are left out) and that rate as a share of the cap; refusals as a share of the
requests then; reads lost (failed after the retries; for feedline also when the failure
budget ended the pipeline); and the seconds from lifting the cap until a second's rate
reaches 90 % of the rate at the end. A chart shows one round of each over time: objects per
second, refusals per second, and feedline's in-flight limit.

The second case (with PyTorch installed) reads through ``feedline.DataLoader`` with its
defaults, a dataset whose ``__getitem__`` calls ``RemoteStore.read_sync``, in batches of 32
(epochs of 1,200 batches, measured over their middle three fifths):
from a server whose replies wait a lognormal time (median 20 ms, p99 ten times that, as
:data:`TAIL` says), against the same loader over a server whose replies all wait the same
mean, and against the loader with hedged ``read_sync`` (``RemoteStore(hedge=True)``) over
the tailed server. A batch waits for its slowest object: reported are objects per second
(the ratio to the store without the tail), the p99 of the consumer's wait per batch, and the
extra GETs the hedges sent.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ._common import Measurement, ScenarioResult, make_result, paired_ratio, round_ratios
from ._registry import BenchOptions
from ._server import ServerProcess

__all__ = ["CAP", "READERS", "SETTLE", "run"]

CAP = 300.0
"""GETs per second the server answers while throttling (the rest are refused)."""

READERS = 64
"""Reads at once, for each contender."""

SETTLE = 10.0
"""Seconds of throttling left out of the throttled figures (a full run)."""

TAIL = "lognormal:0.02:0.99:0.001:2.0"
"""Replies of the long-tailed store: median 20 ms, p99 about 200 ms, within 1 ms and 2 s."""

_TAIL_MEAN = 0.02 * math.exp(0.99**2 / 2)  # the same mean, without the tail (32.6 ms)
_DELAY = 0.02  # seconds before each reply
_OBJECT = 16 << 10  # bytes per object
_BATCH = 32

FEEDLINE = "feedline RemoteStore.read pipeline"
POOL = "obstore thread pool (64)"


class _Sampler:
    """Once a second: the server's GETs and refusals since the last tick, and a limit."""

    def __init__(self, server: ServerProcess, limit: Any, lift_at: float) -> None:
        self._server, self._limit, self._lift_at = server, limit, lift_at
        self.points: list[tuple[float, int, int, int]] = []  # (t, gets, refused, limit)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feedline-bench-sampler")
        self.start = time.monotonic()
        self.lifted: float | None = None

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        before = self._server.served()
        tick = self.start
        while not self._stop.wait(max(0.0, tick + 1.0 - time.monotonic())):
            tick += 1.0
            now = self._server.served()
            t = time.monotonic() - self.start
            self.points.append(
                (
                    t,
                    now["gets"] - before["gets"],
                    now["refused"] - before["refused"],
                    self._limit(),
                )
            )
            before = now
            if self.lifted is None and t >= self._lift_at:
                self._server.set_cap(0)
                self.lifted = t


def _feedline(server: ServerProcess, seconds: float, lift_at: float) -> dict[str, Any]:
    from feedline import PipelineBuilder, PipelineFailure, RemoteStore

    store = RemoteStore(server.url)
    builder: PipelineBuilder[str] = PipelineBuilder()
    pipeline = (
        builder.add_source(str(i) for i in itertools.count())
        .pipe(store.read, concurrency=READERS)
        .add_sink(READERS)
        .build()
    )
    ended = None
    with _Sampler(server, lambda: store.stats().in_flight_limit, lift_at) as sampler:
        try:
            for _ in pipeline:
                if time.monotonic() - sampler.start >= seconds:
                    break
        except PipelineFailure as error:
            ended = f"the pipeline failed after {time.monotonic() - sampler.start:.1f} s: {error}"
        finally:
            pipeline.stop()
    return {"points": sampler.points, "lost": store.stats().failures, "ended": ended}


def _pool(server: ServerProcess, seconds: float, lift_at: float) -> dict[str, Any]:
    from datetime import timedelta

    import obstore
    from obstore.store import from_url

    store = from_url(
        server.url,
        client_options={"allow_http": True},
        retry_config={
            "max_retries": 5,
            "retry_timeout": timedelta(seconds=120),
            "backoff": {
                "init_backoff": timedelta(seconds=0.1),
                "max_backoff": timedelta(seconds=5),
                "base": 2,
            },
        },
    )
    lost = [0] * READERS
    stop = threading.Event()

    def reader(k: int) -> None:
        i = k
        while not stop.is_set():
            try:
                obstore.get(store, str(i)).bytes()
            except Exception:
                lost[k] += 1
            i += READERS

    with (
        _Sampler(server, lambda: READERS, lift_at) as sampler,
        ThreadPoolExecutor(READERS, thread_name_prefix="feedline-bench-pool") as pool,
    ):
        for k in range(READERS):
            pool.submit(reader, k)
        time.sleep(seconds)
        stop.set()
    return {"points": sampler.points, "lost": sum(lost), "ended": None}


def _figures(run: dict[str, Any], settle: float, lift_at: float) -> dict[str, float]:
    points = run["points"]
    throttled = [p for p in points if settle < p[0] <= lift_at]
    after = [p for p in points if p[0] > lift_at + 1]
    gets = sum(p[1] for p in throttled)
    refused = sum(p[2] for p in throttled)
    span = max(1.0, len(throttled))
    figures = {
        "delivered_per_s": gets / span,
        "share_of_cap": gets / span / CAP,
        "refused_percent": 100 * refused / max(1, gets + refused),
        "lost": float(run["lost"]),
        "recovery_s": float("nan"),
    }
    if after:
        final = statistics.median(p[1] for p in after[-3:])
        figures["unthrottled_per_s"] = final
        reached = [p[0] for p in after if p[1] >= 0.9 * final]
        if reached:
            figures["recovery_s"] = reached[0] - lift_at
    return figures


def _measured(
    case: str, name: str, rates: list[float], base: list[float], extra: dict[str, float]
) -> Measurement:
    # One contender's medians, with its ratio to the baseline's runs round by round.
    return Measurement(
        case=case,
        contender=name,
        items_per_s=statistics.median(rates),
        runs=rates,
        ratio=paired_ratio(rates, base),
        ratio_runs=round_ratios(rates, base),
        extra=extra,
    )


class _Objects:
    """A map-style dataset of objects on a store: item ``i`` is the size of object ``i``."""

    def __init__(self, store: Any, count: int) -> None:
        self.store, self.count = store, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> int:
        return len(self.store.read_sync(str(i)))


def _loader(url: str, batches: int, hedge_sync: bool, server: ServerProcess) -> dict[str, float]:
    # One epoch of the DataLoader with its defaults, measured over its middle three fifths:
    # the ramp is left out, and so is the end, where the last batch waits for the slowest
    # of the epoch's last objects (a fixed cost per epoch, which a long epoch makes small).
    from feedline import DataLoader, RemoteStore

    store = RemoteStore(url, hedge=True if hedge_sync else None)
    loader: DataLoader[Any] = DataLoader(_Objects(store, _BATCH * batches), batch_size=_BATCH)
    first, last = batches // 5, batches - batches // 5
    gets = server.served()["gets"]
    taken = [time.perf_counter()]
    for _ in loader:
        taken.append(time.perf_counter())
    waits = sorted(taken[k + 1] - taken[k] for k in range(first, last))
    seconds = taken[last] - taken[first]
    objects = _BATCH * (last - first)
    stats = store.stats()
    sent = server.served()["gets"] - gets
    return {
        "rate": objects / seconds,
        "wait_p99_ms": 1000 * waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "extra_gets_percent": 100 * stats.hedged / max(1, sent - stats.hedged),
    }


def _tail_case(options: BenchOptions, body: Path, rounds: int) -> list[Measurement]:
    progress = options.progress or (lambda _m: None)
    batches = options.size(1200, 80, 20)
    flat_name = "feedline DataLoader, no tail (the same mean)"
    hedged = "feedline DataLoader, RemoteStore(hedge=True)"
    names = ["feedline DataLoader", hedged, flat_name]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with ServerProcess([body], TAIL) as tail, ServerProcess([body], _TAIL_MEAN) as flat:
        for r in range(rounds):
            for name in names:
                progress(f"long-tailed store: {name} (run {r + 1}/{rounds})")
                server = flat if name == flat_name else tail
                runs[name].append(_loader(server.url, batches, name == hedged, server))
    case = f"DataLoader, batches of {_BATCH}, GETs of 20 ms median and 200 ms p99"
    base = [r["rate"] for r in runs[flat_name]]
    flat_p99 = statistics.median(r["wait_p99_ms"] for r in runs[flat_name])
    out = []
    for name in names:
        rates = [r["rate"] for r in runs[name]]
        p99 = statistics.median(r["wait_p99_ms"] for r in runs[name])
        extra = {
            "wait_p99_ms": p99,
            "p99_vs_no_tail": p99 / flat_p99,
            "extra_gets_percent": statistics.median(r["extra_gets_percent"] for r in runs[name]),
        }
        out.append(_measured(case, name, rates, base, extra))
    return out


def run(options: BenchOptions) -> ScenarioResult:
    """Run the storage scenario; ``options.quick`` shrinks it to a smoke test."""
    progress = options.progress or (lambda _m: None)
    throttled_s = options.size(25.0, 10.0, 3.0)
    lifted_s = options.size(12.0, 6.0, 3.0)
    settle = SETTLE if not options.quick else throttled_s / 2
    rounds = 1 if options.quick else 3
    seconds = throttled_s + lifted_s
    import tempfile

    with tempfile.TemporaryDirectory(prefix="feedline-bench-storage-") as tmp:
        body = Path(tmp) / "object"
        body.write_bytes(bytes(range(256)) * (_OBJECT // 256))
        runs: dict[str, list[dict[str, Any]]] = {FEEDLINE: [], POOL: []}
        with ServerProcess([body], _DELAY, requests=CAP) as server:
            for r in range(rounds):
                for name, contender in ((POOL, _pool), (FEEDLINE, _feedline)):
                    progress(f"throttled store: {name} (run {r + 1}/{rounds}, {seconds:.0f} s)")
                    server.set_cap(CAP)
                    runs[name].append(contender(server, seconds, throttled_s))
        tail_measurements = []
        if importlib.util.find_spec("torch") is not None:
            tail_measurements = _tail_case(options, body, rounds)
    case = f"{CAP:.0f} GETs/s cap, 20 ms replies, lifted after {throttled_s:.0f} s"
    figures = {n: [_figures(r, settle, throttled_s) for r in rs] for n, rs in runs.items()}
    measurements = []
    for name in (POOL, FEEDLINE):
        per_run = figures[name]
        rates = [f["delivered_per_s"] for f in per_run]
        extra = {
            key: statistics.median(f.get(key, float("nan")) for f in per_run)
            for key in (
                "share_of_cap",
                "refused_percent",
                "lost",
                "recovery_s",
                "unthrottled_per_s",
            )
        }
        base = [f["delivered_per_s"] for f in figures[POOL]]
        measurements.append(_measured(case, name, rates, base, extra))
    notes = [
        f"{rounds} alternating round(s) of {seconds:.0f} s per contender, medians; items/s are "
        f"objects of {_OBJECT >> 10} KiB delivered per second while throttled, after the first "
        f"{settle:.0f} s; share_of_cap is that rate over the cap; refused_percent the refused "
        "share of the requests then (the server's counts); lost the reads that failed for "
        "good; recovery_s the seconds from lifting the cap until a second's rate reached 90 % "
        "of the rate at the end",
    ]
    notes += [f"{FEEDLINE}: {r['ended']}" for r in runs[FEEDLINE] if r["ended"]]
    if tail_measurements:
        notes.append(
            "long-tailed store: objects/s over the epoch's middle three fifths (the ramp, and "
            "the last batch's wait for the slowest of the last objects, left out); ratios to "
            "the loader "
            "over a store of the same mean latency without the tail; wait_p99_ms the p99 of "
            "the consumer's wait per batch; extra GETs the hedges as a share of the GETs "
            "the server answered"
        )
    else:
        notes.append("the long-tailed store's case needs PyTorch (pip install 'feedline[torch]')")
    result = make_result(
        "storage", POOL, measurements + tail_measurements, notes, True, unit="objects/s"
    )
    result.case_baselines = {m.case: "the same loader without the tail" for m in tail_measurements}
    result.headline = [FEEDLINE, "feedline DataLoader"]
    result.timelines = {
        f"{name}, round 1": [
            (
                t,
                gets,
                {"refused/s": refused, **({"in-flight limit": limit} if name == FEEDLINE else {})},
            )
            for t, gets, refused, limit in runs[name][0]["points"]
        ]
        for name in (POOL, FEEDLINE)
    }
    return result
