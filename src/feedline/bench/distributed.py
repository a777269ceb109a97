"""The ``distributed`` scenario: epochs on 4 and 8 ranks against a slow, shared object store.

Each rank is a process of one gloo group on loopback. The store is the benchmark's HTTP server
with 20 ms per request and a bandwidth cap for all ranks together (a token bucket: the shared
file system of a cluster, scaled down); the samples are ImageNet-like JPEGs (raw bytes, so
the figures are those of loading, not decoding). Per epoch: its time (the slowest rank's),
the store's GETs and bytes, the bytes the ranks exchanged, beta. Contenders: the regular
loader (``DistributedSampler``'s split, ``feedline.DataLoader`` reading the store, the
baseline) and ``feedline.distributed.DistributedLoader``, with one copy of each sample over
the ranks' caches and with two. The planner's time per step at the paper's largest scale is
measured without processes.

The cost model predicts every epoch. Its terms are measured by the ranks' own processes,
each right after the epoch from the caches it predicts, every rank at once (so that they
share the cores as in the epoch, and the shared machine's drift reaches both alike): ``U``
as each rank serving its share from its cache alone (a one-rank loader), ``L_plan`` as what
planning that epoch's steps adds to that loader's epoch when it runs beside it, ``L_b`` and
``R_b`` by :func:`measure_exchange`, and ``beta`` from the plans; ``R`` is the store's cap.
Each round's prediction (from the medians of its terms) is compared with that round's epochs.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import queue
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
EPOCHS = 3  # the regular loader's: each reads the whole dataset from the slow store
CACHED_EPOCHS = 10  # the locality-aware loader's after the first: cheap, many for steadier figures
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


def _join(rank: int, world: int, port: int) -> None:
    # This process joins the ranks' gloo group on loopback.
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )


def _rank(
    rank: int,
    world: int,
    port: int,
    kind: str,
    url: str,
    paths: list[str],
    count: int,
    epochs: int,
    out: Any,
) -> None:
    # One rank: `epochs` epochs of its loader; rank 0 reports each epoch's figures. After each
    # epoch from the caches, the same processes measure the cost model's terms for it (the
    # shared machine drifts: terms taken minutes apart predicted epochs 20% off).

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Before joining the group: its one-rank loader must not take the group's ranks.
    terms = None if kind == "regular" else _Terms(rank, world, paths, count, kind)
    _join(rank, world, port)
    loader: Any = None
    try:
        samples: Any = _Raw(HttpDataset(url, count, decode=False))
        sampler: Any = None
        if kind == "regular":
            from torch.utils.data import DistributedSampler

            from feedline import DataLoader

            sampler = DistributedSampler(samples, num_replicas=world, rank=rank, seed=0)
            loader = DataLoader(samples, batch_size=BATCH, sampler=sampler, collate_fn=list)
        else:
            from feedline.distributed import DistributedLoader

            copies = 2.0 if kind == "replicas" else 1.0
            loader = DistributedLoader(
                samples, batch_size=BATCH, collate_fn=list, seed=0, replicas=copies
            )
        found = []
        for epoch in range(epochs):
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
            figures = {
                "seconds": seconds,
                "gets": gets,
                "exchanged_bytes": int(total.item()),
                "beta": beta,
            }
            if terms is not None:
                figures.update(terms.measure(epoch))
            found.append(figures)
        if rank == 0:
            out.put(json.dumps(found))
    finally:
        if terms is not None:
            terms.close()
        if loader is not None and hasattr(loader, "close"):
            loader.close()
        dist.destroy_process_group()


class _Terms:
    """One rank's part in measuring the cost model's terms, epoch by epoch.

    ``U``: this rank's share served from its cache by a one-rank loader (made before the
    process joins the group, so that it stays one rank); ``L_plan``: what planning the
    epoch's steps, as the loader plans them, adds to that loader's epoch beside it;
    ``beta``: from those plans; ``L_b`` and ``R_b``: :func:`measure_exchange`. Every rank
    measures at once, between barriers, so that they share the cores as in the epoch.
    """

    def __init__(self, rank: int, world: int, paths: list[str], count: int, kind: str):
        from feedline.distributed import DistributedLoader, GlobalSequence, holders
        from feedline.distributed._placement import second_copies

        self.rank, self.world = rank, world
        blobs = [open(path, "rb").read() for path in paths]  # noqa: SIM115 - read at once
        samples = [blobs[i % len(blobs)] for i in range(count)]
        self.share = samples[rank::world]
        self.mean = round(statistics.fmean(len(s) for s in samples))
        self.local: Any = DistributedLoader(self.share, batch_size=BATCH, collate_fn=list, seed=0)
        assert self.local.world_size == 1, "the one-rank loader took a process group's ranks"
        self.sequence = GlobalSequence(count, world, BATCH, seed=0)
        self.placed = holders(count, world, seed=0, replicas=2)
        self.second = second_copies(self.placed, 0, 1.0) if kind == "replicas" else None

    def measure(self, epoch: int) -> dict[str, float]:
        """The terms for ``epoch`` (nothing for the first: its local epoch fills the cache)."""
        from feedline.distributed import measure_exchange

        alone, _ = self._local_epoch(epoch, plan=False)
        if epoch == 0:
            return {}
        # The loader plans on a thread of its own beside the rest of its work, which made
        # planning cost half as much again as alone (caches, switches): plan beside the
        # one-rank loader's epoch, and count what that adds (noise either way included).
        beside, moved = self._local_epoch(epoch, plan=True)
        cost = measure_exchange(self.mean, rounds=10)  # per epoch: the median over epochs
        return {
            "U": len(self.share) / alone,
            "L_plan": (beside - alone) / self.sequence.steps,
            "planned_beta": moved / (self.sequence.steps * self.world * BATCH),
            "L_b": cost.L_b,
            "R_b": cost.R_b,
        }

    def _local_epoch(self, epoch: int, plan: bool) -> tuple[float, int]:
        # One epoch of the one-rank loader between barriers, with the epoch's steps planned
        # on another thread meanwhile if `plan`: its seconds and the samples the plans move.
        import threading

        import torch.distributed as dist

        from feedline.distributed import plan_for

        moved = 0

        def planning() -> None:
            nonlocal moved
            grid = self.sequence.grid(epoch)
            for k in range(self.sequence.steps):
                rows = self.sequence.step(epoch, k, grid)
                moved += plan_for(rows, self.placed[0], self.rank, self.second).exchanged

        planner = threading.Thread(target=planning) if plan else None
        self.local.set_epoch(epoch)
        dist.barrier()
        start = time.perf_counter()
        if planner is not None:
            planner.start()
        try:
            for _ in self.local:
                pass
        finally:
            if planner is not None:
                planner.join()
        dist.barrier()
        return time.perf_counter() - start, moved

    def close(self) -> None:
        """End the one-rank loader."""
        self.local.close()


def _rank_context() -> Any:
    # The ranks start from the fork server, which imports torch.distributed and this module
    # once if it has not started yet (each rank importing them took 3 s of CPU; not timed
    # either way: the epochs are timed between barriers).
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", 0) is None:
        current = list(getattr(server, "_preload_modules", ["__main__"]))
        extra = [m for m in ("torch.distributed", __name__) if m not in current]
        forkserver.set_forkserver_preload(current + extra)
    return mp.get_context("forkserver")


def _spawn(world: int, target: Any, args: tuple[Any, ...]) -> Any:
    # Run target(rank, world, port, *args, out) on `world` processes; rank 0's report.
    ctx = _rank_context()
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 1800
        while True:
            try:
                return json.loads(out.get(timeout=1.0))
            except queue.Empty:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:  # the others would wait at a barrier for gloo's timeout
                    codes = ", ".join(f"rank {r}: {procs[r].exitcode}" for r in failed)
                    message = f"a rank process failed ({codes}); see its traceback"
                    raise RuntimeError(message) from None
                if time.monotonic() > deadline:
                    raise RuntimeError("the ranks did not report within 30 minutes") from None
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()


_TERMS = ("U", "L_plan", "planned_beta", "L_b", "R_b")


def _terms_of(epochs: list[dict[str, Any]]) -> dict[str, float]:
    # One run's terms: the median over its epochs from the caches.
    return {t: statistics.median(e[t] for e in epochs[1:]) for t in _TERMS}


def _predict(
    round_: dict[str, list[dict[str, Any]]], world: int, count: int, mean_size: float
) -> dict[str, float]:
    # One round's cost-model epoch time per case, "<kind> <epoch 0 | cached>", each
    # locality-aware kind from the terms measured beside its own epochs; the regular loader
    # (bound by the store) with the U of the default loader's run.
    from feedline.distributed import CostModel

    store = RATE / mean_size
    found = {}
    shared = _terms_of(round_["locality-aware"])
    first = CostModel(D=count, V=math.inf, R=store, U=shared["U"], R_c=shared["R_b"])
    reading = first.epoch_time(world, "regular")
    for kind, epochs in round_.items():
        found[f"{kind} epoch 0"] = reading
        if kind == "regular":
            found[f"{kind} cached"] = reading
            continue
        terms = _terms_of(epochs)
        model = CostModel(
            D=count,
            V=math.inf,  # no training here
            R=store,
            U=terms["U"],
            R_c=terms["R_b"],
            alpha=1.0,
            b=BATCH,
            L_b=terms["L_b"],
            L_plan=max(0.0, terms["L_plan"]),
        )
        found[f"{kind} cached"] = model.epoch_time(world, "locality-aware", terms["planned_beta"])
    return found


def _run_world(
    kind: str, world: int, server: ServerProcess, paths: list[str], count: int, epochs: int
) -> list[dict[str, Any]]:
    # Start the ranks, and read the store's counters around each epoch from here.
    before = server.served()["gets"]
    args = (kind, server.url, paths, count, epochs)
    found: list[dict[str, Any]] = _spawn(world, _rank, args)
    for epoch in found:  # the store's running count, read by rank 0 after each epoch
        epoch["gets"], before = epoch["gets"] - before, epoch["gets"]
    return found


def _measure(
    world: int,
    count: int,
    rounds: dict[str, list[list[dict[str, Any]]]],
    predictions: list[dict[str, float]],
) -> list[Measurement]:
    # Per case (the first epoch, the later ones), each contender's median over the rounds,
    # its per-round ratios to the regular loader's, and the cost model's epoch time (from
    # each round's own terms, against that round's epochs: the machine drifts).
    found = []
    for label, chosen in (("epoch 0", slice(0, 1)), ("later epochs", slice(1, None))):
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
            key = f"{kind} {'epoch 0' if label == 'epoch 0' else 'cached'}"
            models = [p[key] for p in predictions]
            extra["model_s"] = statistics.median(models)
            extra["model_off"] = statistics.median(
                m * rate / count - 1 for m, rate in zip(models, rates[kind], strict=True)
            )
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


def _describe(world: int, rounds: dict[str, list[list[dict[str, Any]]]]) -> str:
    # The cost model's measured terms for one world, the median over the rounds.
    def mid(kind: str, key: str, scale: float = 1.0) -> float:
        return float(statistics.median(_terms_of(r)[key] for r in rounds[kind])) * scale

    one, two = "locality-aware", "replicas"
    return (
        f"{world} ranks, the cost model's terms (every rank at once, after each epoch from the "
        f"caches; 1 copy, 2 copies): U {mid(one, 'U'):,.0f}, {mid(two, 'U'):,.0f} samples/s "
        f"per rank from its cache; L_b {mid(one, 'L_b', 1e3):.2f}, {mid(two, 'L_b', 1e3):.2f} "
        f"ms and R_b {mid(one, 'R_b'):,.0f}, {mid(two, 'R_b'):,.0f} samples/s "
        f"(measure_exchange); L_plan {mid(one, 'L_plan', 1e3):.2f}, "
        f"{mid(two, 'L_plan', 1e3):.2f} ms; beta from the planner "
        f"{mid(one, 'planned_beta', 100):.2f}%, {mid(two, 'planned_beta', 100):.3f}%"
    )


def _planning(steps: int, world: int = PLAN_WORLD) -> str:
    # plan_for's time per step at `world` ranks, one copy and (fewer steps) two copies.

    from feedline.distributed import GlobalSequence, holders, plan_for
    from feedline.distributed._placement import second_copies

    size = world * PLAN_BATCH * 4
    sequence = GlobalSequence(size, world, PLAN_BATCH, seed=0)
    placed = holders(size, world, seed=0, replicas=2)
    grid = sequence.grid(1)
    found = []
    for second, count in ((None, steps), (second_copies(placed, 0, 0.5), max(2, steps // 10))):
        times = []
        for k in range(count):
            rows = sequence.step(1, k % sequence.steps, grid)
            start = time.perf_counter()
            plan_for(rows, placed[0], k % world, second)
            times.append((time.perf_counter() - start) * 1e3)
        found.append(f"{statistics.median(times):.2f} ms ({min(times):.2f}-{max(times):.2f})")
    return (
        f"planning one step (plan_for, every rank computes it) at p = {world:,} and a "
        f"global batch of {world * PLAN_BATCH:,}, median of {steps} steps: {found[0]}; "
        f"with half the samples on two ranks (plus the maximum flow): {found[1]}"
    )


def run(options: BenchOptions) -> ScenarioResult:
    """Run the distributed scenario; ``options.quick`` shrinks it to a smoke test."""
    progress = options.progress
    files = jpeg_files(
        16 if options.quick else 128,
        "imagenet",
        options.data_dir,
        progress,
        options.steps,
        options.smoke_run,
    )
    count = options.size(1536, 256, 64)
    epochs = {kind: EPOCHS for kind in _NAMES}
    if not options.quick:  # the epochs from the caches take a fraction of a second
        epochs.update({kind: 1 + CACHED_EPOCHS for kind in _NAMES if kind != "regular"})
    repeats = 1 if options.quick else 3
    worlds = [2] if options.quick else [4, 8]
    sizes = [f.stat().st_size for f in files]
    mean_size = statistics.fmean(sizes[i % len(sizes)] for i in range(count))
    measurements: list[Measurement] = []
    notes = [
        jpeg_source(options.data_dir),
        f"{count:,} samples (mean {mean_size / 1e3:,.0f} kB), batches of {BATCH} per rank, "
        f"{epochs['regular']} epochs of the regular loader, {epochs['locality-aware']} of "
        f"feedline.distributed; the store adds {DELAY * 1e3:.0f} ms per GET and serves "
        f"{RATE / 1e6:g} MB/s to all ranks together",
        f"{repeats} alternating round(s) per contender, medians; samples/s "
        "is the dataset over the epoch's time (the slowest rank's, between two barriers)",
        _planning(options.size(50, 5, 3), options.size(PLAN_WORLD, PLAN_WORLD, 64)),
    ]
    with ServerProcess(files, DELAY, RATE) as server:
        for world in worlds:
            rounds: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in _NAMES}
            paths = [str(f) for f in files]
            for round_ in range(repeats):
                for kind in _NAMES:  # alternating, round by round
                    if progress:
                        progress(f"{world} ranks: {kind} (run {round_ + 1}/{repeats})")
                    found = _run_world(kind, world, server, paths, count, epochs[kind])
                    rounds[kind].append(found)
            predictions = [
                _predict({k: runs[i] for k, runs in rounds.items()}, world, count, mean_size)
                for i in range(repeats)
            ]
            measurements += _measure(world, count, rounds, predictions)
            notes.append(_describe(world, rounds))
            for kind, runs in rounds.items():
                gets = statistics.median(sum(e["gets"] for e in epochs) for epochs in runs)
                notes.append(
                    f"{world} ranks, {kind}: {gets:,.0f} GETs from the store over {epochs[kind]} "
                    f"epochs ({gets / count:.2f} per sample)"
                )
    notes += [
        "cost model (s): CostModel.epoch_time with no training (V infinite); epochs that read "
        f"the store: D / R + D / (p U), R the store's cap over the mean sample "
        f"({RATE / mean_size:,.0f} samples/s); epochs from the caches (alpha = 1): "
        "beta D / R_b + D / (p U) + steps (L_plan + rounds L_b), with the terms measured "
        "by the same processes after each of its epochs (their medians; the median of the "
        "rounds' predictions); model off by: each "
        "round's prediction over that round's mean epoch time, minus 1 (the median of the "
        "rounds)",
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
