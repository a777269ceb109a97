"""The ``verify`` scenario: what checking object bodies costs, per GiB, against copying them.

``RemoteStore`` checks each whole object's bytes before returning or caching them: the MD5 of
the body against an ETag that is one (``source/_verify.py``), and ``ObjectCache`` checks its
files with a CRC-32 (ISA-L where installed). This scenario hashes the same 4 MiB objects with
each, on one and two threads, beside a plain copy of the bytes (``bytes(view)``, the least a
reader does with a body), so that the ratio says how much a check adds to handling the bytes
at all.
Throughput is in MiB/s; seconds per GiB are 1024 divided by it.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ._common import Contender, Measurement, ScenarioResult, alternate, make_result, threaded_loop
from ._registry import BenchOptions

__all__ = ["run"]

_OBJECT = 4 << 20  # bytes per object


def _md5(view: memoryview) -> Any:
    return hashlib.md5(view, usedforsecurity=False).digest()


def _checks() -> list[tuple[str, Callable[[memoryview], Any]]]:
    found: list[tuple[str, Callable[[memoryview], Any]]] = [
        ("copy", bytes),
        ("md5 (S3 ETag)", _md5),
        ("crc32 (zlib)", zlib.crc32),
    ]
    try:
        from isal import isal_zlib
    except ImportError:
        pass
    else:
        found.append(("crc32 (ISA-L)", isal_zlib.crc32))
    return found


def _mib(
    check: Callable[[memoryview], Any], objects: list[memoryview], threads: int
) -> tuple[int, float]:
    items, seconds = threaded_loop(check, objects, threads)
    return items * (_OBJECT >> 20), seconds  # MiB


def run(options: BenchOptions) -> ScenarioResult:
    """Run the verify scenario; ``options.quick`` shrinks it to a smoke test."""
    repeats = 1 if options.quick else 5
    count = 8 if options.quick else 64  # 32 MiB or 256 MiB per run
    data = np.random.default_rng(0).integers(0, 256, _OBJECT, dtype=np.uint8).tobytes()
    objects = [memoryview(data)] * count
    measurements: list[Measurement] = []
    for threads in (1, 2):
        contenders = []
        for name, check in _checks():
            contenders.append(Contender(name, functools.partial(_mib, check, objects, threads)))
        case = f"{count} objects of 4 MiB, {threads} thread(s)"
        measurements += alternate(case, contenders, repeats, "copy", options.progress)
    notes = [
        f"{repeats} alternating run(s) per contender, medians; items/s are MiB/s (seconds per "
        "GiB: 1024 / MiB/s); the ratio is to copying the bytes once",
        "RemoteStore checks MD5 against ETags that are MD5s (single-part S3 objects, HTTP "
        "servers); ObjectCache checks its files' CRC-32; both release the GIL",
    ]
    return make_result("verify", "copy", measurements, notes, True, unit="MiB/s")
