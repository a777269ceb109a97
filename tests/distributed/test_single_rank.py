"""DistributedLoader in one process (a world of one): its sequence, state and arguments."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader  # noqa: E402

from feedline import ConfigurationError  # noqa: E402
from feedline.distributed import DistributedLoader  # noqa: E402

from .._interrupts import ctrl_c_after, where_the_ctrl_c_lands  # noqa: E402
from ._ranks import Samples, index_of  # noqa: E402


def _loader(count: int = 20, **options: object) -> DistributedLoader[list[int]]:
    return DistributedLoader(
        Samples(count),
        batch_size=4,
        transform=index_of,
        collate_fn=list,
        **options,  # type: ignore[arg-type]
    )


def test_one_rank_gives_the_shuffled_dataloaders_batches_each_epoch() -> None:
    with _loader(seed=3) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            generator = torch.Generator()
            generator.manual_seed(3 + epoch)
            order = torch.randperm(20, generator=generator).tolist()
            reference = [b.tolist() for b in DataLoader(order, batch_size=4)]
            assert [sorted(b) for b in loader] == [sorted(b) for b in reference]
            assert len(loader) == 5
        assert loader.stats().storage_reads == 20  # the second epoch from the cache
        assert loader.stats().cache_hits == 20


def test_state_after_break_resumes_at_the_next_batch_and_is_json() -> None:
    with _loader() as whole:
        expected = list(whole)
    with _loader() as first:
        taken = []
        for step, batch in enumerate(first):
            taken.append(batch)
            if step == 1:
                break
        state = json.loads(json.dumps(first.state_dict()))
    assert (state["epoch"], state["step"]) == (0, 2)
    with _loader() as resumed:
        resumed.load_state_dict(state)
        assert taken + list(resumed) == expected
        assert len(list(resumed)) == 5  # then the next epoch, whole


def test_an_exception_in_the_loop_keeps_the_position() -> None:
    with _loader() as loader:
        with pytest.raises(RuntimeError, match="boom"):
            for step, _ in enumerate(loader):
                if step == 2:
                    raise RuntimeError("boom")
        assert loader.state_dict()["step"] == 3


def test_empty_dataset_and_bad_arguments() -> None:
    with _loader(count=0) as empty:
        assert list(empty) == []
    with pytest.raises(ConfigurationError, match="map-style"):
        DistributedLoader(iter([b"x"]), batch_size=2)
    with pytest.raises(ConfigurationError, match="replicas must be between 1"):
        DistributedLoader(Samples(4), batch_size=2, replicas=3)
    with pytest.raises(ConfigurationError, match="cached_share"):
        _loader(cached_share=1.5)
    with pytest.raises(ConfigurationError, match="batch_size"):
        DistributedLoader(Samples(4), batch_size=0)
    with pytest.raises(ConfigurationError, match="transform_concurrency"):
        _loader(transform_concurrency=0)
    with pytest.raises(ConfigurationError, match="init_process_group"):
        _loader(rank=1)
    with pytest.raises(ConfigurationError, match="init_process_group"):
        _loader(world_size=2)
    with _loader() as loader, pytest.raises(ConfigurationError, match="another dataset"):
        loader.load_state_dict({**loader.state_dict(), "size": 99})


def test_the_state_after_a_whole_epoch_is_the_next_epochs_start() -> None:
    with _loader(seed=1) as loader:
        first = list(loader)
        state = loader.state_dict()
        assert (state["epoch"], state["step"]) == (1, 0)
        second = list(loader)  # without set_epoch: the next epoch
    with _loader(seed=1) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(1)  # a loop resuming at the saved epoch, as Lightning does
        assert list(resumed) == second
        resumed.set_epoch(1)  # asked for again once finished: that epoch from its start
        assert list(resumed) == second
    assert sorted(x for b in first for x in b) == list(range(20))


def test_a_sample_that_cannot_be_read_is_left_out_each_epoch_and_counted_once() -> None:
    with DistributedLoader(
        Samples(12, broken=5), batch_size=4, transform=index_of, collate_fn=list, max_failures=1
    ) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert sorted(x for b in loader for x in b) == [i for i in range(12) if i != 5]
        assert loader.stats().failures == 1


def test_a_transform_error_names_its_sample_and_rank() -> None:
    def decode(data: bytes) -> int:
        i = index_of(data)
        if i == 7:
            raise ValueError("cannot decode")
        return i

    loader = DistributedLoader(Samples(12), batch_size=4, transform=decode, collate_fn=list)
    with pytest.raises(ValueError, match="cannot decode") as info:
        list(loader)
    assert "raised by the transform of sample 7 on rank 0 (epoch 0, step 1)" in info.value.__notes__
    loader.close()


def test_a_ctrl_c_while_a_batch_is_counted_comes_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Ctrl-C that lands between the ledger's record of a batch and the loader's step cut
    # the two apart (a checkpoint that load_state_dict() refused, or a batch lost); it comes
    # a moment after the batch is handed out, and the state saved then resumes exactly.
    import signal
    import time

    from feedline.distributed._ledgers import EpochLedger

    with _loader() as whole:
        expected = list(whole)
    handler = signal.getsignal(signal.SIGINT)
    with _loader() as first:
        it = iter(first)
        got = [next(it)]
        monkeypatch.setattr(EpochLedger, "take", ctrl_c_after(EpochLedger.take))
        with pytest.raises(KeyboardInterrupt):
            got.append(next(it))
            time.sleep(2)  # the loop's body, where the Ctrl-C comes
        monkeypatch.undo()
        state = json.loads(json.dumps(first.state_dict()))
        it.close()
    assert signal.getsignal(signal.SIGINT) is handler
    with _loader() as resumed:
        resumed.load_state_dict(state)
        assert got + list(resumed) == expected


@pytest.mark.parametrize("leave", ["break", "end"])
def test_a_held_ctrl_c_reaches_the_loop_however_it_is_left(
    monkeypatch: pytest.MonkeyPatch, leave: str
) -> None:
    # Held back as a batch is counted: after a loop left with break, or in the loop's except
    # when that batch was the last.
    from feedline.distributed._ledgers import EpochLedger

    which = 0 if leave == "break" else 4  # the first step, or the last of 5
    take = EpochLedger.take
    monkeypatch.setattr(EpochLedger, "take", ctrl_c_after(take, lambda step, _: step == which))
    with _loader() as loader:
        where = where_the_ctrl_c_lands(loader, leave)
    assert where == (("after the loop", 1) if leave == "break" else ("the loop", 5))
