"""The ``engine`` scenario: what the pipeline engine itself costs, against SPDL and a thread pool.

(a) Overhead: items/s through three no-op stages (sync, then async) at concurrency 1 and 8,
    with a sink of 3 (SPDL's default) on both sides, then with feedline's default sink (which
    grows), and what ``build(resumable=True)`` costs on top, with and without its epoch
    ledger (``FEEDLINE_LEDGER=0``); and the latency of handing one
    item through an idle pipeline to the consumer. With a 3-item sink and a consumer that
    does nothing, the consumer's thread and the pipeline's take turns every few items, each
    turn a thread wake-up; the growing sink shows what the stages themselves cost.
(b) A stage that releases the GIL (SHA-256 of 1 MiB) at concurrency 1, 2 and 4, against
    ``ThreadPoolExecutor.map`` doing the same work: the engine should add nothing measurable.
(c) A stage that holds the GIL (read an annotation file, ``json.loads`` it, loop over its
    boxes into an array), on 2 threads against a process region of 2 worker processes
    (``pipe_in_processes``): what moving it out of the GIL's reach buys on 2 cores.

SPDL (``spdl.pipeline``, PyPI ``spdl``) runs as a contender when it is installed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest import mock

from feedline import PipelineBuilder

from ._common import Contender, Measurement, ScenarioResult, alternate, make_result
from ._loaders import tree_cpu_seconds
from ._registry import BenchOptions

__all__ = ["run"]

_MIB = 1 << 20


def _noop(x: Any) -> Any:
    return x


async def _anoop(x: Any) -> Any:
    return x


def _sha256(buf: bytes) -> bytes:
    return hashlib.sha256(buf).digest()


_OPS = (("sync", _noop), ("async", _anoop))


def _spdl() -> Any | None:
    try:
        import spdl.pipeline as sp
    except ImportError:
        return None
    return sp


def _feedline_pipeline(
    source: Any,
    op: Callable[..., Any],
    stages: int,
    concurrency: int,
    num_threads: int,
    sink: int | None,
    resumable: bool = False,
) -> Any:
    b: PipelineBuilder[Any] = PipelineBuilder().add_source(source)
    for _ in range(stages):
        b = b.pipe(op, concurrency=concurrency)
    return b.add_sink(sink).build(num_threads=num_threads, resumable=resumable)


def _spdl_pipeline(
    sp: Any,
    source: Any,
    op: Callable[..., Any],
    stages: int,
    concurrency: int,
    num_threads: int,
    sink: int,
) -> Any:
    b = sp.PipelineBuilder().add_source(source)
    for _ in range(stages):
        b = b.pipe(op, concurrency=concurrency)
    return b.add_sink(sink).build(num_threads=num_threads)


def _drain(pipeline: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    with pipeline.auto_stop():
        for _ in pipeline:
            n += 1
    return n, time.perf_counter() - t0


def _overhead(n: int, repeats: int, sink: int, progress: Any) -> list[Measurement]:
    sp = _spdl()
    out: list[Measurement] = []
    for label, op in _OPS:
        for conc in (1, 8):
            case = f"3 {label} no-op stages, concurrency {conc}"
            threads = max(8, conc)

            def ours(
                op: Any = op, conc: int = conc, threads: int = threads, size: int | None = sink
            ) -> tuple[int, float]:
                return _drain(_feedline_pipeline(range(n), op, 3, conc, threads, size))

            # The cost of build(resumable=True): each item carries its source number through
            # every stage, wrapped and unwrapped once per stage.
            def resumable(
                op: Any = op, conc: int = conc, threads: int = threads
            ) -> tuple[int, float]:
                return _drain(_feedline_pipeline(range(n), op, 3, conc, threads, sink, True))

            # And of the epoch ledger a resumable pipeline keeps (FEEDLINE_LEDGER=0: none).
            def no_ledger(
                op: Any = op, conc: int = conc, threads: int = threads
            ) -> tuple[int, float]:
                with mock.patch.dict(os.environ, {"FEEDLINE_LEDGER": "0"}):
                    return resumable(op, conc, threads)

            contenders = [
                Contender("feedline, add_sink(3)", ours),
                Contender("feedline, add_sink(3), resumable", resumable),
                Contender("feedline, add_sink(3), resumable, no ledger", no_ledger),
                # What a user gets without add_sink: a sink that grows while it, rather than
                # the stages, is what keeps the consumer waiting.
                Contender("feedline", functools.partial(ours, size=None)),
            ]
            if sp is not None:

                def theirs(
                    op: Any = op, conc: int = conc, threads: int = threads
                ) -> tuple[int, float]:
                    return _drain(_spdl_pipeline(sp, range(n), op, 3, conc, threads, sink))

                contenders.append(Contender("spdl", theirs))
            out += alternate(case, contenders, repeats, "spdl" if sp else None, progress)
    return out


def _timed_source(n: int, gap: float) -> Iterator[float]:
    for _ in range(n):
        time.sleep(gap)
        yield time.perf_counter()


def _latency(n: int, repeats: int, progress: Any) -> list[Measurement]:
    """Seconds from the source yielding an item to the consumer holding it (idle pipeline)."""
    sp = _spdl()
    builders: list[tuple[str, Callable[[], Any]]] = [
        ("feedline", lambda: _feedline_pipeline(_timed_source(n, 0.002), _noop, 3, 1, 4, 3))
    ]
    if sp is not None:
        builders.append(
            ("spdl", lambda: _spdl_pipeline(sp, _timed_source(n, 0.002), _noop, 3, 1, 4, 3))
        )
    samples: dict[str, list[float]] = {name: [] for name, _ in builders}
    for r in range(repeats):
        for name, make in builders:
            if progress is not None:
                progress(f"hand-off latency: {name} (run {r + 1}/{repeats})")
            pipeline = make()
            with pipeline.auto_stop():
                for t in pipeline:
                    samples[name].append(time.perf_counter() - t)
    out = []
    for name, v in samples.items():
        v.sort()
        p50 = statistics.median(v)
        p99 = v[min(len(v) - 1, int(0.99 * len(v)))]
        out.append(
            Measurement(
                case="hand-off latency (idle pipeline)",
                contender=name,
                items_per_s=1.0 / p50,
                runs=[],
                extra={"p50_us": p50 * 1e6, "p99_us": p99 * 1e6},
            )
        )
    base = next((m for m in out if m.contender == "spdl"), None)
    if base is not None:
        for m in out:
            m.ratio = base.extra["p50_us"] / m.extra["p50_us"]
    return out


def _gil_free(n: int, repeats: int, progress: Any) -> list[Measurement]:
    sp = _spdl()
    buffers = [bytes([i]) * _MIB for i in range(8)]
    items = [buffers[i % len(buffers)] for i in range(n)]
    out: list[Measurement] = []
    for conc in (1, 2, 4):
        case = f"sha256(1 MiB), concurrency {conc}"

        def pool_map(conc: int = conc) -> tuple[int, float]:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(conc) as ex:
                k = sum(1 for _ in ex.map(_sha256, items))
            return k, time.perf_counter() - t0

        def ours(conc: int = conc) -> tuple[int, float]:  # the default sink
            return _drain(_feedline_pipeline(items, _sha256, 1, conc, conc + 1, None))

        def ours_3(conc: int = conc) -> tuple[int, float]:
            return _drain(_feedline_pipeline(items, _sha256, 1, conc, conc + 1, 3))

        contenders = [Contender("ThreadPoolExecutor.map", pool_map), Contender("feedline", ours)]
        if 2 * conc > 3:  # where the default sink is longer than SPDL's 3
            contenders.append(Contender("feedline, add_sink(3)", ours_3))
        if sp is not None:

            def theirs(conc: int = conc) -> tuple[int, float]:
                return _drain(_spdl_pipeline(sp, items, _sha256, 1, conc, conc + 1, 3))

            contenders.append(Contender("spdl", theirs))
        out += alternate(case, contenders, repeats, "ThreadPoolExecutor.map", progress)
    return out


def _annotations(path: str) -> Any:
    # Holds the GIL throughout: read an annotation file, parse its JSON, loop over its boxes.
    import json

    import numpy as np

    with open(path, "rb") as f:
        boxes = json.loads(f.read())["boxes"]
    return np.array([[b["x"], b["y"], b["w"], b["h"]] for b in boxes], dtype=np.float32)


def _gil_holding(n: int, repeats: int, progress: Any) -> list[Measurement]:
    import json
    import random
    import tempfile
    from pathlib import Path

    rng = random.Random(0)
    folder = Path(tempfile.mkdtemp(prefix="feedline-bench-json-"))
    paths = []
    for k in range(16):
        boxes = [{"x": rng.random(), "y": rng.random(), "w": rng.random(), "h": rng.random()}]
        paths.append(folder / f"{k}.json")
        paths[-1].write_text(json.dumps({"boxes": boxes * 2000}))
    items = [str(paths[i % len(paths)]) for i in range(n)]
    threads = PipelineBuilder[str]().add_source(items).pipe(_annotations, concurrency=2)
    region = PipelineBuilder[str]().add_source(items).pipe_in_processes(_annotations, processes=2)
    pipelines: dict[str, Any] = {
        "feedline, 2 threads": threads.add_sink().build(),
        "feedline, process region of 2": region.add_sink().build(),
    }
    sum(1 for _ in pipelines["feedline, process region of 2"])  # starts the workers: untimed

    def epoch(name: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        k = sum(1 for _ in pipelines[name])
        return k, time.perf_counter() - t0

    size = paths[0].stat().st_size // 1000
    case = f"annotation files of {size} kB: read, json.loads, a loop (holds the GIL), 2 cores"
    contenders = [Contender(name, functools.partial(epoch, name)) for name in pipelines]
    try:
        # The region's workers live across the epochs: their CPU counts as it is spent.
        return alternate(
            case,
            contenders,
            repeats,
            "feedline, 2 threads",
            progress,
            cpu_seconds=tree_cpu_seconds,
        )
    finally:
        for path in paths:
            path.unlink()
        folder.rmdir()


def run(options: BenchOptions) -> ScenarioResult:
    """Run the engine scenario; ``options.quick`` shrinks it to a smoke test."""
    quick, progress = options.quick, options.progress
    repeats = 1 if quick else 5
    n_items = 500 if quick else 5_000
    n_hash = 16 if quick else 1_000
    sink = 3
    measurements = _overhead(n_items, repeats, sink, progress)
    measurements += _latency(20 if quick else 200, repeats, progress)
    measurements += _gil_free(n_hash, repeats, progress)
    measurements += _gil_holding(40 if quick else 600, repeats, progress)
    notes = [
        f"{repeats} alternating run(s) per contender, medians; no-op cases move {n_items} items "
        f"with add_sink(buffer_size={sink}) (SPDL's default) where the contender says so, "
        "else with feedline's default sink (which starts at 3, or 16 at concurrency 8, and "
        "doubles up to 64 items while it keeps the consumer waiting), and "
        "num_threads=max(8, concurrency); "
        "the queues between stages are each library's defaults (feedline: max(2, concurrency) "
        "after a sync stage, max(8, concurrency) after an async one, each doubling up to 512 "
        "items while this stage is cheap and the doubled queue holds under 8 ms of the next "
        "stage's calls at its concurrency, when its size "
        "keeps the next stage waiting or it is filled)",
        "hand-off latency: items/s column is 1/p50; ratio is SPDL's p50 / ours (higher is better)",
        "sha256: ThreadPoolExecutor.map keeps every result; a pipeline bounds its output buffer "
        "(by default two results per slot of the last stage, at least 3, growing while it "
        "keeps the consumer waiting; SPDL: 3), and pays a wake-up to restart a stage that "
        "stopped on a full buffer",
        "annotation files: the baseline is the same stage on 2 threads; the process region's "
        "workers start in a first epoch that is not timed, and serve the timed ones; its "
        "CPU per item counts the workers' CPU too",
    ]
    return make_result(
        "engine",
        "spdl / ThreadPoolExecutor.map",
        measurements,
        notes,
        _spdl() is not None,
        headline=["feedline"],
    )
