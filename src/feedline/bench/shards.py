"""The ``shards`` scenario: reading tar shards in memory, against Python's ``tarfile``.

A shard read whole from storage is a bytes object; what is left is to walk its members. The
baseline is what a WebDataset-style reader does with ``tarfile``: open the bytes through a
file object, iterate the ``TarInfo`` objects and ``extractfile(...).read()`` each file.
feedline's ``tar_members`` yields views of the shard (no copy); the copying variant makes
``bytes`` of each view, for a like-for-like comparison where a reader needs its own copy.
Two member sizes: small (labels, captions, a few kB: the per-member cost dominates) and
ImageNet-like (about 110 kB: the copy weighs in). Items are members per second.

"""

from __future__ import annotations

import functools
import io
import tarfile
import time
from typing import Any

import numpy as np

from ._common import Contender, Measurement, ScenarioResult, alternate, make_result
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
    return make_result(
        "shards",
        TARFILE,
        measurements,
        notes,
        True,
        unit="members/s",
        headline=["feedline tar_members (views)"],
    )
