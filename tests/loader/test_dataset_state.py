"""A dataset's own state in the loader's checkpoint: when it is taken and when it is loaded.

torchdata's ``StatefulDataLoader`` is the reference: each test runs it and feedline on the
same input and compares the batches, and where they say the same thing, the states.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchdata.stateful_dataloader")

from feedline import DataLoader  # noqa: E402
from feedline.errors import ConfigurationError  # noqa: E402

from .._system import starts_processes, zombies  # noqa: E402
from . import _datasets  # noqa: E402
from ._datasets import (  # noqa: E402
    Counting,
    EpochStream,
    IterRecorder,
    LoadRecorder,
    OwnIterator,
    RandomItems,
    ResumableStream,
    SharesStream,
    count_from_worker,
)
from ._procs import no_children_left  # noqa: E402
from ._reference import dataset_states, side_by_side  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
    starts_processes,
]


def _plain(data: Any) -> Any:
    """Batches as lists (a collate_fn, too: items as they are)."""
    if isinstance(data, torch.Tensor):
        return data.tolist()
    if isinstance(data, list | tuple):
        return [_plain(d) for d in data]
    return data


def _make(kind: str) -> Any:
    return {
        "map": lambda: Counting(8),
        "stream": lambda: SharesStream([5, 7]),
        "own iterator": lambda: OwnIterator([5, 7]),
    }[kind]()


@pytest.mark.parametrize("kind", ["map", "stream", "own iterator"])
@pytest.mark.parametrize(("workers", "concurrency"), [(0, 1), (0, "auto"), (2, 1)])
def test_the_dataset_state_is_saved_as_soon_as_the_epoch_starts(
    kind: str, workers: int, concurrency: int | str
) -> None:
    # torchdata's state holds the dataset's state once iter() ran: each worker's, after its
    # worker_init_fn (and, for an iterable dataset, iter()). Resuming from it replays the
    # whole epoch.
    kw: dict[str, Any] = {"batch_size": 2, "num_workers": workers, "collate_fn": _plain}
    if workers and kind == "map":
        kw["worker_init_fn"] = count_from_worker
    outcomes = []
    for make in side_by_side(concurrency):
        loader = make(_make(kind), **kw)
        it = iter(loader)
        state = loader.state_dict()
        whole = list(it)
        resumed = make(_make(kind), **kw)
        resumed.load_state_dict(state)
        outcomes.append((dataset_states(state), whole, list(resumed)))
    assert outcomes[1] == outcomes[0]
    states, whole, again = outcomes[1]
    assert None not in states
    assert again == whole
    no_children_left()
    assert zombies() == []


@pytest.mark.parametrize(
    ("kind", "workers", "persistent"),
    [
        ("map", 0, False),
        ("map", 2, False),
        ("map", 2, True),
        ("random map", 2, True),
        ("stream", 0, False),
        ("stream", 2, False),
        ("stream", 2, True),
        ("passes", 0, False),
        ("passes", 2, False),
        ("passes", 2, True),
    ],
)
def test_the_dataset_state_after_the_last_batch_is_saved_and_the_next_epoch_goes_on_from_it(
    kind: str, workers: int, persistent: bool
) -> None:
    # After the last batch, torchdata's state holds the dataset's state after it (an
    # iterable dataset's after its iterator ended: without workers, the stream's 9 items
    # make 3 whole batches, and the end comes after the last). Resumed from it, the next
    # epoch is the one an uninterrupted loop has: the dataset goes on from its state where
    # it lives on (in this process, or in persistent workers; an iterable one's iter() is
    # called on it in that state); fresh workers start from the dataset as it was sent.
    kw: dict[str, Any] = {"batch_size": 3, "num_workers": workers}
    if workers:
        kw["persistent_workers"] = persistent

    def make() -> Any:
        if kind == "map":
            return Counting(8)
        if kind == "random map":
            return RandomItems(8)
        if kind == "passes":  # its next pass is its second, where it lives on
            return EpochStream(9)
        # Without workers, torchdata reads the state when asked: after the iterator ended.
        # Its workers' states are the ones sent with their last batches (see the README):
        # after the end, too, with a short last batch, whose reading met the end.
        return ResumableStream(9 if workers == 0 else 10)

    outcomes = []
    for new in side_by_side():
        torch.manual_seed(0)
        loader = new(make(), **kw)
        first = _plain(list(loader))
        state = loader.state_dict()
        second = _plain(list(loader))
        resumed = new(make(), **kw)
        resumed.load_state_dict(state)
        outcomes.append((dataset_states(state), first, second, _plain(list(resumed))))
        del loader, resumed
    states, _, second, after_resume = outcomes[1]
    assert None not in states
    assert after_resume == second
    if kind == "random map":
        # feedline seeds persistent workers anew for each epoch (see the README), where
        # torchdata's generators run on: the second epochs draw differently.
        assert outcomes[1][:2] == outcomes[0][:2]
    elif kind in ("stream", "passes") and persistent:
        # torchdata's persistent workers start the stream again where the last epoch's
        # first batches were (the state loaded at start-up is lost to a second iter()),
        # and a dataset that counts its passes counts one too many.
        assert outcomes[1][:3] == outcomes[0][:3]
    else:
        assert outcomes[1] == outcomes[0]
    no_children_left()
    assert zombies() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_draws_what_the_uninterrupted_one_drew(workers: int) -> None:
    # The dataset's load_state_dict() sets torch's global generator (torchdata's own test
    # dataset): torchdata loads it after the sampler's iterator is made and the base seed
    # drawn, so the items after it draw what they drew before the checkpoint.
    kw: dict[str, Any] = {"batch_size": 3, "num_workers": workers}
    outcomes = []
    for make in side_by_side():
        torch.manual_seed(0)
        whole = _plain(list(make(RandomItems(12), **kw)))
        torch.manual_seed(0)
        loader = make(RandomItems(12), **kw)
        it = iter(loader)
        head = _plain([next(it), next(it)])
        state = loader.state_dict()
        del it
        torch.manual_seed(99)  # a new process has another global state
        resumed = make(RandomItems(12), **kw)
        resumed.load_state_dict(state)
        outcomes.append((whole, head, _plain(list(resumed))))
    assert outcomes[1] == outcomes[0]
    whole, head, rest = outcomes[1]
    assert head + rest == whole
    no_children_left()
    assert zombies() == []


def test_on_resume_the_dataset_state_is_loaded_after_the_sampler_starts_as_torchdata_does() -> None:
    orders = []
    for make in side_by_side("auto"):
        kw: dict[str, Any] = {"batch_size": 2, "sampler": IterRecorder(8)}
        loader = make(LoadRecorder(8), **kw)
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        del it
        resumed = make(LoadRecorder(8), **kw)
        resumed.load_state_dict(state)
        _datasets.EVENTS.clear()
        assert [b[0].tolist() for b in resumed] == [[2, 3], [4, 5], [6, 7]]
        # torchdata makes the sampler's iterator more than once: the order of first times.
        orders.append(list(dict.fromkeys(_datasets.EVENTS)))
    assert orders[1] == orders[0]
    assert orders[1] == ["sampler iterated", "sampler drawn from", "dataset state loaded"]


@pytest.mark.parametrize(("saved", "loaded"), [(2, 0), (0, 3), (2, 3)])
def test_a_dataset_state_resumed_with_another_worker_count_is_refused(
    saved: int, loaded: int
) -> None:
    # Each process's copy of a stateful dataset resumes from its own state: with another
    # count, some would start from nothing, or some states be lost.
    loader = DataLoader(Counting(40), batch_size=2, num_workers=saved)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it, loader
    resumed = DataLoader(Counting(40), batch_size=2, num_workers=loaded)
    resumed.load_state_dict(state)
    words = "0 or 1" if saved == 0 else str(saved)
    with pytest.raises(ConfigurationError, match=f"saved with num_workers={words} .*same"):
        iter(resumed)
    no_children_left()
    assert zombies() == []


def test_a_state_saved_between_epochs_is_loaded_before_the_next_epochs_draws() -> None:
    # The dataset's state sets the global generator the sampler shuffles from (no
    # generator=): loaded after the shuffle, a resumed job's epochs would repeat the shuffles
    # of a fresh process. Two epochs, a checkpoint, two more: the four epochs of a loop that
    # never stopped, as with torchdata.
    def epochs(new: Any) -> list[Any]:
        kw: dict[str, Any] = {"batch_size": 4, "shuffle": True, "collate_fn": _plain}
        torch.manual_seed(0)
        loader = new(RandomItems(20), **kw)
        got = [[[item[0] for item in batch] for batch in loader] for _ in range(2)]
        state = loader.state_dict()
        torch.manual_seed(0)  # a new process
        loader = new(RandomItems(20), **kw)
        loader.load_state_dict(state)
        return got + [[[item[0] for item in batch] for batch in loader] for _ in range(2)]

    def uninterrupted(new: Any) -> list[Any]:
        torch.manual_seed(0)
        loader = new(RandomItems(20), batch_size=4, shuffle=True, collate_fn=_plain)
        return [[[item[0] for item in batch] for batch in loader] for _ in range(4)]

    for new in side_by_side():
        assert epochs(new) == uninterrupted(new)
