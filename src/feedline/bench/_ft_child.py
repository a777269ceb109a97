"""One timed pass of the ``freethreaded`` scenario, run by whichever interpreter is measured.

    python -m feedline.bench._ft_child WORK RUNNER THREADS ITEMS

WORK is ``python`` (a loop of bytecode, about half a millisecond) or ``npy`` (``numpy.load``
of a 64 KiB NPY file in memory); RUNNER is ``feedline`` (a pipeline of one stage at
``THREADS`` calls at once) or ``pool`` (``ThreadPoolExecutor(THREADS).map``). It prints one
JSON object: the items done, the seconds they took, and whether the GIL was on.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["main", "work"]


def _python(i: int) -> int:
    total = 0
    for k in range(4000):
        total += (i + k) * k % 7
    return total


def _npy_loader() -> Callable[[int], Any]:
    buf = io.BytesIO()
    np.save(buf, np.arange(16384, dtype=np.float32).reshape(128, 128))
    data = buf.getvalue()

    def load(i: int) -> Any:
        return np.load(io.BytesIO(data))

    return load


def work(name: str) -> Callable[[int], Any]:
    """The op a pass runs on each item, by name (``python`` or ``npy``)."""
    if name == "python":
        return _python
    if name == "npy":
        return _npy_loader()
    raise ValueError(f"unknown work {name!r}: python or npy")


def _feedline(op: Callable[[int], Any], threads: int, items: int) -> int:
    from feedline import PipelineBuilder

    builder: PipelineBuilder[Any] = PipelineBuilder()
    pipeline = builder.add_source(range(items)).pipe(op, concurrency=threads).add_sink().build()
    return sum(1 for _ in pipeline)


def _pool(op: Callable[[int], Any], threads: int, items: int) -> int:
    with ThreadPoolExecutor(threads) as pool:
        return sum(1 for _ in pool.map(op, range(items)))


def main(argv: list[str]) -> int:
    """Run one pass as ``argv`` says and print its JSON line."""
    name, runner, threads, items = argv[0], argv[1], int(argv[2]), int(argv[3])
    op = work(name)
    run = {"feedline": _feedline, "pool": _pool}[runner]
    run(op, threads, max(1, items // 20))  # warm: imports, the first pool threads
    start = time.perf_counter()
    done = run(op, threads, items)
    seconds = time.perf_counter() - start
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    print(json.dumps({"items": done, "seconds": seconds, "gil": gil}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
