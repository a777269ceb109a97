"""The ``memory`` scenario: peak memory of a loader over a dataset of millions of file paths.

Each contender runs in a fresh interpreter (``python -m feedline.bench.memory``) so that it
starts from nothing; this process samples the proportional set size (PSS: shared pages
divided among the processes sharing them) and RSS of that interpreter and its children every
20 ms. PyTorch's DataLoader with 4 workers holds the paths as a list of Python strings: each
worker that reads a string writes its reference count, so the pages ``fork`` shared get copied
into every worker. feedline's holds them in a :class:`~feedline.PathList` (two NumPy buffers)
and fetches on threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from ._common import Measurement, ScenarioResult, make_result
from ._loaders import process_tree_memory
from ._registry import BenchOptions

__all__ = ["run"]

BATCH = 256


def _paths(count: int) -> Any:
    for i in range(count):
        folder = f"n{(i * 7919) % 1000:08d}"
        yield f"/datasets/imagenet/train/{folder}/{folder}_{i:07d}.JPEG"


def _child(contender: str, count: int, batches: int) -> None:
    import torch.utils.data

    from ._loaders import PathsDataset

    if contender == "feedline":
        from feedline import DataLoader, PathList

        paths = PathList(_paths(count))
        loader: Any = DataLoader(PathsDataset(paths), batch_size=BATCH, shuffle=True)
    else:
        dataset: Any = PathsDataset(list(_paths(count)))  # a list of str, as users write it
        loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=4)
    start = time.perf_counter()
    seen = 0
    for i, batch in enumerate(loader):
        seen += len(batch)
        if i + 1 >= batches:
            break
    print(f"{seen} {time.perf_counter() - start}", flush=True)


def _measure(contender: str, count: int, batches: int) -> tuple[float, int, int]:
    child = subprocess.Popen(
        [sys.executable, "-m", "feedline.bench.memory", contender, str(count), str(batches)],
        stdout=subprocess.PIPE,
        text=True,
    )
    peak_pss = peak_rss = 0
    while child.poll() is None:
        pss, rss = process_tree_memory(child.pid)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(0.02)
    out = child.stdout.read() if child.stdout is not None else ""
    if child.returncode != 0:
        raise RuntimeError(f"the {contender} memory run failed (exit {child.returncode})")
    seen, seconds = out.split()
    return int(seen) / float(seconds), peak_pss, peak_rss


def run(options: BenchOptions) -> ScenarioResult:
    """Run the memory scenario; ``options.quick`` shrinks it to a smoke test."""
    count = options.size(2_000_000, 50_000, 10_000)
    batches = options.size(400, 20, 5)
    repeats = 1 if options.quick else 3
    results: dict[str, list[tuple[float, int, int]]] = {}
    for r in range(repeats):
        for contender in ("PyTorch workers=4", "feedline"):
            if options.progress is not None:
                options.progress(f"memory: {contender} (run {r + 1}/{repeats})")
            kind = "feedline" if contender == "feedline" else "torch"
            results.setdefault(contender, []).append(_measure(kind, count, batches))
    measurements = []
    for name, runs in results.items():
        runs.sort(key=lambda x: x[1])
        rate, pss, rss = runs[len(runs) // 2]
        measurements.append(
            Measurement(
                case=f"{count:,} paths, {batches} batches of {BATCH}",
                contender=name,
                items_per_s=rate,
                runs=[x[0] for x in runs],
                extra={"peak_pss_mib": pss / 2**20, "peak_rss_mib": rss / 2**20},
            )
        )
    base = measurements[0].extra["peak_pss_mib"]
    for m in measurements:
        m.ratio = m.extra["peak_pss_mib"] / base
    notes = [
        f"{repeats} alternating run(s) per contender, each in a fresh interpreter; the run with "
        "the median peak PSS is shown. ratio = peak PSS / PyTorch's (lower is better); "
        "children included",
        "both interpreters import torch (the DataLoader is PyTorch's or built on its samplers)",
    ]
    return make_result(
        "memory",
        "PyTorch workers=4",
        measurements,
        notes,
        True,
        unit="paths/s",
        headline=["feedline"],
    )


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    os._exit(0)
