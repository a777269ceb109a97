"""The ``images`` scenario: JPEG files to batches of 32 224x224 RGB arrays.

Every contender reads the same ImageNet-like JPEGs from disk (page cache), decodes and resizes
them to 224x224 and batches them by 32:

* ``PyTorch + PIL, workers=N``: ``torch.utils.data.DataLoader`` over a dataset whose
  ``__getitem__`` opens the file and runs Pillow (as torchvision users do); the baseline is
  the best of N = 2 and 4 (this machine's cores, and twice that);
* ``PyTorch + feedline decode, workers=N``: the same, with feedline's decode function;
* ``feedline DataLoader``: ``feedline.DataLoader`` (threads, no processes, default arguments)
  over the dataset with feedline's decode function;
* ``feedline pipeline``: a pipeline that decodes each picture straight into its slot of a
  pooled batch buffer (no collation copy): what feedline is built for;
* ``ThreadPoolExecutor.map``: the plain thread pool a user would write by hand, one thread
  per core mapping the same ``dataset[i]`` in order, ``np.stack`` by 32;
* ``SPDL pipeline`` (when ``spdl.io`` can decode here; see :mod:`._ffmpeg`): SPDL's own way,
  as its examples write it: an ``spdl.pipeline`` that demuxes and decodes each file with
  FFmpeg's scale filter to 224x224 RGB in a stage as wide as the cores, groups 32 frames and
  converts them to one batch array.

The upper bound is the single-thread rate of the decode function on in-memory bytes times the
number of cores: no contender can beat it on this machine. It is measured in every round, beside
the contenders, and each contender's share of it (``of_bound``) is the median of its per-round
shares. It assumes the cores scale perfectly; ``decode alone, N threads`` (the same decode on
one thread per core, in memory) shows what they give, and ``of_decode_alone`` each contender's
share of that: for those that decode with feedline's function, what reading, batching and
handing over leave of the decoder's rate (the reference is timed over a whole pass, the
loaders over their steady part).
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ._common import (
    Contender,
    ScenarioResult,
    alternate,
    make_result,
    paired_ratio,
    round_ratios,
    threaded_loop,
)
from ._data import jpeg_files, jpeg_source
from ._loaders import DECODERS, LoaderCosts, SlotPipeline
from ._registry import BenchOptions
from .decode import spdl_decoder, spdl_scale_filter

__all__ = ["FileDataset", "SpdlPipeline", "ThreadPoolBatches", "run"]

BATCH = 32
SIZE = (224, 224)


class FileDataset:
    """``dataset[i]``: read JPEG file ``i`` and decode it to 224x224 with ``decoder``."""

    def __init__(self, paths: list[str], decoder: str) -> None:
        self.paths = paths
        self.decoder = decoder

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        with open(self.paths[i], "rb") as f:
            return DECODERS[self.decoder](f.read())


def _torch_loader(paths: list[str], decoder: str, workers: int) -> Any:
    import torch.utils.data

    dataset: Any = FileDataset(paths, decoder)
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers)


def _feedline_loader(paths: list[str], fixed: bool = False) -> Any:
    from feedline import DataLoader

    # Its defaults, as a user would start: the fetcher finds that decoding computes and runs
    # about one call per core (measured on 2 cores: as fast as fetch_concurrency=2 or 3).
    # fixed: twice the batch size, at most 64 calls at once, to compare the tuner with.
    dataset = FileDataset(paths, "feedline")
    if fixed:
        return DataLoader(dataset, batch_size=BATCH, fetch_concurrency=64)
    return DataLoader(dataset, batch_size=BATCH)


class SpdlPipeline:
    """Batches from an ``spdl.pipeline`` decoding with ``spdl.io``, as SPDL's examples do."""

    def __init__(self, paths: list[str], batch: int, concurrency: int) -> None:
        self.paths = paths
        self.batch = batch
        self.concurrency = concurrency

    def __len__(self) -> int:
        return -(-len(self.paths) // self.batch)

    def __iter__(self) -> Any:
        import spdl.io as sio
        from spdl.pipeline import PipelineBuilder as SpdlBuilder

        scale = spdl_scale_filter()

        def decode(path: str) -> Any:
            return sio.decode_packets(sio.demux_image(path), filter_desc=scale)

        def batchify(frames: list[Any]) -> Any:
            return sio.to_numpy(sio.convert_frames(frames))

        builder: Any = SpdlBuilder()
        pipeline = (
            builder.add_source(self.paths)
            .pipe(decode, concurrency=self.concurrency)
            .aggregate(self.batch)
            .pipe(batchify)
            .add_sink(3)
            .build(num_threads=self.concurrency)
        )
        with pipeline.auto_stop():
            yield from pipeline


class ThreadPoolBatches:
    """Batches of ``ThreadPoolExecutor.map`` over ``dataset[i]``, stacked: the hand-written way.

    ``map`` submits every item at once and keeps every result until it is taken, as users'
    code does; the pool's pending work is cancelled if the consumer stops early.
    """

    def __init__(self, paths: list[str], batch: int, threads: int) -> None:
        self.dataset = FileDataset(paths, "feedline")
        self.batch = batch
        self.threads = threads

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch)

    def __iter__(self) -> Any:
        pool = ThreadPoolExecutor(self.threads)
        try:
            group: list[Any] = []
            for item in pool.map(self.dataset.__getitem__, range(len(self.dataset))):
                group.append(item)
                if len(group) == self.batch:
                    yield np.stack(group)
                    group = []
            if group:
                yield np.stack(group)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


BOUND = "upper bound"


def _bound_run(pictures: list[bytes], cores: int) -> tuple[int, float]:
    # One thread decodes every picture in memory; the bound is that rate times the cores.
    items, seconds = threaded_loop(DECODERS["feedline"], pictures, 1)
    return items * cores, seconds


def _threads_run(pictures: list[bytes], cores: int) -> tuple[int, float]:
    # The decoder alone on one thread per core, in memory: what the cores really give it.
    return threaded_loop(DECODERS["feedline"], pictures, cores)


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def run(options: BenchOptions) -> ScenarioResult:
    """Run the images scenario; ``options.quick`` shrinks it to a smoke test."""
    quick, progress = options.quick, options.progress
    repeats = 1 if quick else 5
    count = options.size(1024, 64, 32)
    cores = os.cpu_count() or 1
    files = jpeg_files(
        count, "imagenet", options.data_dir, progress, options.steps, options.smoke_run
    )
    paths = [str(p) for p in files]
    pictures = [Path(p).read_bytes() for p in paths]
    case = f"{count} JPEGs -> batches of {BATCH}x224x224x3"
    costs = LoaderCosts()

    def timed(name: str, make: Any) -> tuple[int, float]:
        return costs.time(case, name, make).steady()

    setups: list[tuple[str, Any]] = []
    for workers in options.size((cores, 2 * cores), (cores, 2 * cores), (cores,)):
        for decoder, label in (("PIL", "PIL"), ("feedline", "feedline decode")):
            setups.append(
                (
                    f"PyTorch + {label}, workers={workers}",
                    functools.partial(_torch_loader, paths, decoder, workers),
                )
            )
    setups.append(("feedline DataLoader", functools.partial(_feedline_loader, paths)))
    setups.append(
        (
            "feedline DataLoader, fetch_concurrency=64",
            functools.partial(_feedline_loader, paths, fixed=True),
        )
    )
    setups.append(
        ("feedline pipeline", functools.partial(SlotPipeline, paths, _read_file, BATCH, cores))
    )
    setups.append(
        (
            "feedline pipeline, autotuned",
            functools.partial(SlotPipeline, paths, _read_file, BATCH, cores, tuned=True),
        )
    )
    setups.append(
        ("ThreadPoolExecutor.map", functools.partial(ThreadPoolBatches, paths, BATCH, cores))
    )
    spdl_missing = spdl_decoder()[1]  # why SPDL cannot decode here, if it cannot
    if spdl_missing is None:
        setups.append(("SPDL pipeline", functools.partial(SpdlPipeline, paths, BATCH, cores)))
    contenders = [Contender(name, functools.partial(timed, name, make)) for name, make in setups]
    # The bound is measured in every round too, so that each contender's share of it compares
    # runs taken minutes apart at most, on a machine whose speed drifts.
    contenders.append(Contender(BOUND, functools.partial(_bound_run, pictures, cores)))
    threads_ref = f"decode alone, {cores} threads"
    contenders.append(Contender(threads_ref, functools.partial(_threads_run, pictures, cores)))
    found = alternate(case, contenders, repeats, BOUND, progress)
    bound = next(m for m in found if m.contender == BOUND)
    del bound.extra["cpu_s_per_1000"]  # its items are scaled by the cores: not a cost
    for m in found:
        if m.ratio is not None:
            m.extra["of_bound"] = m.ratio
    pil = [m for m in found if m.contender.startswith("PyTorch + PIL")]
    best_pil = max(pil, key=lambda m: m.items_per_s)
    spdl = next((m for m in found if m.contender == "SPDL pipeline"), None)
    alone = next(m for m in found if m.contender == threads_ref)
    for m in found:
        m.ratio = paired_ratio(m.runs, best_pil.runs)
        m.ratio_runs = round_ratios(m.runs, best_pil.runs)
        if m.contender in (BOUND, threads_ref):
            continue
        vs_spdl = paired_ratio(m.runs, spdl.runs) if spdl is not None else None
        if vs_spdl is not None:
            m.extra["vs_spdl"] = vs_spdl
        of_alone = paired_ratio(m.runs, alone.runs)
        if of_alone is not None:
            m.extra["of_decode_alone"] = of_alone
    costs.attach(found)
    notes = [
        jpeg_source(options.data_dir),
        f"{repeats} alternating run(s) per contender, medians; steady images/s (over the "
        "last three quarters of a pass, so that prefetched batches do not count); ratio to "
        f"the best PyTorch + PIL configuration ({best_pil.contender}), the median of the "
        "per-round ratios",
        f"upper bound: feedline's decode on one thread, in memory, x {cores} cores = "
        f"{bound.items_per_s:,.0f} images/s (median; measured in every round); of_bound is "
        "each contender's share of it, the median of its per-round shares",
        f"{threads_ref}: the same decode on {cores} threads, in memory, each looping over its "
        f"share ({alone.items_per_s:,.0f} images/s, {alone.extra.get('of_bound', 0):.0%} of "
        "the bound: how the cores scale); of_decode_alone is each contender's share of it",
        spdl_missing
        or f"SPDL pipeline: spdl.io demux + decode with FFmpeg's bilinear scale filter, "
        f"{cores} wide, then aggregate({BATCH}) and convert_frames to one array (SPDL's own "
        "pattern; its stages pass items on in completion order, feedline's in input order)",
        "feedline DataLoader: its defaults (fetch_concurrency='auto': the tuner sets calls "
        "at once, up to 128, and batches in flight, from cold each pass); "
        "fetch_concurrency=64: fixed (twice the batch size, at most 64), beside the tuned default",
        f"feedline pipeline, autotuned: the same pipeline with its decode stage "
        f"concurrency='auto' (from {cores}, at most {2 * cores}) instead of {cores}: each "
        "pass starts the tuner cold",
        f"{np.mean([len(p) for p in pictures]) / 1024:.0f} KiB per JPEG on average",
        "peak PSS / RSS: this process and its children, sampled every 100 ms during a pass; "
        "the benchmark's own process (Python, torch, OpenCV loaded) is in every figure",
    ]
    return make_result(
        "images",
        "best PyTorch + PIL",
        found,
        notes,
        True,
        unit="images/s",
        headline=["feedline DataLoader", "feedline pipeline"],
    )
