"""How long a process takes to get a prefix's keys: listing the store, or reading the manifest.

    python tools/listing_startup.py [KEYS]       (default 20000; needs the test extras: moto)

Puts KEYS empty objects into a moto S3 server on loopback (the one the tests use), then, three
times over a fresh cache directory, times ``RemoteStore.keys`` as the first process of a job
runs it (listing the store, a page of 1,000 keys per request) and as every later one does
(another store on the same directory: the manifest). Prints the medians and their ratio. A
loopback moto server answers a page slower than S3 does; the ratio is what matters.
"""

from __future__ import annotations

import importlib
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from feedline import RemoteStore
from feedline.source import ObjectCache

BUCKET = "listing-startup"


def main(count: int) -> None:
    """Measure and print (see the module docstring)."""
    # The tests' server (not type-checked here: moto and boto3 have no annotations).
    s3: Any = importlib.import_module("tests.source._s3")
    credentials: dict[str, Any] = s3.CREDENTIALS
    logging.disable(logging.INFO)  # the server logs every request
    keys = [f"train/{i:07d}.jpg" for i in range(count)]
    with s3.moto_bucket(BUCKET, dict.fromkeys(keys, b"x")) as (endpoint, served):
        listing, reading, pages = [], [], 0
        for _ in range(3):
            directory = tempfile.mkdtemp()

            def store(folder: str = directory) -> RemoteStore:
                cache = ObjectCache(1 << 20, directory=folder)
                return RemoteStore(f"s3://{BUCKET}", endpoint=endpoint, cache=cache, **credentials)

            before, t0 = served["LIST"], time.perf_counter()
            first = store().keys("train")
            listing.append(time.perf_counter() - t0)
            pages = served["LIST"] - before
            t0 = time.perf_counter()
            later = store().keys("train")
            reading.append(time.perf_counter() - t0)
            assert list(first) == list(later) == keys
        listed, read = statistics.median(listing), statistics.median(reading)
        print(
            f"{count} keys: listing {listed:.2f} s ({pages} LIST requests; "
            f"{min(listing):.2f}-{max(listing):.2f}), from the manifest {1e3 * read:.0f} ms "
            f"({1e3 * min(reading):.0f}-{1e3 * max(reading):.0f}); ratio {read / listed:.3f}"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000)
