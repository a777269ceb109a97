"""The ``shards`` scenario: tar shards, in memory against ``tarfile``, and end to end.

A shard read whole from storage is a bytes object; what is left is to walk its members. The
baseline is what a WebDataset-style reader does with ``tarfile``: open the bytes through a
file object, iterate the ``TarInfo`` objects and ``extractfile(...).read()`` each file.
feedline's ``tar_members`` yields views of the shard (no copy); the copying variant makes
``bytes`` of each view, for a like-for-like comparison where a reader needs its own copy.
Two member sizes: small (labels, captions, a few kB: the per-member cost dominates) and
ImageNet-like (about 110 kB: the copy weighs in). Items are members per second.

End to end: shards of ImageNet-like JPEGs (and a label each) on the benchmark's HTTP server,
20 ms per request, to batches of 32 decoded 224x224 pictures. The baseline is what a
WebDataset user runs: ``webdataset.WebDataset`` over the shards' URLs (read with ``curl``,
its default for HTTP), decoding each sample in a ``map``, batched, in PyTorch's DataLoader
with 1, 2 and 4 workers (each worker reads its own shards). feedline: ``TarShards`` over a
``RemoteStore`` as the source of a pipeline that decodes on as many threads as there are
cores. Both decode with ``feedline.io.decode_image``, so the figures compare the loaders.
"""

from __future__ import annotations

import functools
import io
import os
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ._common import (
    Contender,
    Measurement,
    ScenarioResult,
    alternate,
    make_result,
    paired_ratio,
)
from ._registry import BenchOptions

__all__ = ["run"]

TARFILE = "tarfile + extractfile().read()"


def _shard(samples: int, big: int, seed: int) -> bytes:
    # ``samples`` samples of two members: a body of about ``big`` bytes and a small label.
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(samples):
            size = int(big * rng.uniform(0.5, 1.5))
            for ext, body in (("jpg", rng.bytes(size)), ("cls", str(i % 1000).encode())):
                info = tarfile.TarInfo(f"train/{seed:04d}-{i:06d}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def _tarfile(shards: list[bytes]) -> tuple[int, float]:
    start = time.perf_counter()
    count = 0
    for shard in shards:
        with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
            for member in tar:
                if member.isfile():
                    handle = tar.extractfile(member)
                    assert handle is not None
                    handle.read()
                    count += 1
    return count, time.perf_counter() - start


def _feedline(shards: list[bytes], copy: bool) -> tuple[int, float]:
    from feedline.io.tar import tar_members

    start = time.perf_counter()
    count = 0
    for k, shard in enumerate(shards):
        for member in tar_members(shard, shard=str(k)):
            if copy:
                bytes(member.data)
            count += 1
    return count, time.perf_counter() - start


BATCH = 32
DELAY = 0.020
WDS = "webdataset + DataLoader"


def _decode(sample: dict[str, Any]) -> tuple[Any, int]:
    # The same for both loaders: the picture decoded and resized, and its label.
    import torch

    from feedline.io import decode_image

    image = decode_image(bytes(sample["jpg"]), size=(224, 224))
    return torch.from_numpy(image), int(bytes(sample["cls"]))


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


def _webdataset(urls: list[str], workers: int) -> tuple[int, float]:
    import torch
    import webdataset as wds

    start = time.perf_counter()
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .map(_decode)
        .batched(BATCH, partial=True)
    )
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


def _end_to_end(options: BenchOptions, repeats: int) -> tuple[list[Measurement], list[str]]:
    import importlib.util

    from ._data import cache_dir, jpeg_files, jpeg_source
    from ._server import ServerProcess

    if importlib.util.find_spec("webdataset") is None or importlib.util.find_spec("torch") is None:
        return [], ["end to end: webdataset or torch is not installed: left out"]
    shards, per_shard = (2, 16) if options.quick else (8, 96)
    pictures = jpeg_files(
        32 if options.quick else 128, "imagenet", options.data_dir, options.progress, options.steps
    )
    paths = _write_shards(cache_dir(options.data_dir) / "shards-v1", pictures, shards, per_shard)
    megabytes = sum(p.stat().st_size for p in paths) / 1e6
    case = (
        f"{shards} shards of {per_shard} JPEGs ({megabytes / shards:,.0f} MB) from HTTP with "
        f"{DELAY * 1e3:.0f} ms per request, to batches of {BATCH} at 224x224"
    )
    with ServerProcess(paths, DELAY) as server:
        urls = [f"{server.url}/{n}" for n in range(shards)]
        contenders = [
            Contender(f"{WDS}, workers={w}", functools.partial(_webdataset, urls, w))
            for w in ((2,) if options.quick else (1, 2, 4))
        ]
        keys = [str(n) for n in range(shards)]
        feedline = "feedline TarShards + pipeline"
        contenders.append(
            Contender(feedline, functools.partial(_feedline_shards, server.url, keys))
        )
        found = alternate(case, contenders, repeats, contenders[0].name, options.progress)
    best = max((m for m in found if m.contender.startswith(WDS)), key=lambda m: m.items_per_s)
    for m in found:
        vs = paired_ratio(m.runs, best.runs)
        if vs is not None:
            m.extra["vs_best_webdataset"] = vs
    notes = [
        jpeg_source(options.data_dir),
        f"end to end: items/s are samples per second over a whole epoch, start included; "
        f"vs_best_webdataset: per-round ratio to the best of {WDS} ({best.contender})",
    ]
    return found, notes


def run(options: BenchOptions) -> ScenarioResult:
    """Run the shards scenario; ``options.quick`` shrinks it to a smoke test."""
    repeats = 1 if options.quick else 7
    measurements: list[Measurement] = []
    sizes: list[tuple[str, int, int]] = [("small members (~2 kB)", 2_000, 1000)]
    sizes.append(("ImageNet-like members (~110 kB)", 110_000, 100))
    for label, big, per_shard in sizes:
        count = 2 if options.quick else 8
        if options.progress:
            options.progress(f"{label}: writing {count} shards")
        shards = [_shard(per_shard, big, seed) for seed in range(count)]
        contenders: list[Contender] = [
            Contender(TARFILE, functools.partial(_tarfile, shards)),
            Contender("feedline tar_members (views)", functools.partial(_feedline, shards, False)),
            Contender("feedline tar_members + bytes()", functools.partial(_feedline, shards, True)),
        ]
        megabytes = sum(len(s) for s in shards) / 1e6
        case = f"{label}, {count} shards of {megabytes / count:,.0f} MB in memory"
        measurements += alternate(case, contenders, repeats, TARFILE, options.progress)
    notes: list[Any] = [
        f"{repeats} alternating run(s) per contender, medians; in memory, items/s are members "
        "per second (each sample is a body and a label); the ratio is to tarfile's",
        "views: memoryviews of the shard, no copy (what TarShards hands out unshuffled); "
        "+ bytes(): each member copied, as tarfile's read() copies it",
    ]
    found, more = _end_to_end(options, 1 if options.quick else 3)
    measurements += found
    notes += more
    return make_result(
        "shards",
        TARFILE,
        measurements,
        notes,
        True,
        unit="members/s",
        headline=["feedline tar_members (views)", "feedline TarShards + pipeline"],
    )
