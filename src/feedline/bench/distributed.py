"""The ``distributed`` scenario: epochs on 4 and 8 ranks against a slow, shared object store.

Each rank is a process of one gloo group on loopback. The store is the benchmark's HTTP server
with 20 ms per request and a bandwidth cap for all ranks together (a token bucket: the shared
file system of a cluster, scaled down); the samples are ImageNet-like JPEGs (raw bytes, so
the figures are those of loading, not decoding). Per epoch: its time (the slowest rank's),
the store's GETs and bytes, the bytes the ranks exchanged, beta. Contenders: the regular
loader (``DistributedSampler``'s split, ``feedline.DataLoader`` reading the store, the
baseline) and ``feedline.distributed.DistributedLoader``, with one copy of each sample over
the ranks' caches and with two. The cost model predicts the epochs that read the store. The
planner's time per step at the paper's largest scale is measured without processes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import statistics
import time
from typing import Any

from ._common import Measurement, ScenarioResult, make_result
from ._data import jpeg_files, jpeg_source
from ._loaders import HttpDataset
from ._registry import BenchOptions
from ._server import ServerProcess, served

__all__ = ["run"]

BATCH = 16
EPOCHS = 3
DELAY = 0.020
RATE = 20e6  # bytes per second, all ranks together
_NAMES = {
    "regular": "regular (DistributedSampler + feedline.DataLoader)",
    "locality-aware": "feedline.distributed",
    "replicas": "feedline.distributed, 2 copies",
}
PLAN_WORLD, PLAN_BATCH = 1024, 128  # the paper's largest world; a global batch of 131,072


class _Raw:
    """The store's objects as raw samples: ``samples[i]`` is object ``i``'s bytes."""

    def __init__(self, store: HttpDataset) -> None:
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, i: int) -> bytes:
        return self.store.get(i)


def _rank(rank: int, world: int, port: int, kind: str, url: str, count: int, out: Any) -> None:
    # One rank: EPOCHS epochs of its loader; rank 0 reports each epoch's figures.
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        samples: Any = _Raw(HttpDataset(url, count, decode=False))
        loader: Any
        sampler: Any
        if kind == "regular":
            from torch.utils.data import DistributedSampler

            from feedline import DataLoader

            sampler = DistributedSampler(samples, num_replicas=world, rank=rank, seed=0)
            loader = DataLoader(samples, batch_size=BATCH, sampler=sampler, collate_fn=list)
        else:
            from feedline.distributed import DistributedLoader

            sampler = None
            copies = 2.0 if kind == "replicas" else 1.0
            loader = DistributedLoader(
                samples, batch_size=BATCH, collate_fn=list, seed=0, replicas=copies
            )
        epochs = []
        for epoch in range(EPOCHS):
            (sampler or loader).set_epoch(epoch)
            before = None if sampler else loader.stats()
            dist.barrier()
            start = time.perf_counter()
            for _ in loader:
                pass
            dist.barrier()
            seconds = time.perf_counter() - start
            gets = served(url)["gets"] if rank == 0 else 0
            after = None if sampler else loader.stats()
            sent, beta = 0, 0.0
            if before is not None and after is not None:
                sent = after.sent_bytes - before.sent_bytes
                steps = after.steps - before.steps
                beta = (after.beta_sum - before.beta_sum) / steps if steps else 0.0
            total = torch.tensor([sent])
            dist.all_reduce(total)
            epochs.append(
                {
                    "seconds": seconds,
                    "gets": gets,
                    "exchanged_bytes": int(total.item()),
                    "beta": beta,
                }
            )
        if sampler is None:
            loader.close()
        if rank == 0:
            out.put(json.dumps(epochs))
    finally:
        dist.destroy_process_group()


def _run_world(kind: str, world: int, server: ServerProcess, count: int) -> list[dict[str, Any]]:
    # Start the ranks, and read the store's counters around each epoch from here.
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = server.served()["gets"]
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, kind, server.url, count, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        epochs: list[dict[str, Any]] = json.loads(out.get(timeout=1800))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
    for epoch in epochs:  # the store's running count, read by rank 0 after each epoch
        epoch["gets"], before = epoch["gets"] - before, epoch["gets"]
    return epochs


def _measure(
    world: int, count: int, rounds: dict[str, list[list[dict[str, Any]]]], model_s: float
) -> list[Measurement]:
    # Per case (the first epoch, the later ones), each contender's median over the rounds,
    # and its per-round ratios to the regular loader's.
    found = []
    for label, chosen in (("epoch 0", slice(0, 1)), ("epochs 1-2", slice(1, None))):
        case = f"{world} ranks, {label}"
        rates: dict[str, list[float]] = {}
        for kind, runs in rounds.items():
            picked = [e for epochs in runs for e in epochs[chosen]]
            rates[kind] = [
                count / statistics.fmean(e["seconds"] for e in epochs[chosen]) for epochs in runs
            ]
            extra = {
                "epoch_s": statistics.median(e["seconds"] for e in picked),
                "store_gets": statistics.median(e["gets"] for e in picked),
                "exchanged_mb": statistics.median(e["exchanged_bytes"] for e in picked) / 1e6,
                "beta_percent": 100 * statistics.median(e["beta"] for e in picked),
            }
            if kind == "regular" or label == "epoch 0":  # epochs that read the store
                extra["model_s"] = model_s
            ratios = [a / b for a, b in zip(rates[kind], rates["regular"], strict=True)]
            found.append(
                Measurement(
                    case=case,
                    contender=_NAMES[kind],
                    items_per_s=statistics.median(rates[kind]),
                    runs=rates[kind],
                    ratio=statistics.median(ratios),
                    ratio_runs=ratios,
                    extra=extra,
                )
            )
    return found


def _planning(steps: int) -> str:
    # plan_for's time per step at PLAN_WORLD ranks, one copy and (fewer steps) two copies.

    from feedline.distributed import GlobalSequence, holders, plan_for
    from feedline.distributed._placement import second_copies

    size = PLAN_WORLD * PLAN_BATCH * 4
    sequence = GlobalSequence(size, PLAN_WORLD, PLAN_BATCH, seed=0)
    placed = holders(size, PLAN_WORLD, seed=0, replicas=2)
    grid = sequence.grid(1)
    found = []
    for second, count in ((None, steps), (second_copies(placed, 0, 0.5), max(2, steps // 10))):
        times = []
        for k in range(count):
            rows = sequence.step(1, k % sequence.steps, grid)
            start = time.perf_counter()
            plan_for(rows, placed[0], k % PLAN_WORLD, second)
            times.append((time.perf_counter() - start) * 1e3)
        found.append(f"{statistics.median(times):.2f} ms ({min(times):.2f}-{max(times):.2f})")
    return (
        f"planning one step (plan_for, every rank computes it) at p = {PLAN_WORLD:,} and a "
        f"global batch of {PLAN_WORLD * PLAN_BATCH:,}, median of {steps} steps: {found[0]}; "
        f"with half the samples on two ranks (plus the maximum flow): {found[1]}"
    )


def run(options: BenchOptions) -> ScenarioResult:
    """Run the distributed scenario; ``options.quick`` shrinks it to a smoke test."""
    progress = options.progress
    files = jpeg_files(
        16 if options.quick else 128, "imagenet", options.data_dir, progress, options.steps
    )
    count = 256 if options.quick else 1536
    worlds = [2] if options.quick else [4, 8]
    sizes = [f.stat().st_size for f in files]
    mean_size = statistics.fmean(sizes[i % len(sizes)] for i in range(count))
    measurements: list[Measurement] = []
    notes = [
        jpeg_source(options.data_dir),
        f"{count:,} samples (mean {mean_size / 1e3:,.0f} kB), batches of {BATCH} per rank, "
        f"{EPOCHS} epochs; the store adds {DELAY * 1e3:.0f} ms per GET and serves "
        f"{RATE / 1e6:g} MB/s to all ranks together",
        f"{1 if options.quick else 2} alternating round(s) per contender, medians; samples/s "
        "is the dataset over the epoch's time (the slowest rank's, between two barriers)",
        _planning(5 if options.quick else 50),
    ]
    repeats = 1 if options.quick else 2
    with ServerProcess(files, DELAY, RATE) as server:
        for world in worlds:
            rounds: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in _NAMES}
            for round_ in range(repeats):
                for kind in _NAMES:  # alternating, round by round
                    if progress:
                        progress(f"{world} ranks: {kind} (run {round_ + 1}/{repeats})")
                    rounds[kind].append(_run_world(kind, world, server, count))
            measurements += _measure(world, count, rounds, count / (RATE / mean_size))
            for kind, runs in rounds.items():
                gets = statistics.median(sum(e["gets"] for e in epochs) for epochs in runs)
                notes.append(
                    f"{world} ranks, {kind}: {gets:,.0f} GETs from the store over {EPOCHS} "
                    f"epochs ({gets / count:.2f} per sample)"
                )
    notes += [
        "cost model (s): the epoch time equations (2) and (4) give for the epochs that read "
        f"the store: D / R, with R its cap over the mean sample ({RATE / mean_size:,.0f} "
        "samples/s); no training and no decoding here. For the epochs from the caches, "
        "beta D / R_b (the exchange) is a fraction of a second on loopback, where the "
        "loaders' per-step costs on the shared cores dominate: no prediction is given",
        "beta: the exchanged share of each global batch (the paper's medians at batch 32: 6.9%;"
        " it grows as the batch shrinks); exchanged: bytes sent between ranks per epoch",
    ]
    return make_result(
        "distributed",
        _NAMES["regular"],
        measurements,
        notes,
        True,
        unit="samples/s",
        headline=[_NAMES["locality-aware"]],  # replicas=2 is not the default
    )
