"""Datasets for the loader tests, at module level so that worker processes can import them."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset


class Nested(Dataset[dict[str, Any]]):
    """Samples with a tensor, a nested tuple and a string, like real datasets return."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "x": torch.arange(3, dtype=torch.float32) + i,
            "meta": (i, float(i) / 2, {"name": f"item{i}"}),
        }


class Failing(Dataset[int]):
    """``dataset[i]`` raises for the indices in ``bad``."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            raise OSError(f"cannot read sample {i}")
        return i


class Slow(Dataset[int]):
    """Each ``dataset[i]`` waits ``delay`` seconds; records how many calls overlap."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay
        self.lock = threading.Lock()
        self.active = 0
        self.peak = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            self.wait()
        finally:
            with self.lock:
                self.active -= 1
        return i

    def wait(self) -> None:
        time.sleep(self.delay)

    def __getstate__(self) -> dict[str, Any]:
        return {"n": self.n, "delay": self.delay}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["n"], state["delay"])  # type: ignore[misc]


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


class Pid(Dataset[int]):
    """Returns the id of the process that fetched the item."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[int, int]:
        import os

        return i, os.getpid()


class Stamped(Dataset[int]):
    """Records when each ``dataset[i]`` began (``perf_counter``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.started: dict[int, float] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.started[i] = time.perf_counter()
        return i


_DRAWN: dict[str, Any] = {}


def draw_at_init(worker_id: int) -> None:
    """A ``worker_init_fn``: draw from each generator PyTorch seeds, and read the worker info."""
    import random

    import numpy as np

    info = torch.utils.data.get_worker_info()
    _DRAWN["init"] = (
        worker_id,
        None if info is None else (info.id, info.num_workers, info.seed),
        random.random(),
        float(np.random.rand()),
        float(torch.rand(())),
    )


class WorkerView(Dataset[Any]):
    """``dataset[i]``: what ``worker_init_fn`` saw, and the worker info here."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        info = torch.utils.data.get_worker_info()
        return {
            "init": repr(_DRAWN.get("init")),
            "info": None if info is None else repr((info.id, info.num_workers, info.seed)),
        }


class Gathered(Slow):
    """``dataset[i]`` waits until ``parties`` calls are in flight at once (10 s at most).

    A fetcher that never runs that many at once fails the call (``BrokenBarrierError``).
    """

    def __init__(self, n: int, parties: int) -> None:
        super().__init__(n, 0.0)
        self.barrier = threading.Barrier(parties, timeout=10)

    def wait(self) -> None:
        self.barrier.wait()


class Counting(Dataset[int]):
    """A stateful map-style dataset: counts the items it served; ``state_dict`` says how many."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.served = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        self.served += 1
        return i, self.served

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.served = state["served"]


class ResumableStream(IterableDataset[int]):
    """A stateful stream: resumes from its own position instead of being replayed.

    ``opened`` counts the items read from the underlying "storage", so a test can see that a
    resumed epoch does not read again what was handed out before the checkpoint.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.position = 0
        self.opened = 0

    def __iter__(self) -> Any:
        while self.position < self.n:
            self.opened += 1
            value = self.position
            self.position += 1
            yield value
        self.position = 0  # the next epoch starts from the beginning

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class EpochStream(IterableDataset[Any]):
    """A stateful stream that counts its passes: item ``(i, pass)``, each worker its share.

    Its state holds the pass, which an uninterrupted loop's next ``iter()`` goes on from.
    """

    def __init__(self, n: int) -> None:
        self.n, self.passes, self.at = n, 0, 0

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        w, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start, self.at = self.at, 0
        for i in range(w + start * workers, self.n, workers):
            self.at += 1
            yield i, self.passes
        self.at = 0
        self.passes += 1

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at, "passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at, self.passes = state["at"], state["passes"]


class SharesStream(IterableDataset[int]):
    """A stateful stream split among workers by ``get_worker_info()`` (torchdata's test case).

    ``sizes[w]`` items for worker ``w``, numbered on from the items of the workers before it;
    its state is how far the calling process's copy went.
    """

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.i = 0
        self.resume: int | None = None

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, sizes = (info.id, self.sizes) if info is not None else (0, [sum(self.sizes)])
        self.i, self.resume = (self.resume or 0), None
        start = sum(sizes[:worker])
        for i in range(start + self.i, start + sizes[worker]):
            self.i += 1
            yield i

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume = state["i"]


class StatefulSampler(torch.utils.data.Sampler[int]):
    """A sampler that resumes itself: a seeded permutation and how far it went."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch, self.yielded = n, seed, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        while self.yielded < self.n:
            self.yielded += 1
            yield order[self.yielded - 1]
        self.yielded, self.epoch = 0, self.epoch + 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.yielded = state["epoch"], state["yielded"]


class Rendezvous(Dataset[int]):
    """Each worker's first item waits for every other worker's (a barrier across processes)."""

    def __init__(self, n: int, barrier: Any) -> None:
        self.n, self.barrier = n, barrier

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i < self.barrier.parties:
            self.barrier.wait(timeout=30)
        return i


class Sleepy(Dataset[int]):
    """Item ``i`` sleeps ``delays.get(i, 0)`` seconds (in whichever process fetches it)."""

    def __init__(self, n: int, delays: dict[int, float]) -> None:
        self.n, self.delays = n, delays

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delays.get(i, 0.0))
        return i


class Suicidal(Dataset[int]):
    """Fetching item ``victim`` kills the fetching process with SIGKILL."""

    def __init__(self, n: int, victim: int) -> None:
        self.n, self.victim = n, victim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.victim:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return i


def failing_init(worker_id: int) -> None:
    raise LookupError(f"no shard for worker {worker_id}")


class Augmenting(Dataset[Any]):
    """Random augmentation the way torchvision does it: draws from the global generators."""

    def __init__(self, n: int, seeded: bool = False) -> None:
        self.n, self.seeded = n, seeded

    def __len__(self) -> int:
        return self.n

    def _draw(self, i: int) -> Any:
        import random

        import numpy as np

        time.sleep(0.001)  # lets the calls of several threads interleave
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), np.random.rand()])

    def __getitem__(self, i: int) -> Any:
        if not self.seeded:
            return self._draw(i)
        import feedline.loader

        with feedline.loader.seeded():
            return self._draw(i)


def failing_collate(items: Any) -> Any:
    raise KeyError("label")


def worker_pid_collate(items: Any) -> Any:
    """Collates, and says which process collated."""
    import os

    return torch.tensor(items), os.getpid()


class Kinds(Dataset[Any]):
    """Every kind of field ``default_collate`` stacks: arrays, tensors (one without a NumPy
    dtype), numbers, strings, nested; ``ragged`` makes item 3's array a different shape."""

    def __init__(self, n: int, ragged: bool = False) -> None:
        self.n, self.ragged = n, ragged

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        side = 5 if self.ragged and i == 3 else 4
        return {
            "image": np.full((side, 4, 3), i, dtype=np.uint8),
            "mask": (torch.arange(6).reshape(2, 3) + i) % 2 == 0,
            "half": torch.full((3,), float(i), dtype=torch.bfloat16),
            "pair": (torch.tensor([i, -i], dtype=torch.int64), float(i) / 3),
            "label": i,
            "name": f"item{i}",
        }


class Pictures(Dataset[Any]):
    """``n`` JPEGs of 480x360, decoded and resized to 224x224 with feedline's decoder."""

    def __init__(self, n: int) -> None:
        import cv2
        import numpy as np

        rng = np.random.default_rng(0)
        self.jpegs = [
            cv2.imencode(".jpg", rng.integers(0, 255, (360, 480, 3), dtype=np.uint8))[1].tobytes()
            for _ in range(4)
        ]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        from feedline.io import decode_image

        return decode_image(self.jpegs[i % 4], size=(224, 224))


class ShardedStream(IterableDataset[Any]):
    """Items ``worker, worker + W, ...`` of ``range(n)`` in each worker (uneven shares), each
    with a draw from torch's generator (seeded per worker); items at ``fail_at`` raise."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.n, workers):
            if i == self.fail_at:
                raise KeyError(f"item {i} is missing")
            yield torch.tensor([i, int(torch.randint(0, 1000, ()))])


class LambdaStream(IterableDataset[Any]):
    """Yields an item that cannot be pickled (a lambda) at ``bad``."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.n, workers):
            yield (lambda i=i: i) if i == self.bad else i


def keep_as_is(batch: Any) -> Any:
    return batch


def count_from_worker(worker_id: int) -> None:
    """A ``worker_init_fn``: worker ``w``'s :class:`Counting` counts on from ``100 * (w + 1)``."""
    info = torch.utils.data.get_worker_info()
    info.dataset.served = 100 * (worker_id + 1)


class RandomItems(Dataset[Any]):
    """Items that draw from torch's global generator; its state holds that generator's state.

    torchdata's own test dataset for states (``DummyMapDataset``): ``load_state_dict`` sets
    the global generator, so what is drawn around it shows when the loader calls it.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.served = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.served += 1
        return torch.tensor([i, self.served, int(torch.randint(1000, ()))])

    def state_dict(self) -> dict[str, Any]:
        # A list, not the tensor: a tensor crossing from a worker leaves torch's descriptor
        # sharing thread running in the parent (torchdata's workers send it so).
        return {"served": self.served, "rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.served = state["served"]
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


class OwnIterator(IterableDataset[int]):
    """An iterable dataset that is its own iterator: ``__iter__`` starts its share over and
    returns itself (worker ``w`` has ``sizes[w]`` items, numbered on from the workers before)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.start = self.end = self.i = 0

    def __iter__(self) -> OwnIterator:
        info = torch.utils.data.get_worker_info()
        worker, sizes = (info.id, self.sizes) if info is not None else (0, [sum(self.sizes)])
        self.start, self.end = sum(sizes[:worker]), sum(sizes[: worker + 1])
        self.i = self.start
        return self

    def __next__(self) -> int:
        if self.i >= self.end:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


EVENTS: list[str] = []
"""What :class:`LoadRecorder` and :class:`IterRecorder` saw happen, in order (one process)."""


class LoadRecorder(Counting):
    """A :class:`Counting` that records in :data:`EVENTS` when its state is loaded."""

    def load_state_dict(self, state: dict[str, int]) -> None:
        EVENTS.append("dataset state loaded")
        super().load_state_dict(state)


class IterRecorder(torch.utils.data.Sampler[int]):
    """``range(n)``, recording in :data:`EVENTS` when it is iterated and first drawn from."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        EVENTS.append("sampler iterated")

        def indices() -> Any:
            EVENTS.append("sampler drawn from")
            yield from range(self.n)

        return indices()


class SlowFirstWorker(Dataset[Any]):
    """Item ``i`` is ``(i, worker id)``; worker 0 takes ``delay`` seconds per item."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        worker = -1 if info is None else info.id
        if worker == 0:
            time.sleep(self.delay)
        return i, worker


class Spinning(Dataset[Any]):
    """Item ``i``: ``(i, pid)`` after ``spin`` iterations of Python code (holding the GIL);
    items in ``failing`` raise ``KeyError``."""

    def __init__(self, n: int, spin: int = 0, failing: frozenset[int] = frozenset()) -> None:
        self.n, self.spin, self.failing = n, spin, failing

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        import os

        total = 0
        for k in range(self.spin):
            total += k
        if i in self.failing:
            raise KeyError(f"item {i} fails")
        return i, os.getpid()


class NotRebuilt(Spinning):
    """A :class:`Spinning` that pickles, and whose copy cannot be made from the pickle (as a
    class defined in a notebook's ``__main__`` cannot, in a worker the fork server starts)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise RuntimeError("this dataset cannot be rebuilt in another process")


class Drawing(Dataset[Any]):
    """Item ``i``: ``(i, pid, a draw of the global random generator)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, float]:
        import os
        import random

        return i, os.getpid(), random.random()
