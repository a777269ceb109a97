"""Real torch.distributed gloo groups on loopback, and an S3 server that counts its GETs.

``run_ranks(world, scenario, **args)`` starts ``world`` processes, each joining one gloo group
over TCP on 127.0.0.1 and calling ``scenario(rank, world, **args)``; it returns each rank's
result, or raises what a rank raised. The ranks start from the fork server, which has imported
torch (tests/conftest.py): like torchrun's, they share no state with this process or with each
other, without each importing torch. Scenarios are module-level functions of this module, so
the children can import them.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

BUCKET = "feedline-ranks"
CREDENTIALS = {"access_key_id": "test", "secret_access_key": "test", "region": "us-east-1"}


def body(i: int) -> bytes:
    """Object ``i``: its index in 8 bytes, then 200 to 2,000 bytes that depend on it."""
    import numpy as np

    size = 200 + (i * 7919) % 1800
    tail = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
    return i.to_bytes(8, "little") + tail


def index_of(data: bytes) -> int:
    """The sample's index (the transform of these tests), after checking its bytes."""
    i = int.from_bytes(data[:8], "little")
    if data != body(i):
        raise ValueError(f"sample {i} arrived damaged")
    return i


class Samples:
    """``count`` samples in memory (``body(i)``); sample ``broken`` raises ``KeyError``."""

    def __init__(self, count: int, broken: int | None = None) -> None:
        self.count = count
        self.broken = broken

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> bytes:
        if not 0 <= i < self.count:
            raise IndexError(i)
        if i == self.broken:
            raise KeyError(f"no sample {i}")
        return body(i)


@contextmanager
def counting_s3(count: int) -> Iterator[tuple[str, dict[str, int]]]:
    """A moto S3 server on loopback with objects ``data/0`` .. ``data/<count-1>``.

    Yields its endpoint and a dict whose ``"GET"`` counts the object GETs it has served.
    """
    from tests.source._s3 import moto_bucket

    with moto_bucket(BUCKET, {f"data/{i}": body(i) for i in range(count)}) as served:
        yield served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(
    rank: int,
    world: int,
    port: int,
    scenario: str,
    args: dict[str, Any],
    out: Any,
    hang: float,
    parent_store: bool,
) -> None:
    import datetime
    import faulthandler

    faulthandler.dump_traceback_later(hang, exit=False)  # where a hung rank is, in the log

    import torch.distributed as dist

    try:
        timeout = datetime.timedelta(seconds=60)
        if parent_store:  # the parent's store, as torchrun's agent hosts it
            store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world, timeout=timeout
            )
        else:  # rank 0 hosts the store
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
        result = globals()[scenario](rank, world, **args)
        out.put((rank, "ok", json.dumps(result)))
    except BaseException as error:  # reported to the test, which raises it
        out.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            with suppress(Exception):
                dist.destroy_process_group()


def run_ranks(
    world: int,
    scenario: Callable[..., Any],
    timeout: float = 120.0,
    may_die: bool = False,
    parent_store: bool = False,
    **args: Any,
) -> list[Any]:
    """Run ``scenario`` on ``world`` ranks; returns the results (rank order) or raises.

    A rank that exits without a result raises, unless ``may_die``: its result is then None.
    The group's store is rank 0's (``init_method="tcp://..."``), or with ``parent_store``
    this process's, as torchrun's agent hosts it: it outlives every rank.
    """
    import datetime
    import time

    import torch.distributed as dist

    store = None
    if parent_store:
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )
        port = store.port
    else:
        port = _free_port()
    ctx = mp.get_context("forkserver")
    out = ctx.Queue()
    hang = max(1.0, timeout - 3)
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world, port, scenario.__name__, args, out, hang, parent_store),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = out.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
                continue
            results[rank] = (status, payload)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
        out.join_thread()
        del store  # its server stops once the ranks are gone
    problems = [f"rank {r}: {text}" for r, (status, text) in results.items() if status != "ok"]
    missing = [r for r in range(world) if r not in results]
    if missing and not may_die:
        codes = {r: procs[r].exitcode for r in missing}
        problems.append(f"ranks without a result (exit codes {codes}; timeout {timeout} s)")
    if problems:
        raise AssertionError("\n".join(problems))
    return [json.loads(results[r][1]) if r in results else None for r in range(world)]


# -- scenarios (run in each rank) ------------------------------------------------------------


def _loader(samples: Any, **options: Any) -> Any:
    from feedline.distributed import DistributedLoader

    return DistributedLoader(samples, transform=index_of, collate_fn=list, **options)


def epochs_from_s3(
    rank: int, world: int, endpoint: str, count: int, epochs: int, **options: Any
) -> dict[str, Any]:
    """Every epoch's batches of this rank, and its reads and exchanges per epoch."""
    from feedline import RemoteStore
    from feedline.distributed import StoredSamples

    store = RemoteStore(f"s3://{BUCKET}", endpoint=endpoint, **CREDENTIALS)
    loader = _loader(StoredSamples(store, [f"data/{i}" for i in range(count)]), **options)
    found: dict[str, Any] = {"batches": [], "reads": [], "sent": [], "betas": []}
    with loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            before = loader.stats()
            found["batches"].append([batch for batch in loader])
            after = loader.stats()
            found["reads"].append(after.storage_reads - before.storage_reads)
            found["sent"].append(after.sent_samples - before.sent_samples)
            steps = after.steps - before.steps
            found["betas"].append((after.beta_sum - before.beta_sum) / max(1, steps))
        found["steps"] = len(loader)
        found["copies"] = loader.stats().copies_kept
    return found


def epochs_in_memory(
    rank: int, world: int, count: int, epochs: int, **options: Any
) -> dict[str, Any]:
    """Every epoch's batches of this rank, for samples in memory, and its storage reads (in
    all, and per epoch) and second copies kept."""
    loader = _loader(Samples(count), **options)
    with loader:
        batches, reads = [], []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            before = loader.stats().storage_reads
            batches.append([batch for batch in loader])
            reads.append(loader.stats().storage_reads - before)
        stats = loader.stats()
        return {
            "batches": batches,
            "steps": len(loader),
            "reads": stats.storage_reads,
            "epoch_reads": reads,
            "copies": stats.copies_kept,
        }


def break_and_save(
    rank: int, world: int, count: int, epoch: int, stop_after: int, state_dir: str, **options: Any
) -> dict[str, Any]:
    """Train ``stop_after`` steps of ``epoch``, break, and save this rank's state."""
    loader = _loader(Samples(count), **options)
    with loader:
        seen = _break_after(loader, epoch, stop_after)
        Path(state_dir, f"rank{rank}.json").write_text(json.dumps(loader.state_dict()))
    return {"batches": seen}


def _break_after(loader: Any, epoch: int, steps: int) -> list[Any]:
    # The first ``steps`` batches of ``epoch``, then a break.
    loader.set_epoch(epoch)
    seen = []
    for step, batch in enumerate(loader):
        seen.append(batch)
        if step + 1 == steps:
            break
    return seen


def resume_and_finish(
    rank: int, world: int, count: int, state_file: str, **options: Any
) -> dict[str, Any]:
    """Load a saved state (of any world size) and train the rest of its epoch."""
    loader = _loader(Samples(count), **options)
    with loader:
        loader.load_state_dict(json.loads(Path(state_file).read_text()))
        return {"batches": [batch for batch in loader]}


def epochs_with_disk_cache(
    rank: int, world: int, count: int, epochs: int, cache_dir: str, **options: Any
) -> dict[str, Any]:
    """Epochs with a disk cache per rank; what was read, and the threads left after close."""

    from feedline.source import ObjectCache

    cache = ObjectCache(memory_bytes=0, directory=Path(cache_dir, f"rank{rank}"))
    loader = _loader(Samples(count), cache=cache, **options)
    with loader:
        batches = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            batches.append([batch for batch in loader])
        reads = loader.stats().storage_reads
    left = [t.name for t in threading.enumerate() if t.name.startswith("feedline")]
    return {"batches": batches, "reads": reads, "threads": left}


def failing_reads(rank: int, world: int, count: int, **options: Any) -> dict[str, Any]:
    """One epoch where sample 7 cannot be read."""
    loader = _loader(Samples(count, broken=7), **options)
    batches = []
    try:
        with loader:
            batches = [batch for batch in loader]
    except Exception as error:
        notes = "\n".join(getattr(error, "__notes__", []))
        found = {"error": type(error).__name__, "message": str(error), "notes": notes}
        return {**found, "batches": batches}
    return {"error": None, "batches": batches}


def break_then_next_epoch(rank: int, world: int, count: int, **options: Any) -> dict[str, Any]:
    """Break out of epoch 0 after 2 steps (every rank), then run epoch 1 whole."""
    import threading
    import time

    loader = _loader(Samples(count), **options)
    with loader:
        for step, _ in enumerate(loader):
            if step == 1:
                started = time.monotonic()
                break
        left = time.monotonic() - started
        loader.set_epoch(1)
        batches = [[], [batch for batch in loader]]
    threads = [t.name for t in threading.enumerate() if t.name.startswith("feedline")]
    return {"batches": batches, "break_seconds": left, "threads": threads}


def mismatched_settings(rank: int, world: int, count: int, **options: Any) -> dict[str, Any]:
    """Rank 1 builds its loader with another seed."""
    try:
        _loader(Samples(count), seed=rank % 2, **options)
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


def stop_mid_epoch(
    rank: int, world: int, count: int, victim: int, how: str, **options: Any
) -> dict[str, Any]:
    """Rank ``victim`` exits (``how="exit"``) or gets Ctrl-C (``"interrupt"``) at step 2 of
    epoch 1: how fast it leaves, its state and threads, and what the others raise."""
    import signal
    import time

    loader = _loader(Samples(count), **options)
    found: dict[str, Any] = {"error": None}
    with loader:
        for _ in loader:  # epoch 0 fills the caches
            pass
        loader.set_epoch(1)
        started = time.monotonic()
        try:
            for step, _ in enumerate(loader):
                if rank == victim and step == 2:
                    if how == "exit":
                        os._exit(0)
                    started = time.monotonic()
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(5)  # the KeyboardInterrupt comes first
        except KeyboardInterrupt:
            found["error"] = "KeyboardInterrupt"
        except Exception as error:
            found["error"], found["message"] = type(error).__name__, str(error)
        found["seconds"] = time.monotonic() - started
        found["state"] = loader.state_dict()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the exchange thread leaves once its step is done
        left = [t.name for t in threading.enumerate() if t.name.startswith("feedline")]
        if not left:
            break
        time.sleep(0.05)
    found["threads"] = left
    return found


def exchange_costs(
    rank: int, world: int, sizes: list[int], members: list[int] | None = None
) -> list[list[float]] | None:
    """measure_exchange() for each sample size: ``[L_b, R_b, sample_bytes, world]``.

    With ``members``, on a group of those ranks only (the others return None).
    """
    import torch.distributed as dist

    from feedline.distributed import measure_exchange

    group = None if members is None else dist.new_group(members, backend="gloo")
    found = []
    if members is None or rank in members:
        for size in sizes:
            cost = measure_exchange(size, rounds=5, group=group)
            found.append([cost.L_b, cost.R_b, cost.sample_bytes, cost.world])
    dist.barrier()  # rank 0 holds the group's store: it leaves after the others
    return found if found else None


def failure_after_a_failure(
    rank: int, world: int, count: int, marks: str, **options: Any
) -> dict[str, Any]:
    """Rank 2 dies after epoch 0; rank 0 finds it gone at the first step of epoch 1 and
    leaves; only then does rank 1 start epoch 1, whose first step is with rank 0 alone."""
    import time

    import torch.distributed as dist

    loader = _loader(Samples(count), **options)
    found: dict[str, Any] = {"error": None}
    with loader:
        for _ in loader:  # every rank's epoch 0, and its exchanges, are complete
            pass
        dist.barrier()
        if rank == 2:
            os._exit(0)
        if rank == 1:
            deadline = time.monotonic() + 60
            while not Path(marks, "rank0").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(1.0)  # the closed connections are seen
        loader.set_epoch(1)
        try:
            for _ in loader:
                pass
        except Exception as error:
            found = {"error": type(error).__name__, "message": str(error)}
    if rank == 0:
        Path(marks, "rank0").touch()  # its loader's group is gone: rank 1 may go on
    return found


def break_then_iterate_again(
    rank: int, world: int, count: int, epoch: int, stop_after: int, again: bool, **options: Any
) -> dict[str, Any]:
    """Break out of ``epoch`` after ``stop_after`` steps, then iterate again, with
    ``set_epoch(epoch)`` first if ``again``: both iterations' batches."""
    loader = _loader(Samples(count), **options)
    with loader:
        first = _break_after(loader, epoch, stop_after)
        if again:
            loader.set_epoch(epoch)
        return {"batches": [first, list(loader)]}


# -- the epoch ledger ------------------------------------------------------------------------


def ledger_epochs(
    rank: int, world: int, count: int, epochs: int, broken: int | None = None, **options: Any
) -> dict[str, Any]:
    """Whole epochs: this rank's ledger counts after each, and the epochs checked."""
    loader = _loader(Samples(count, broken=broken), **options)
    found: dict[str, Any] = {"ledger": [], "checked": [], "samples": []}
    with loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            found["samples"].append(sum(len(batch) for batch in loader))
            stats = loader.stats()
            found["ledger"].append(dataclasses.asdict(stats.ledger))
            found["checked"].append(stats.ledger_checked)
    return found


def _ledger_error(run: Callable[[], Any]) -> dict[str, Any]:
    # What ``run`` raised (a LedgerError is expected), or what it returned.
    from feedline import LedgerError

    try:
        return {"error": None, "result": run()}
    except LedgerError as error:
        return {"error": "LedgerError", "message": str(error), "repeated": error.repeated}


def break_then_iterate_with_the_old_restart(
    rank: int, world: int, count: int, **options: Any
) -> dict[str, Any]:
    """The defect put back: a new iteration after a break resumes mid-epoch (the old
    ``_iteration_start``) instead of starting the epoch over. Break after 2 steps of epoch 0,
    iterate again."""
    from feedline.distributed import _loader as module

    def resume_mid_epoch(
        epoch: int, step: int, skip: int, steps: int, resuming: bool
    ) -> tuple[int, int, int]:
        return (epoch + 1, 0, 0) if step >= steps else (epoch, step, skip)

    module._iteration_start = resume_mid_epoch  # type: ignore[assignment]
    loader = _loader(Samples(count), **options)
    with loader:
        _break_after(loader, 0, 2)
        return _ledger_error(lambda: len(list(loader)))


def tampered_positions(
    rank: int, world: int, count: int, state_dir: str, **options: Any
) -> dict[str, Any]:
    """Load this rank's saved state with its position moved (each refused), then as saved,
    and finish the epoch; then rank 0's state on every rank, and finish it again."""
    own = json.loads(Path(state_dir, f"rank{rank}.json").read_text())
    first = json.loads(Path(state_dir, "rank0.json").read_text())
    found: dict[str, Any] = {}
    loader = _loader(Samples(count), **options)
    with loader:
        for name, change in (
            ("a step ahead", {"step": own["step"] + 1}),
            ("a step back", {"step": own["step"] - 1}),
            ("consumed", {"consumed": own["consumed"] + 1}),
            ("epoch", {"epoch": own["epoch"] + 1}),
        ):
            tampered = {**own, **change}
            found[name] = _ledger_error(lambda state=tampered: loader.load_state_dict(state))
        loader.load_state_dict(own)
        found["rest"] = len(list(loader))
        found["checked"] = loader.stats().ledger_checked
        loader.load_state_dict(first)
        found["rest of rank 0's"] = len(list(loader))
        found["checked after rank 0's"] = loader.stats().ledger_checked
    return found


def two_ranks_train_on_one_sample(
    rank: int, world: int, count: int, **options: Any
) -> dict[str, Any]:
    """Rank 1's planner keeps the first sample it sends in epoch 0, and places it in its
    batch as if it were its own: each rank's batch is its plan's, so only the ranks together
    can see that the sample is trained on twice."""
    import numpy as np

    from feedline.distributed import _loader as module

    if rank == 1:
        real = module.plan_for
        done = []

        def keeps_a_sent_sample(rows: Any, *args: Any, **kwargs: Any) -> Any:
            plan = real(rows, *args, **kwargs)
            if done or not plan.sends:
                return plan
            done.append(True)
            sample = int(plan.sends[0][1][0])
            place = int(np.flatnonzero(rows.ravel() == sample)[0])
            kept = len(plan.keep)
            positions = plan.positions
            return dataclasses.replace(
                plan,
                keep=np.append(plan.keep, sample),
                positions=np.concatenate([positions[:kept], [place], positions[kept:]]),
            )

        module.plan_for = keeps_a_sent_sample  # type: ignore[assignment]
    loader = _loader(Samples(count), **options)
    with loader:
        return _ledger_error(lambda: sum(len(batch) for batch in loader))


def die_before_the_epochs_end(
    rank: int, world: int, count: int, victim: int, **options: Any
) -> dict[str, Any]:
    """Rank ``victim`` exits after taking the last batch of epoch 0, a little after the others
    reached the epoch's end: how they leave the ledger's check, and how fast."""
    import time

    loader = _loader(Samples(count), **options)
    steps = len(loader)
    found: dict[str, Any] = {"error": None}
    with loader:
        started = time.monotonic()
        try:
            for step, _ in enumerate(loader):
                if step == steps - 1:
                    if rank == victim:
                        time.sleep(1.0)  # the others wait in the check
                        os._exit(0)
                    started = time.monotonic()
        except Exception as error:
            found = {"error": type(error).__name__, "message": str(error)}
        found["seconds"] = time.monotonic() - started
    return found


def ledger_switched_off_on_one_rank(rank: int, world: int, count: int) -> dict[str, Any]:
    """Rank 1 runs with ``FEEDLINE_LEDGER=0``."""
    if rank == 1:
        os.environ["FEEDLINE_LEDGER"] = "0"
    try:
        _loader(Samples(count), batch_size=2).close()
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


class _SlowOn:
    """Samples in memory, each read on ``rank`` taking ``delay`` seconds (a stalled store)."""

    def __init__(self, count: int, rank: int, delay: float) -> None:
        self.count, self.rank, self.delay = count, rank, delay

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> bytes:
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            time.sleep(self.delay)
        return body(i)


def stall_reported(rank: int, world: int, count: int) -> dict[str, Any]:
    """One epoch while rank 1's reads each take 3 s; what the watchdog logged on this rank."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("feedline.watchdog").addHandler(Keep())
    loader = _loader(_SlowOn(count, 1, 3.0), batch_size=2, shuffle=False, report_stall_after=1.0)
    with loader:
        batches = [batch for batch in loader]
    return {"batches": batches, "reports": records}


def keys_for_the_job(
    rank: int, world: int, endpoint: str, directory: str, workers: int, bucket: str = BUCKET
) -> dict[str, Any]:
    """The keys as this rank and ``workers`` stand-ins for its DataLoader workers (stores on
    the rank's own cache directory) list them, sharing one listing over the group."""
    import torch.distributed as dist

    from feedline import RemoteStore
    from feedline.source import ObjectCache

    def store() -> RemoteStore:
        cache = ObjectCache(1 << 20, directory=Path(directory) / f"rank{rank}")
        return RemoteStore(f"s3://{bucket}", endpoint=endpoint, cache=cache, **CREDENTIALS)

    mine = store()
    keys = list(mine.keys("data", suffix="7", group=dist.group.WORLD))
    stats = mine.stats()
    theirs = [list(store().keys("data", suffix="7")) for _ in range(workers)]
    missing: str | None = None
    nowhere = RemoteStore("s3://no-such-bucket", endpoint=endpoint, retries=0, **CREDENTIALS)
    try:
        nowhere.keys("data", group=dist.group.WORLD)
    except Exception as error:  # every rank hears of the first rank's failure
        missing = type(error).__name__
    return {
        "keys": keys,
        "workers_same": all(t == keys for t in theirs),
        "listed": stats.listings,
        "reused": stats.listings_reused,
        "missing": missing,
    }


def die_before_making_the_loader(
    rank: int, world: int, count: int, victim: int, loader_timeout: float
) -> dict[str, Any]:
    """Rank ``victim`` exits before it makes its loader: how long the others wait, and why."""
    import time

    if rank == victim:
        os._exit(0)
    started = time.monotonic()
    try:
        _loader(Samples(count), batch_size=2, timeout=loader_timeout).close()
    except Exception as error:
        return {
            "error": type(error).__name__,
            "message": str(error),
            "seconds": time.monotonic() - started,
        }
    return {"error": None}


def loaders_dropped_without_close(rank: int, world: int, count: int) -> dict[str, Any]:
    """Loaders made, iterated for an epoch and dropped, never closed: what each leaves."""
    import gc

    def held() -> tuple[int, int]:
        # The fewest over a second: a thread that is ending (the finalizer stopped it) counts
        # for a moment on a busy machine; one kept per loader counts throughout.
        gc.collect()
        seen = []
        for _ in range(20):
            seen.append((len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))))
            time.sleep(0.05)
        return min(n for n, _ in seen), min(t for _, t in seen)

    counts = []
    for _ in range(5):
        loader = _loader(Samples(count), batch_size=2)
        for _ in loader:
            pass
        del loader
        counts.append(held())
    return {"counts": counts}


def uneven_breaks(rank: int, world: int, count: int, stops: list[int]) -> dict[str, Any]:
    """Rank ``r`` leaves epoch 0 after ``stops[r]`` steps (the docs ask for the same step):
    what the rank that stayed longest says while it waits for its peers' exchanges."""
    import logging
    import time

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("feedline.watchdog").addHandler(Keep())
    loader = _loader(Samples(count), batch_size=2, timeout=4.0, report_stall_after=1.0)
    it = iter(loader)
    for step, _ in enumerate(it):
        if step + 1 == stops[rank]:
            break
    del it
    if stops[rank] < max(stops):  # alive, elsewhere (a loop of its own, say)
        time.sleep(6)
    loader.close()
    return {"said": said}
