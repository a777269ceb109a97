"""Random augmentation is reproducible: PyTorch's exact draws at fetch_concurrency=1, and a seed
per item at any concurrency."""

from __future__ import annotations

import json
import random
import time
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import BatchSampler, RandomSampler  # noqa: E402
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402

import feedline.loader  # noqa: E402
from feedline import DataLoader  # noqa: E402
from feedline.loader._rewind import GeneratorRewind  # noqa: E402
from feedline.loader._seeds import RngWatch  # noqa: E402

from .._system import starts_processes  # noqa: E402
from ._datasets import Augmenting  # noqa: E402
from ._procs import no_children_left  # noqa: E402

pytestmark = starts_processes


def _epochs(cls: Any, dataset: Any, epochs: int = 3, **kw: Any) -> list[Any]:
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    loader = cls(dataset, **kw)
    return [b for _ in range(epochs) for b in loader]


def _same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x, y)


def _sampler(kind: str) -> dict[str, Any]:
    if kind == "shuffle":
        return {"batch_size": 4, "shuffle": True}
    if kind == "drop_last":
        return {"batch_size": 3, "shuffle": True, "drop_last": True}
    if kind == "sampler":
        g = torch.Generator().manual_seed(3)
        return {"batch_size": 4, "sampler": RandomSampler(range(18), True, 14, generator=g)}
    g = torch.Generator().manual_seed(4)
    return {"batch_sampler": BatchSampler(RandomSampler(range(18), generator=g), 5, False)}


@pytest.mark.parametrize(
    ("kind", "workers"),
    [
        ("shuffle", 0),
        ("drop_last", 0),
        ("sampler", 0),
        ("batch_sampler", 0),
        ("shuffle", 2),
        ("batch_sampler", 2),
        ("drop_last", 4),
    ],
)
def test_fetch_concurrency_1_draws_exactly_as_pytorch(kind: str, workers: int) -> None:
    extra: dict[str, Any] = {"num_workers": workers}
    if workers:
        extra["multiprocessing_context"] = "forkserver"
    expected = _epochs(TorchLoader, Augmenting(18), **_sampler(kind), **extra)
    got = _epochs(DataLoader, Augmenting(18), **_sampler(kind), **extra, fetch_concurrency=1)
    _same(got, expected)


def test_item_seeds_make_augmentation_reproducible_at_any_concurrency() -> None:
    kw = {"batch_size": 6, "shuffle": True, "fetch_concurrency": 8}
    first = _epochs(DataLoader, Augmenting(24, seeded=True), **kw)
    again = _epochs(DataLoader, Augmenting(24, seeded=True), **kw)
    _same(first, again)
    one_at_a_time = _epochs(
        DataLoader, Augmenting(24, seeded=True), **{**kw, "fetch_concurrency": 1}
    )
    _same(first, one_at_a_time)
    in_workers = _epochs(DataLoader, Augmenting(24, seeded=True), **kw, num_workers=2, epochs=3)
    _same(first, in_workers)
    # Different epochs draw differently.
    assert not torch.equal(first[0][:, 1:], first[4][:, 1:])


def test_item_seeds_survive_a_resume() -> None:
    kw = {"batch_size": 6, "shuffle": True, "fetch_concurrency": 8}
    whole = _epochs(DataLoader, Augmenting(24, seeded=True), epochs=1, **kw)
    torch.manual_seed(7)
    loader = DataLoader(Augmenting(24, seeded=True), **kw)
    it = iter(loader)
    head = [next(it), next(it)]
    state = loader.state_dict()
    del it
    torch.manual_seed(0)
    resumed = DataLoader(Augmenting(24, seeded=True), **kw)
    resumed.load_state_dict(state)
    _same(head + list(resumed), whole)


def test_the_item_info_is_there_only_inside_a_fetch() -> None:
    seen: list[Any] = []

    class Probe(torch.utils.data.Dataset[int]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            seen.append(feedline.loader.get_item_info())
            return i

    list(DataLoader(Probe(), batch_size=2))
    assert feedline.loader.get_item_info() is None
    assert sorted(info.index for info in seen) == [0, 1, 2, 3]
    assert len({info.seed for info in seen}) == 4
    assert all(0 <= info.seed < 2**63 for info in seen)


def test_global_draws_at_concurrency_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RngWatch, "warned", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            list(DataLoader(Augmenting(16), batch_size=4, fetch_concurrency=4))
    record = [w for w in record if "fetch_concurrency=1" in str(w.message)]
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1


@pytest.mark.parametrize("kw", [{"fetch_concurrency": 1}, {"fetch_concurrency": 4}])
def test_no_warning_when_the_draws_are_reproducible(
    monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any]
) -> None:
    monkeypatch.setattr(RngWatch, "warned", False)
    seeded = kw["fetch_concurrency"] > 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        list(DataLoader(Augmenting(16, seeded=seeded), batch_size=4, **kw))


def test_a_dataset_that_asks_only_after_the_first_batch_gets_its_items_from_then_on() -> None:
    from feedline.loader import _seeds

    _seeds._Asked.value = False  # as in a fresh process
    seen: list[Any] = []

    class Late(torch.utils.data.Dataset[int]):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> int:
            if i >= 4:
                seen.append((i, feedline.loader.get_item_info()))
            return i

    list(DataLoader(Late(), batch_size=4, fetch_concurrency=1))
    infos = [info for _, info in seen]
    assert infos[0] is None  # asked for the first time after the first batch, untracked
    assert all(info is not None and info.index == i for i, info in seen[1:])


@pytest.mark.parametrize("own_generator", [False, True])
def test_persistent_workers_shuffle_every_epoch_as_pytorch(own_generator: bool) -> None:
    # PyTorch draws a persistent iterator's base seed once; feedline derives the later
    # epochs' from it instead of drawing, so every epoch's order is PyTorch's. The first
    # epoch's augmentation is PyTorch's too (later ones: workers reseeded, see the README).
    def run(cls: Any, **kw: Any) -> list[Any]:
        if own_generator:
            kw["generator"] = torch.Generator().manual_seed(11)
        return _epochs(
            cls,
            Augmenting(18),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            multiprocessing_context="forkserver",
            **kw,
        )

    expected, got = run(TorchLoader), run(DataLoader, fetch_concurrency=1)
    assert [b[:, 0].tolist() for b in got] == [b[:, 0].tolist() for b in expected]
    _same(got[:5], expected[:5])
    orders = {tuple(torch.cat([b[:, 0] for b in got[e : e + 5]]).tolist()) for e in (0, 5, 10)}
    assert len(orders) == 3  # each epoch shuffled anew


def test_persistent_workers_resume_mid_epoch_exactly() -> None:
    # The order and the per-item seeds: both follow from the state alone.
    kw: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    kw["persistent_workers"] = True
    whole = _epochs(DataLoader, Augmenting(18, seeded=True), **kw)  # 3 epochs of 5 batches
    torch.manual_seed(7)
    loader = DataLoader(Augmenting(18, seeded=True), **kw)
    head = list(loader)
    for i, batch in enumerate(loader):  # the second epoch, left after 2 batches
        head.append(batch)
        if i == 1:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    torch.manual_seed(123)  # the resumed job's own seeds must not matter
    resumed = DataLoader(Augmenting(18, seeded=True), **kw)
    resumed.load_state_dict(state)
    tail = list(resumed) + list(resumed)
    resumed.close()
    _same(head + tail, whole)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [0, 1])
def test_a_loop_left_early_leaves_the_generator_where_pytorch_leaves_it(
    workers: int, stop: int
) -> None:
    # The loader draws batches ahead; leaving the loop puts generator= back where PyTorch's
    # iterator left it, so that what the program draws next (the next epoch's shuffle) agrees.
    outcomes = []
    for cls in (TorchLoader, DataLoader):
        generator = torch.Generator().manual_seed(3)
        loader = cls(
            list(range(10)), batch_size=3, shuffle=True, generator=generator, num_workers=workers
        )
        for k, _ in enumerate(loader):
            if k == stop:
                break
        later = [b.tolist() for b in loader]
        outcomes.append((torch.rand(2, generator=generator).tolist(), later))
    assert outcomes[1] == outcomes[0]


def test_draws_the_program_made_after_the_loop_are_not_undone() -> None:
    # The iterator is kept past the loop and the program draws from the generator: those
    # draws stand when the iterator is dropped later. (The program draws once the loader's
    # thread has drawn its batches ahead: a draw at the moment it draws one cannot be told
    # from the loader's, see the loader's README.)
    outcomes = []
    for cls in (TorchLoader, DataLoader):
        generator = torch.Generator().manual_seed(0)
        sampler = RandomSampler(range(50), replacement=True, generator=generator)
        it = iter(cls(list(range(50)), batch_size=1, sampler=sampler))
        next(it)
        time.sleep(0.5)  # the few batches a consumer that does not wait gets ahead are drawn
        first = torch.rand(3, generator=generator).tolist()
        del it
        outcomes.append((first, torch.rand(3, generator=generator).tolist()))
    assert outcomes[1] == outcomes[0]
    assert outcomes[1][0] != outcomes[1][1]


def _chunk(generator: Any) -> None:  # the sampler draws indices for several batches at once
    torch.randint(10, (4,), generator=generator)


@pytest.mark.parametrize("program_draws_first", [True, False])
def test_a_program_draw_between_the_loaders_draws_stands_and_theirs_are_undone(
    program_draws_first: bool,
) -> None:
    # The loader draws batches ahead on its own thread while the program draws from the same
    # generator: whichever comes first, leaving after batch 0 leaves the generator as PyTorch
    # would (its batch 0's draw, then the program's), not before the program's draw.
    expected = torch.Generator().manual_seed(0)
    _chunk(expected)  # batch 0 (and 1, from the same draw)
    program_draw = torch.rand(3, generator=expected)

    generator = torch.Generator().manual_seed(0)
    rewind = GeneratorRewind([generator])
    rewind.drawn(-1)
    rewind.before_draw(0)
    _chunk(generator)
    rewind.drawn(0)
    rewind.before_draw(1)
    rewind.drawn(1)  # from the chunk: no draw
    if program_draws_first:
        assert torch.equal(torch.rand(3, generator=generator), program_draw)
    rewind.before_draw(2)
    _chunk(generator)  # the loader's next chunk, ahead of the consumer
    rewind.drawn(2)
    if not program_draws_first:
        torch.rand(3, generator=generator)  # after the loader's: from the later chunk's state
    rewind.rewind(0)  # the consumer took batch 0 only, and left
    if program_draws_first:
        assert torch.equal(generator.get_state(), expected.get_state())
    else:  # the program drew after the loader's last draw: everything stands
        assert not torch.equal(generator.get_state(), expected.get_state())


def test_global_draws_on_threads_in_workers_warn_in_the_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(RngWatch, "warned", False)
    loader = DataLoader(Augmenting(48), batch_size=4, num_workers=2, fetch_concurrency=4)
    with pytest.warns(RuntimeWarning, match="on several threads in each worker process"):
        assert len(list(loader)) == 12
    no_children_left()


@pytest.mark.parametrize("kw", [{"fetch_concurrency": 1}, {"fetch_concurrency": 4}])
def test_no_warning_from_workers_when_the_draws_are_reproducible(
    monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any]
) -> None:
    # One call at a time in each worker draws as PyTorch's workers do; seeded draws are the
    # same at any concurrency.
    monkeypatch.setattr(RngWatch, "warned", False)
    seeded = kw["fetch_concurrency"] > 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        list(DataLoader(Augmenting(48, seeded=seeded), batch_size=4, num_workers=2, **kw))
    no_children_left()
