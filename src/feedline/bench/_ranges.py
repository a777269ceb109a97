"""The ``autotune`` scenario's range-request cases: ``RemoteStore(part_size="auto")``.

Large objects from a loopback server whose every reply waits 20 ms and then moves at most a
given rate per connection (as one connection of an object store does), in two settings:

* **slow connections**: 8 MiB at 10 MB/s a connection, nothing shared: parts in parallel
  each pay the wait once, so small parts win;
* **one fast link**: 8 MiB at 100 MB/s a connection, 100 MB/s for all of them together:
  parts cannot beat one request, and should not cost much either.

Contenders read the objects in a pipeline (``RemoteStore.read``, two objects at once): one
request per object, parts of 1, 2 and 4 MiB, and ``part_size="auto"`` from a fresh store each
round (so its first read measures from nothing). The oracle is the fastest fixed choice of
the run (by median); the ratio is the tuned store's to it, per round.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._common import Contender, Measurement, alternate, drop_cpu, paired_ratio, round_ratios
from ._data import random_files
from ._server import ServerProcess

__all__ = ["range_cases"]

OBJECT_BYTES = 8 << 20
FIXED: dict[str, int | None] = {
    "one request per object": None,
    "parts of 1 MiB": 1 << 20,
    "parts of 2 MiB": 2 << 20,
    "parts of 4 MiB": 4 << 20,
}


def range_cases(
    root: Path,
    count: int,
    repeats: int,
    oracle: str,
    tuned: str,
    progress: Callable[[str], None],
    notes: list[str],
) -> list[Measurement]:
    """Both cases' oracle and tuned rows (the fixed choices' rates go in ``notes``).

    ``count``: the objects each pass reads.
    """
    files = random_files(root, 2, OBJECT_BYTES)
    found: list[Measurement] = []
    for name, per_connection, total in (
        ("8 MiB objects, 20 ms, 10 MB/s per connection", 10e6, 0.0),
        ("8 MiB objects, 20 ms, one 100 MB/s link", 100e6, 100e6),
    ):
        with ServerProcess(files, 0.02, rate=total, connection_rate=per_connection) as server:
            contenders = [
                Contender(label, functools.partial(_pass, server.url, part, count))
                for label, part in FIXED.items()
            ]
            contenders.append(Contender(tuned, functools.partial(_pass, server.url, "auto", count)))
            rows = alternate(name, contenders, repeats, None, progress)
        drop_cpu(rows)  # the server's work is not in it: not comparable
        best = max((m for m in rows if m.contender in FIXED), key=lambda m: m.items_per_s)
        auto = next(m for m in rows if m.contender == tuned)
        auto.ratio = paired_ratio(auto.runs, best.runs)
        auto.ratio_runs = round_ratios(auto.runs, best.runs)
        notes.append(
            f"{name}: objects/s, "
            + ", ".join(f"{m.contender} {m.items_per_s:.1f}" for m in rows)
            + f"; the oracle is {best.contender}"
        )
        best.contender = oracle
        best.ratio, best.ratio_runs = 1.0, [1.0] * len(best.runs)
        found += [best, auto]
    notes.append(
        "range requests: RemoteStore.read in a pipeline stage of concurrency 2, "
        f"{count} objects per pass, objects/s over the pass; part_size='auto' sizes parts "
        "from the latency and per-connection rate it measures (a fresh store each round)"
    )
    return found


def _pass(url: str, part: int | str | None, count: int) -> tuple[int, float]:
    import time

    from feedline import PipelineBuilder, RemoteStore

    store = RemoteStore(url, retries=0, part_size=part)
    keys = (str(i) for i in itertools.count())
    builder: Any = PipelineBuilder()
    pipeline = builder.add_source(keys).pipe(store.read, concurrency=2).pipe(len).build()
    t0 = time.perf_counter()
    with pipeline.auto_stop():
        for got, size in enumerate(pipeline, 1):
            assert size == OBJECT_BYTES
            if got == count:
                break
    return count, time.perf_counter() - t0
