"""The ``startup`` scenario: time from creating a loader to holding its first batch.

A training job waits this long at every start (and, without persistent workers, every
epoch). The dataset decodes in-memory JPEGs to 224x224 with feedline's decoder; batches of 32.
Two cases: a dataset of two batches in order, where the first batch is all that counts, and an
ImageNet-sized one (1,281,167 items) shuffled, where drawing the epoch's order counts too.
PyTorch's DataLoader starts its worker processes (with its default start method) before the
first batch; feedline's starts threads. The baseline is PyTorch with 2 workers.
"""

from __future__ import annotations

import functools
from typing import Any

from ._common import Contender, ScenarioResult, alternate, make_result
from ._data import jpeg_files, jpeg_source, read_all
from ._loaders import DecodeDataset, LoaderCosts
from ._registry import BenchOptions

__all__ = ["run"]

BATCH = 32
IMAGENET_ITEMS = 1_281_167


def _make(kind: str, workers: int, dataset: Any, shuffle: bool) -> Any:
    if kind == "torch":
        import torch.utils.data

        return torch.utils.data.DataLoader(
            dataset, batch_size=BATCH, num_workers=workers, shuffle=shuffle
        )
    from feedline import DataLoader

    return DataLoader(dataset, batch_size=BATCH, num_workers=workers, shuffle=shuffle)


def run(options: BenchOptions) -> ScenarioResult:
    """Run the startup scenario; ``options.quick`` shrinks it to a smoke test."""
    repeats = 1 if options.quick else 5
    pictures = read_all(
        jpeg_files(
            32, "imagenet", options.data_dir, options.progress, options.steps, options.smoke_run
        )
    )
    DecodeDataset(pictures, "feedline")[0]  # import the decoder's libraries now, not in
    # whichever contender runs first
    costs = LoaderCosts(periodic=False)  # one sample, once the batch is there: none timed
    workers = options.size((0, 2, 4), (0, 2, 4), (0, 2))  # a smoke test starts fewer processes
    setups = [(f"PyTorch workers={w}", "torch", w) for w in workers]
    setups += [(f"feedline workers={w}" if w else "feedline", "feedline", w) for w in workers]
    shuffled = options.size(IMAGENET_ITEMS, IMAGENET_ITEMS, 10_000)
    cases = [
        (f"first batch of {BATCH}", BATCH * 2, False),
        (f"first batch of {BATCH}, {shuffled:,} items shuffled", shuffled, True),
    ]

    def first_batch(case: str, name: str, make: Any) -> tuple[int, float]:
        result = costs.time(case, name, make, max_batches=1)
        return 1, result.first_batch_s

    found = []
    for case, length, shuffle in cases:
        dataset = DecodeDataset(pictures, "feedline", length=length)
        contenders = [
            Contender(
                name,
                functools.partial(
                    first_batch,
                    case,
                    name,
                    functools.partial(_make, kind, n, dataset, shuffle),
                ),
            )
            for name, kind, n in setups
        ]
        found += alternate(case, contenders, repeats, "PyTorch workers=2", options.progress)
    costs.attach(found)
    found += _cold_decoder(options, repeats)
    found += _after_a_store(options, repeats, [w for w in workers if w])
    notes = [
        jpeg_source(options.data_dir),
        f"{repeats} alternating run(s) per contender, medians. items/s here is first batches "
        "per second (1 / time to the first batch): a ratio of 2 is half PyTorch's wait",
        "feedline workers=N fork their worker processes as PyTorch does (the fork server when "
        "other threads run); they start slower than its threads: use them for GIL-bound "
        "datasets",
        "CPU s per 1000 items: creating the loader, its first batch and shutting it down "
        "(worker processes included), over the 32 items of that batch; peak PSS / RSS: this "
        "process and its children when the first batch has arrived",
        f"{COLD}: each run a fresh process that has run a loader over other items (the "
        "loaders' own imports done), then times a loader whose first dataset[i] imports the "
        "decoder (OpenCV), as most datasets' first call imports theirs; baseline PyTorch "
        "workers=2 of the same case",
        f"{AFTER_STORE}: each run a fresh process that lists and reads the pictures through a "
        "RemoteStore (file://; obstore's runtime threads then run), then times a loader whose "
        "dataset reads them through that store; PyTorch forkserver: "
        "multiprocessing_context='forkserver' (with its default fork, its workers wait for "
        "ever at their first read: not run); feedline workers=N: the default, which sees the "
        "runtime's threads and starts its workers from the fork server. Baseline: PyTorch "
        "forkserver workers=2",
    ]
    return make_result(
        "startup",
        "PyTorch workers=2",
        found,
        notes,
        True,
        unit="first batches/s",
        headline=["feedline", "feedline workers=2", "feedline workers=4"],
    )


AFTER_STORE = f"first batch of {BATCH} after a RemoteStore read"

COLD = f"first batch of {BATCH}, the decoder imported by the first item"

_COLD_SCRIPT = """
import json, sys
import numpy as np
import torch.utils.data
import feedline
from feedline.bench._data import jpeg_files, read_all
from feedline.bench._loaders import DecodeDataset, LoaderCosts


class Blank:
    def __len__(self):
        return 2 * int(sys.argv[3])

    def __getitem__(self, i):
        return np.zeros((224, 224, 3), np.uint8)


if __name__ == "__main__":
    kind, workers, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    options = json.loads(sys.argv[4])

    def make(dataset):
        if kind == "torch":
            return torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=workers)
        return feedline.DataLoader(dataset, batch_size=batch, num_workers=workers, **options)

    for _ in make(Blank()):  # the loaders' own imports and first-use costs, not timed
        pass
    pictures = read_all(jpeg_files(batch, "imagenet", sys.argv[5] or None))
    costs = LoaderCosts(periodic=False)
    costs.time("case", "contender", lambda: make(DecodeDataset(pictures, "feedline", 2 * batch)), 1)
    print(json.dumps({k: v[0] for k, v in costs._runs["case", "contender"].items()}), flush=True)
"""


def _cold_decoder(options: BenchOptions, repeats: int) -> list[Any]:
    # The first batch where the dataset's first call imports its decoder, each run in a
    # process of its own (the decoder not imported yet, as in a new training job).
    jpeg_files(BATCH, "imagenet", options.data_dir, options.progress, options.steps)
    setups: tuple[tuple[str, str, int, dict[str, Any]], ...] = (
        ("PyTorch workers=2", "torch", 2, {}),
        ("feedline", "feedline", 0, {}),
        ("feedline, fetch_concurrency=64", "feedline", 0, {"fetch_concurrency": 64}),
    )
    return _fresh_runs(COLD, _COLD_SCRIPT, setups, options, repeats, "PyTorch workers=2")


def _fresh_runs(
    case: str,
    script: str,
    setups: tuple[tuple[str, str, int, dict[str, Any]], ...],
    options: BenchOptions,
    repeats: int,
    baseline: str,
) -> list[Any]:
    # Each run of each setup ``(name, kind, workers, DataLoader options)``: ``script`` in a
    # fresh process, printing its LoaderCosts as JSON on its last line.
    import json
    import statistics
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    data = str(options.data_dir or "")
    costs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="feedline-startup-") as tmp:
        path = Path(tmp) / "first_batch.py"
        path.write_text(script)

        def fresh(name: str, kind: str, workers: int, kwargs: dict[str, Any]) -> tuple[int, float]:
            args = [kind, str(workers), str(BATCH), json.dumps(kwargs), data]
            out = subprocess.run(
                [sys.executable, str(path), *args],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
                cwd=tmp,
            )
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            costs.setdefault(name, []).append(measured)
            return 1, measured["first_batch_ms"] / 1000

        contenders = [
            Contender(name, functools.partial(fresh, name, kind, workers, kwargs))
            for name, kind, workers, kwargs in setups
        ]
        found = alternate(case, contenders, repeats, baseline, options.progress)
    for m in found:  # each run's costs, measured in its process as the other cases' are
        runs = costs.get(m.contender, [])
        for key in runs[0] if runs else ():
            m.extra[key] = statistics.median(run[key] for run in runs)
    return found


_AFTER_STORE_SCRIPT = """
import json, sys
import torch
import feedline
from feedline import RemoteStore
from feedline.bench._loaders import DECODERS, LoaderCosts


class Reads(torch.utils.data.Dataset):
    def __init__(self, store, keys):
        self.store, self.keys = store, keys

    def __len__(self):
        return len(self.keys)

    def __getitem__(self, i):
        return DECODERS["feedline"](bytes(self.store.read_sync(self.keys[i])))


if __name__ == "__main__":
    kind, workers, url = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    store = RemoteStore(url)
    keys = sorted(str(k) for k in store.keys(suffix=".jpg"))
    store.read_sync(keys[0])  # the training process used the store: its threads run
    if kind == "torch":
        make = lambda: torch.utils.data.DataLoader(
            Reads(store, keys), batch_size=int(sys.argv[4]), num_workers=workers,
            multiprocessing_context="forkserver", timeout=600,
        )
    else:
        make = lambda: feedline.DataLoader(Reads(store, keys), batch_size=int(sys.argv[4]),
                                           num_workers=workers)
    costs = LoaderCosts(periodic=False)
    costs.time("case", "contender", make, max_batches=1)
    print(json.dumps({k: v[0] for k, v in costs._runs["case", "contender"].items()}), flush=True)
"""


def _after_a_store(options: BenchOptions, repeats: int, workers: list[int]) -> list[Any]:
    # The first batch with workers in a process that used a RemoteStore, each run a process
    # of its own (the fork server starts cold in each, as in a new training job).
    import json
    import statistics
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    try:
        import obstore  # noqa: F401
    except ImportError:
        return []
    files = jpeg_files(
        BATCH, "imagenet", options.data_dir, options.progress, options.steps, options.smoke_run
    )
    folder = files[0].parent
    with tempfile.TemporaryDirectory(prefix="feedline-startup-") as tmp:
        script = Path(tmp) / "first_batch.py"
        script.write_text(_AFTER_STORE_SCRIPT)

        costs: dict[str, list[dict[str, float]]] = {}

        def fresh(name: str, kind: str, workers: int) -> tuple[int, float]:
            out = subprocess.run(
                [sys.executable, str(script), kind, str(workers), f"file://{folder}", str(BATCH)],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
                cwd=tmp,
            )
            measured = json.loads(out.stdout.strip().splitlines()[-1])
            costs.setdefault(name, []).append(measured)
            return 1, measured["first_batch_ms"] / 1000

        setups = [(f"PyTorch forkserver workers={w}", "torch", w) for w in workers]
        setups += [(f"feedline workers={w}", "feedline", w) for w in workers]
        contenders = [
            Contender(name, functools.partial(fresh, name, kind, count))
            for name, kind, count in setups
        ]
        found = alternate(
            AFTER_STORE, contenders, repeats, "PyTorch forkserver workers=2", options.progress
        )
    for m in found:  # each run's costs, measured in its process as the other cases' are
        runs = costs.get(m.contender, [])
        for key in runs[0] if runs else ():
            m.extra[key] = statistics.median(run[key] for run in runs)
    return found
