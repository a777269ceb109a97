"""The ``webdataset`` scenario: tar shards over HTTP to decoded batches, against WebDataset.

Shards of ImageNet-like JPEGs (and a label each) on the benchmark's HTTP server, 20 ms per
request, to batches of 32 decoded 224x224 pictures. The baseline is what a WebDataset user
runs: ``webdataset.WebDataset`` over the shards' URLs (read with ``curl``, its default for
HTTP), decoding each sample in a ``map``, batched, in PyTorch's DataLoader with 1, 2, 4 and
as many workers as cores (at most one per shard; each worker reads its own shards); ratios are
to the best of them, round by round.
feedline: ``TarShards`` over a ``RemoteStore`` as the source of a pipeline that decodes on
as many threads as there are cores. Two cases:

* both decode with ``feedline.io.decode_image``, so the figures compare the loaders alone;
* WebDataset decodes as its users write it, ``.decode("pil")`` and a Pillow resize (what
  torchvision's ``Resize`` does on a PIL image), and feedline as above: the whole of what a
  WebDataset user would switch from.

Items are samples per second over a whole epoch.
"""

from __future__ import annotations

import functools
import io
import os
import statistics
import tarfile
import time
from pathlib import Path
from typing import Any

from ._common import Contender, Measurement, ScenarioResult, alternate, make_result, round_ratios
from ._registry import BenchOptions

__all__ = ["run"]

BATCH = 32
DELAY = 0.020
WDS = "webdataset + DataLoader"
BEST = f"{WDS} (best of its workers, per round)"
PIL = "Pillow"  # the marker of the case where WebDataset decodes as its users write it


def _decode(sample: dict[str, Any]) -> tuple[Any, int]:
    # The same for both loaders: the picture decoded and resized, and its label.
    import torch

    from feedline.io import decode_image

    image = decode_image(sample["jpg"], size=(224, 224))  # bytes or a view: not copied
    return torch.from_numpy(image), int(bytes(sample["cls"]))


def _pil_decode(sample: dict[str, Any]) -> tuple[Any, int]:
    # What a WebDataset user writes: .decode("pil") made the picture a PIL image; resized
    # with Pillow's antialiased bilinear filter (torchvision's Resize on a PIL image).
    import numpy as np
    import torch
    from PIL import Image

    image = sample["jpg"].resize((224, 224), Image.Resampling.BILINEAR)  # RGB already
    label = sample["cls"]
    return torch.from_numpy(np.array(image)), int(label if isinstance(label, int) else bytes(label))


def _write_shards(folder: Path, pictures: list[Path], shards: int, per_shard: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n in range(shards):
        path = folder / f"{n:04d}-{shards}x{per_shard}.tar"
        if not path.exists():
            temporary = path.with_suffix(".tmp")
            with tarfile.open(temporary, "w") as tar:
                for i in range(per_shard):
                    k = n * per_shard + i
                    body = pictures[k % len(pictures)].read_bytes()
                    for ext, data in (("jpg", body), ("cls", str(k % 1000).encode())):
                        info = tarfile.TarInfo(f"{k:07d}.{ext}")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
            temporary.replace(path)
        paths.append(path)
    return paths


def _count(batches: Any) -> tuple[int, float]:
    start = time.perf_counter()
    items = sum(len(batch[1]) for batch in batches)
    return items, time.perf_counter() - start


def _webdataset(urls: list[str], workers: int, pil: bool = False) -> tuple[int, float]:
    import torch
    import webdataset as wds

    start = time.perf_counter()
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    dataset = dataset.decode("pil").map(_pil_decode) if pil else dataset.map(_decode)
    dataset = dataset.batched(BATCH, partial=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    items, _ = _count(loader)
    return items, time.perf_counter() - start


def _feedline_shards(url: str, keys: list[str]) -> tuple[int, float]:
    import torch

    from feedline import PipelineBuilder, RemoteStore
    from feedline.source import TarShards

    start = time.perf_counter()
    cores = os.cpu_count() or 1
    pipeline = (
        PipelineBuilder[Any]()
        .add_source(TarShards(RemoteStore(url, retries=0), keys, read_ahead=2))
        .pipe(_decode, concurrency=cores)
        .aggregate(BATCH)
        .pipe(torch.utils.data.default_collate)
        .add_sink()
        .build()
    )
    items, _ = _count(pipeline)
    return items, time.perf_counter() - start


def run(options: BenchOptions) -> ScenarioResult:
    """Run the webdataset scenario; ``options.quick`` shrinks it to a smoke test."""
    from ._data import cache_dir, jpeg_files, jpeg_source
    from ._server import ServerProcess

    repeats = 1 if options.quick else 3
    shards, per_shard = (2, 16) if options.quick else (8, 96)
    pictures = jpeg_files(
        32 if options.quick else 128,
        "imagenet",
        options.data_dir,
        options.progress,
        options.steps,
        options.smoke_run,
    )
    paths = _write_shards(cache_dir(options.data_dir) / "shards-v1", pictures, shards, per_shard)
    megabytes = sum(p.stat().st_size for p in paths) / 1e6
    case = (
        f"{shards} shards of {per_shard} JPEGs ({megabytes / shards:,.0f} MB) from HTTP with "
        f"{DELAY * 1e3:.0f} ms per request, to batches of {BATCH} at 224x224"
    )
    found: list[Measurement] = []
    cores = os.cpu_count() or 1
    workers = (2,) if options.quick else sorted({1, 2, 4, max(1, min(cores, shards))})
    with ServerProcess(paths, DELAY) as server:
        urls = [f"{server.url}/{n}" for n in range(shards)]
        keys = [str(n) for n in range(shards)]
        feedline = "feedline TarShards + pipeline"
        # One pass of each, not timed: the first would pay this process's imports and the
        # server's first reads of the shards.
        _webdataset(urls, 1, pil=True)
        _feedline_shards(server.url, keys)
        for pil in (False, True):
            name = f"{WDS}, {PIL} decode" if pil else WDS
            contenders = [
                Contender(f"{name}, workers={w}", functools.partial(_webdataset, urls, w, pil))
                for w in workers
            ]
            contenders.append(
                Contender(feedline, functools.partial(_feedline_shards, server.url, keys))
            )
            where = "the same shards, WebDataset decoding with Pillow" if pil else case
            measured = alternate(where, contenders, repeats, None, options.progress)
            _to_best(measured)
            found += measured
    notes = [
        jpeg_source(options.data_dir),
        f"{repeats} alternating run(s) per contender, medians; samples/s over a whole epoch, "
        f"start included; each ratio is to the best {WDS} of the same round and case",
        "feedline decodes with feedline.io.decode_image at its defaults (mode='fast': a "
        "reduced DCT scale for large JPEGs and a box prefilter) in both cases; WebDataset "
        "with the same in the first case (the loaders compared alone), with .decode('pil') "
        "and a Pillow resize to 224x224 (bilinear, antialiased: torchvision's Resize on a PIL "
        "image) in the second (what its users write)",
        f"WebDataset at {', '.join(map(str, workers))} DataLoader workers; one untimed pass "
        "of each loader first",
    ]
    return make_result(
        "webdataset",
        BEST,
        found,
        notes,
        True,
        unit="samples/s",
        headline=["feedline TarShards + pipeline"],
    )


def _to_best(found: list[Measurement]) -> None:
    # Each contender's per-round ratios to the best WebDataset run of the same round.
    theirs = [m for m in found if m.contender.startswith(WDS)]
    best = [max(runs) for runs in zip(*(m.runs for m in theirs), strict=True)]
    for m in found:
        m.ratio_runs = round_ratios(m.runs, best)
        m.ratio = statistics.median(m.ratio_runs) if m.ratio_runs else None
