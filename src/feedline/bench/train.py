"""The ``train`` scenario: headspace analysis, the training speed each loader leaves.

A loader's own throughput says little about training: what matters is how fast the training
loop runs while the loader works beside it. SPDL's docs measure this as *headspace*: replay
batches cached in memory to find the loop's upper bound, then see what share of it each
loader keeps. The loop runs in the main thread on one core (``torch.set_num_threads(1)``),
in one of two kinds:

- ``model``: forward, backward and an optimizer step of a small convolutional network;
- ``launches``: thousands of tiny tensor operations per step, the CPU side of a GPU step
  (each kernel launch is a short call that needs the GIL): a loader thread that holds the
  GIL (``numpy.load``) delays every launch.

Each kind is calibrated, on the cached batches, to a step time the loader can feed from the
remaining cores. The data is ImageNet-like JPEG files (decoded by feedline's function, which
releases the GIL) or NPZ files (an image, a mask and a few floats per sample) read with
``numpy.load`` (holds the GIL) or ``feedline.io.load_npz``. Contenders: the cached batches
(the upper bound), PyTorch's DataLoader with 1, 2 and 4 workers (the best of them is the
baseline a user would pick), ``feedline.DataLoader`` with its defaults (threads in the
training process), with 2 worker processes and with ``num_workers="auto"`` (threads, moved
to worker processes where they pay), and a feedline pipeline (a stage as wide as
the cores, then batches). Reported per contender: steps/s over
the steady part of a run, its share of the upper bound (per round), and the training step's
own time (waiting for data left out) at p50 and p99 against the cached run: how much the
loader's threads slow the training thread down.
"""

from __future__ import annotations

import functools
import io
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ._common import Contender, Measurement, ScenarioResult, alternate, make_result, paired_ratio
from ._data import cache_dir, jpeg_files, jpeg_source
from ._registry import BenchOptions
from .formats import make_sample

__all__ = ["run"]

BATCH = 16
CACHED = "cached batches (upper bound)"
WORKERS = (1, 2, 4)
# Step times the cores left to the loader can feed: a batch of 16 ImageNet-like JPEGs takes
# about 40 ms of decoding on one core, a batch of 16 NPZ samples a few ms. At least
# AIM_MARGIN times what a batch takes on one core in this run (a host that is slower today).
TARGET_S = {"jpeg": 0.080, "npz": 0.025}
AIM_MARGIN = 2.0


class JpegDataset:
    """``dataset[i]``: JPEG file ``i % n`` read and decoded to 224x224 RGB, and a label."""

    def __init__(self, paths: list[str], length: int) -> None:
        self.paths = paths
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        from feedline.io import decode_image

        data = Path(self.paths[i % len(self.paths)]).read_bytes()
        return torch.from_numpy(decode_image(data, size=(224, 224))), i % 10


class NpzDataset:
    """``dataset[i]``: NPZ file ``i % n`` loaded with ``numpy.load`` or feedline's ``load_npz``."""

    def __init__(self, paths: list[str], length: int, loader: str) -> None:
        self.paths = paths
        self.length = length
        self.loader = loader

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Any, Any, int]:
        import torch

        path = self.paths[i % len(self.paths)]
        if self.loader == "numpy":
            with np.load(path) as z:  # holds the GIL throughout (zipfile, Python code)
                image, mask = z["image"], z["mask"]
        else:
            from feedline.io import load_npz

            arrays = load_npz(Path(path).read_bytes(), max_member_bytes=1 << 24)
            image, mask = arrays["image"].copy(), arrays["mask"].copy()  # own, writable
        return torch.from_numpy(image), torch.from_numpy(mask), i % 10


def _npz_files(count: int, directory: Path | None) -> list[str]:
    folder = cache_dir(directory) / "npz-v1"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"{i:05d}.npz"
        if not path.exists():
            buf = io.BytesIO()
            np.savez(buf, **make_sample(i))  # type: ignore[arg-type]
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(buf.getvalue())
            tmp.replace(path)
        paths.append(str(path))
    return paths


# -- the training loops ---------------------------------------------------------------------


class ModelStep:
    """Forward, backward and an SGD step of a small CNN, ``reps`` times per batch."""

    def __init__(self) -> None:
        import torch
        from torch import nn

        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=4, padding=2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.reps = 1

    def __call__(self, batch: Any) -> None:
        import torch

        images, labels = batch[0], batch[-1]
        if images.shape[-1] == 3:  # HWC pictures
            images = images.permute(0, 3, 1, 2)
        x = images.float().div_(255)
        for _ in range(self.reps):
            loss = torch.nn.functional.cross_entropy(self.model(x), labels)
            self.optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()


class LaunchStep:
    """``reps`` x 100 tiny tensor operations per batch: the CPU side of a GPU step."""

    def __init__(self) -> None:
        import torch

        self.state = torch.zeros(64)
        self.reps = 1

    def __call__(self, batch: Any) -> None:
        x = self.state
        x.add_(batch[0][0, 0, 0].float().mean())  # the batch is used
        for _ in range(self.reps * 50):
            x = x.mul(0.999).add(0.001)
        self.state = x


def _calibrate(step: ModelStep | LaunchStep, batch: Any, target: float) -> float:
    """Set ``step.reps`` so that one step takes about ``target`` seconds; returns that time."""

    def timed() -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    step.reps = 1
    step(batch)  # warm up
    took = timed()
    for _ in range(6):  # the time of a rep shifts once there are several: until within 10 %
        reps = max(1, round(step.reps * target / max(took, 1e-6)))
        if reps == step.reps:
            break  # one rep already takes longer than the aim, or it is as close as it gets
        step.reps = reps
        took = timed()
        if abs(took - target) <= 0.1 * target:
            break
    return took


def _train(
    batches: Callable[[], Iterator[Any]], step: Callable[[Any], None], steps: int, warm: int
) -> tuple[float, list[float], list[float]]:
    """Run ``steps`` training steps; returns steady steps/s, compute and wait times."""
    computes: list[float] = []
    waits: list[float] = []
    it = batches()
    start = time.perf_counter()
    try:
        for s in range(steps):
            t0 = time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            step(batch)
            t2 = time.perf_counter()
            if s == warm - 1:
                start = t2
            elif s >= warm:
                waits.append(t1 - t0)
                computes.append(t2 - t1)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
        del it
    return (steps - warm) / (time.perf_counter() - start), computes, waits


# -- the loaders ----------------------------------------------------------------------------


def _cycle(cached: list[Any]) -> Iterator[Any]:
    while True:
        yield from cached


def _torch(dataset: Any, workers: int) -> Iterator[Any]:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers)
    return iter(loader)


def _feedline(dataset: Any, workers: int = 0) -> Iterator[Any]:
    from feedline import DataLoader

    return iter(DataLoader(dataset, batch_size=BATCH, num_workers=workers))


AUTO = 'feedline DataLoader, workers="auto"'


def _feedline_auto(dataset: Any, ended: list[int]) -> Iterator[Any]:
    # num_workers="auto"; ``ended`` gets the worker processes it fetched with at the end.
    from feedline import DataLoader

    loader: DataLoader[Any] = DataLoader(dataset, batch_size=BATCH, num_workers="auto")
    try:
        yield from loader
    finally:
        ended.append(loader.num_workers)
        loader.close()


def _pipeline(dataset: Any) -> Iterator[Any]:
    import torch.utils.data

    from feedline import PipelineBuilder

    cores = os.cpu_count() or 1
    builder: PipelineBuilder[Any] = PipelineBuilder()
    pipeline = (
        builder.add_source(range(len(dataset)))
        .pipe(dataset.__getitem__, concurrency=cores, output_order="input")
        .aggregate(BATCH)
        .pipe(torch.utils.data.default_collate)
        .add_sink()
        .build(num_threads=cores + 1)
    )
    return iter(pipeline)


def _contenders(
    dataset: Any,
    cached: list[Any],
    step: Callable[[Any], None],
    steps: int,
    warm: int,
    quick: bool,
    ended: list[int],
) -> tuple[list[Contender], dict[str, tuple[list[float], list[float]]]]:
    times: dict[str, tuple[list[float], list[float]]] = {}

    def run(name: str, make: Callable[[], Iterator[Any]]) -> tuple[int, float]:
        rate, computes, waits = _train(make, step, steps, warm)
        kept = times.setdefault(name, ([], []))
        kept[0].extend(computes)
        kept[1].extend(waits)
        return 1, 1 / rate  # items_per_s = steady steps/s

    makers: list[tuple[str, Callable[[], Iterator[Any]]]] = [
        (CACHED, functools.partial(_cycle, cached))
    ]
    makers += [
        (f"PyTorch workers={w}", functools.partial(_torch, dataset, w))
        for w in ((2,) if quick else WORKERS)
    ]
    makers += [
        ("feedline DataLoader", functools.partial(_feedline, dataset)),
        # Threads of the training process share its GIL with the training loop; worker
        # processes do not: what num_workers buys a loop that launches many small ops.
        ("feedline DataLoader, workers=2", functools.partial(_feedline, dataset, 2)),
        # Threads first; fetching moves to worker processes where they pay (measured).
        (AUTO, functools.partial(_feedline_auto, dataset, ended)),
        ("feedline pipeline", functools.partial(_pipeline, dataset)),
    ]
    contenders = [Contender(name, functools.partial(run, name, make)) for name, make in makers]
    return contenders, times


def _summarise(found: list[Measurement], times: dict[str, tuple[list[float], list[float]]]) -> None:
    cached = next(m for m in found if m.contender == CACHED)
    torch_best = max(
        (m for m in found if m.contender.startswith("PyTorch")), key=lambda m: m.items_per_s
    )
    base_p50 = float(np.percentile(times[CACHED][0], 50))
    base_p99 = float(np.percentile(times[CACHED][0], 99))
    for m in found:
        computes, waits = times[m.contender]
        p50, p99 = float(np.percentile(computes, 50)), float(np.percentile(computes, 99))
        m.extra.pop("cpu_s_per_1000", None)  # per step, not per item: not comparable here
        m.extra["step_p50_ms"] = 1e3 * p50
        m.extra["step_p99_ms"] = 1e3 * p99
        m.extra["p50_vs_cached"] = p50 / base_p50
        m.extra["p99_vs_cached"] = p99 / base_p99
        m.extra["wait_p50_ms"] = 1e3 * float(np.percentile(waits, 50))
        m.extra["of_bound"] = m.ratio if m.ratio is not None else float("nan")
        if m is not cached:
            vs = paired_ratio(m.runs, torch_best.runs)
            if vs is not None:
                m.extra["vs_pytorch"] = vs
    auto = next((m for m in found if m.contender == AUTO), None)
    ours = [m for m in found if m.contender.startswith("feedline DataLoader") and m is not auto]
    if auto is not None and ours:
        better = max(ours, key=lambda m: m.items_per_s)
        vs = paired_ratio(auto.runs, better.runs)
        if vs is not None:
            auto.extra["vs_better_feedline"] = vs


def run(options: BenchOptions) -> ScenarioResult:
    """Run the train scenario; ``options.quick`` shrinks it to a smoke test."""
    import torch

    quick, progress = options.quick, options.progress
    # 5 rounds: a shared host's speed drifts by 10 % and more between runs of a few seconds.
    repeats = 1 if quick else 5
    steps, warm = options.size((100, 10), (10, 3), (6, 2))
    # A smoke test's steps aim at less time (the loaders keep up with them or not: it only
    # checks that everything runs and is reported).
    aim = options.size(1.0, 1.0, 0.25)
    length = steps * BATCH
    jpegs = [
        str(p)
        for p in jpeg_files(
            options.size(256, 64, 16),
            "imagenet",
            options.data_dir,
            progress,
            options.steps,
            options.smoke_run,
        )
    ]
    npzs = _npz_files(options.size(64, 16, 8), options.data_dir)
    datasets: list[tuple[str, str, Any]] = [
        ("JPEG files (decode releases the GIL)", "jpeg", JpegDataset(jpegs, length)),
        ("NPZ files, numpy.load (holds the GIL)", "npz", NpzDataset(npzs, length, "numpy")),
        ("NPZ files, feedline load_npz", "npz", NpzDataset(npzs, length, "feedline")),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    found: list[Measurement] = []
    notes = [jpeg_source(options.data_dir)]
    try:
        for data_label, kind, dataset in datasets:
            cached = list(_cycle_once(dataset, 4))
            t0 = time.perf_counter()
            again = len(list(_cycle_once(dataset, 2)))  # again: the files are cached now
            batch_s = (time.perf_counter() - t0) / again  # on one core
            target = aim * max(TARGET_S[kind], AIM_MARGIN * batch_s)
            for loop_label, step in (("model", ModelStep()), ("launches", LaunchStep())):
                step_s = _calibrate(step, cached[0], target)
                case = f"{data_label}, {loop_label} step"
                notes.append(
                    f"{case}: {step.reps} rep(s) per step, {1e3 * step_s:.0f} ms per step on "
                    f"cached batches (aimed at {1e3 * target:.0f} ms; a batch took "
                    f"{1e3 * batch_s:.0f} ms to fetch and collate on one thread)"
                )
                ended: list[int] = []
                contenders, times = _contenders(dataset, cached, step, steps, warm, quick, ended)
                measured = alternate(case, contenders, repeats, CACHED, progress)
                _summarise(measured, times)
                notes.append(
                    f'{case}: num_workers="auto" ended its runs in '
                    + ", ".join(f"{w} worker(s)" if w else "threads" for w in ended)
                )
                found += measured
    finally:
        torch.set_num_threads(threads)
    notes += [
        f"{repeats} alternating run(s) per contender; batches of {BATCH}; {steps} steps per run, "
        f"the first {warm} not timed (start-up); steps/s over the rest",
        "ratio (of_bound): steps/s as a share of the cached batches' in the same round; "
        "vs_pytorch: against the best PyTorch DataLoader of the case, per round; "
        'vs_better_feedline (num_workers="auto"): against the faster of feedline\'s threads '
        "and 2 workers in the case, per round",
        "step p50 / p99: the training step alone (waiting for the batch left out), and against "
        "the cached run: how much the loader's threads slow the training thread",
        "the training loop runs on the main thread with torch.set_num_threads(1): one core; "
        "the loaders have the rest. Threads of the training process (feedline's defaults) "
        "take GIL time from a loop that launches many small ops; worker processes "
        "(num_workers) do not",
    ]
    return make_result(
        "train",
        CACHED,
        found,
        notes,
        True,
        unit="steps/s",
        headline=["feedline DataLoader", AUTO, "feedline pipeline"],
    )


def _cycle_once(dataset: Any, count: int) -> Iterator[Any]:
    """The first ``count`` batches, for the cached contender and calibration."""
    import torch.utils.data

    for b in range(count):
        items = [dataset[i] for i in range(b * BATCH, (b + 1) * BATCH)]
        yield torch.utils.data.default_collate(items)
