"""TarShards: samples of tar shards from a directory or S3, shuffled, split and resumed."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import pickle
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("obstore")
torch = pytest.importorskip("torch")

from feedline import ConfigurationError, DataLoader, LedgerError, RemoteStore  # noqa: E402
from feedline._ledger import Ledger  # noqa: E402
from feedline.source import TarShards  # noqa: E402
from feedline.source import shards as shards_module  # noqa: E402

from .._interrupts import ctrl_c_after  # noqa: E402
from .._system import starts_processes, zombies  # noqa: E402
from ..loader._procs import no_children_left  # noqa: E402
from ._s3 import CREDENTIALS, moto_bucket  # noqa: E402

pytestmark = starts_processes  # DataLoader workers, and moto's server

SHARDS, PER_SHARD = 6, 7


def _shard(number: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(PER_SHARD):
            key = f"s{number}/{number * PER_SHARD + i:05d}"
            for ext, body in (("jpg", bytes([i]) * (100 + i)), ("cls", str(number).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


KEYS = [f"shard-{n}.tar" for n in range(SHARDS)]
EVERY = [f"s{n}/{n * PER_SHARD + i:05d}" for n in range(SHARDS) for i in range(PER_SHARD)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    for n, key in enumerate(KEYS):
        (root / key).write_bytes(_shard(n))
    return root


def _keys(samples: Any) -> list[str]:
    return [s["__key__"] for s in samples]


def _shard_threads() -> list[str]:
    """The shard readers left once those with nothing to read have ended (a moment)."""
    deadline = time.monotonic() + 2
    while True:
        names = [t.name for t in threading.enumerate() if t.name.startswith("feedline-shard")]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.01)


def test_a_directorys_shards_in_order_with_their_fields(folder: Path) -> None:
    samples = list(TarShards(folder, KEYS))
    assert _keys(samples) == EVERY
    assert samples[8]["__url__"] == "shard-1.tar"
    assert bytes(samples[8]["cls"]) == b"1"
    assert bytes(samples[8]["jpg"]) == bytes([1]) * 101


def test_the_same_samples_from_s3(folder: Path) -> None:
    objects = {f"shards/{key}": (folder / key).read_bytes() for key in KEYS}
    with moto_bucket("feedline-shards", objects) as (endpoint, served):
        store = RemoteStore("s3://feedline-shards/shards", endpoint=endpoint, **CREDENTIALS)
        samples = list(TarShards(store, KEYS, shuffle=10, seed=1))
        assert served["GET"] == SHARDS  # each shard read once, whole
    local = list(TarShards(folder, KEYS, shuffle=10, seed=1))
    assert _keys(samples) == _keys(local)
    assert [bytes(s["jpg"]) for s in samples] == [bytes(s["jpg"]) for s in local]


def test_shards_read_in_parallel_range_requests(folder: Path) -> None:
    objects = {f"shards/{key}": (folder / key).read_bytes() for key in KEYS}
    sizes = [len(body) for body in objects.values()]
    part = 2048
    with moto_bucket("feedline-shards", objects) as (endpoint, served):
        store = RemoteStore(
            "s3://feedline-shards/shards", endpoint=endpoint, part_size=part, **CREDENTIALS
        )
        samples = list(TarShards(store, KEYS))
        assert served["GET"] == sum(-(-size // part) for size in sizes)  # every part once
        assert store.stats().verified == SHARDS  # each shard's MD5, over the whole
    assert _keys(samples) == EVERY
    assert bytes(samples[8]["jpg"]) == bytes([1]) * 101


def test_shuffles_repeat_per_seed_and_epoch_and_lose_nothing(folder: Path) -> None:
    def order(seed: int, epoch: int) -> list[str]:
        shards = TarShards(folder, KEYS, shuffle=12, seed=seed)
        shards.set_epoch(epoch)
        return _keys(shards)

    assert order(0, 0) == order(0, 0)
    assert order(0, 1) != order(0, 0)
    assert order(1, 0) != order(0, 0)
    assert sorted(order(3, 2)) == EVERY
    assert order(0, 0) != EVERY


def test_ranks_share_the_shards_without_overlap(folder: Path) -> None:
    parts = [_keys(TarShards(folder, KEYS, shuffle=5, rank=r, world_size=4)) for r in range(4)]
    assert collections.Counter(k for part in parts for k in part) == collections.Counter(EVERY)
    with pytest.raises(Exception, match="rank must be"):
        TarShards(folder, KEYS, rank=4, world_size=4)
    with pytest.raises(Exception, match="together"):
        TarShards(folder, KEYS, rank=1)


def _key(sample: dict[str, Any]) -> str:
    return str(sample["__key__"])


@pytest.mark.parametrize("workers", [2, 3])
def test_dataloader_workers_split_the_shards_as_in_pytorch(folder: Path, workers: int) -> None:
    found = []
    for cls in (torch.utils.data.DataLoader, DataLoader):
        shards = TarShards(folder, KEYS, shuffle=4, seed=2)
        found.append(list(cls(shards, batch_size=None, num_workers=workers, collate_fn=_key)))
    assert found[0] == found[1]
    assert sorted(found[1]) == EVERY


def _as_is(sample: Any) -> Any:
    return sample


def test_unshuffled_samples_cross_from_dataloader_workers_as_bytes(folder: Path) -> None:
    loader = DataLoader(TarShards(folder, KEYS), batch_size=None, num_workers=2, collate_fn=_as_is)
    samples = list(loader)
    assert sorted(_keys(samples)) == EVERY
    assert all(isinstance(s["jpg"], bytes) for s in samples)


def _take(shards: TarShards, stop: int, *, how: str = "break") -> list[str]:
    # The first ``stop`` samples' keys; the loop leaves with a break, or with an error raised
    # in its body on the last one (it was handed out all the same).
    got: list[str] = []
    try:
        for sample in shards:
            got.append(sample["__key__"])
            if len(got) == stop:
                if how == "raise":
                    raise KeyError("the training step failed")
                break
    except KeyError:
        pass
    return got


def _saved(shards: TarShards) -> dict[str, Any]:
    # Its state as a checkpoint holds it: through JSON.
    return dict(json.loads(json.dumps(shards.state_dict())))


def _exactly_once(stats: Any, samples: int) -> None:
    assert stats is not None
    assert (stats.planned, stats.delivered, stats.repeated, stats.missing) == (
        samples,
        samples,
        0,
        0,
    )


@pytest.mark.parametrize("how", ["break", "raise"])
@pytest.mark.parametrize("stop", [1, 9, 30])
def test_break_then_resume_hands_out_the_rest(folder: Path, stop: int, how: str) -> None:
    whole = _keys(TarShards(folder, KEYS, shuffle=8, seed=4))
    shards = TarShards(folder, KEYS, shuffle=8, seed=4)
    first = _take(shards, stop, how=how)
    state = _saved(shards)
    assert (state["epoch"], state["yielded"]) == (0, stop)
    assert len(json.dumps(state["ledger"])) < 200
    resumed = TarShards(folder, KEYS, shuffle=8, seed=4)
    resumed.load_state_dict(state)
    assert first + _keys(resumed) == whole
    _exactly_once(resumed.ledger_stats(), len(EVERY))
    assert _shard_threads() == []  # the break closed the readers


def test_a_ctrl_c_while_a_sample_is_counted_comes_after_it(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Iterated on the main thread (by hand, or by a loader without workers): a Ctrl-C as a
    # sample is counted (the position, then the ledger) left it counted and not handed out,
    # lost on resume. It comes a moment after the sample is handed out.
    whole = _keys(TarShards(folder, KEYS, shuffle=8, seed=4))
    shards = TarShards(folder, KEYS, shuffle=8, seed=4)
    it = iter(shards)
    first = [next(it)["__key__"]]
    monkeypatch.setattr(Ledger, "deliver", ctrl_c_after(Ledger.deliver))
    with pytest.raises(KeyboardInterrupt):
        first.append(next(it)["__key__"])
        time.sleep(2)  # the loop's body, where the Ctrl-C comes
    monkeypatch.undo()
    state = _saved(shards)
    it.close()
    resumed = TarShards(folder, KEYS, shuffle=8, seed=4)
    resumed.load_state_dict(state)
    assert first + _keys(resumed) == whole


class _FailsOnce:
    """A store whose first read of ``key`` fails, as through a proxy that drops a connection
    (what a RemoteStore raises once its retries are spent)."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key, self.failed = store, key, 0

    def read_sync(self, key: str) -> Any:
        if key == self.key and not self.failed:
            self.failed += 1
            raise OSError(f"{key}: connection dropped by the proxy")
        return self.store.read_sync(key)


@contextlib.contextmanager
def _store(backing: str, folder: Path) -> Iterator[Any]:
    if backing == "folder":
        yield RemoteStore(folder.as_uri())
        return
    objects = {f"shards/{key}": (folder / key).read_bytes() for key in KEYS}
    with moto_bucket("feedline-shards", objects) as (endpoint, _):
        yield RemoteStore("s3://feedline-shards/shards", endpoint=endpoint, **CREDENTIALS)


OPTIONS: dict[str, Any] = {"shuffle": 8, "seed": 4}
HANDED_OUT = 30  # before the first run stops: in the fifth of the six shards


def _error_while_passing_over(
    folder: Path, store: Any
) -> tuple[list[str], dict[str, Any], TarShards]:
    # Epoch 1: 30 samples handed out, then a resume whose read of the third shard it reads
    # (while it passes over those 30) fails once. Returns the first 30, their state, and
    # the resumed TarShards after its error.
    first = TarShards(folder, KEYS, **OPTIONS)
    first.set_epoch(1)
    got = _take(first, HANDED_OUT)
    state = _saved(first)
    flaky = _FailsOnce(store, first.my_shards()[2])
    resumed = TarShards(flaky, KEYS, **OPTIONS)
    resumed.load_state_dict(state)
    with pytest.raises(OSError, match="connection dropped"):
        next(iter(resumed))
    assert flaky.failed == 1
    return got, state, resumed


@pytest.mark.parametrize("backing", ["folder", "s3"])
def test_a_read_error_while_a_resume_passes_over_leaves_its_position(
    folder: Path, backing: str
) -> None:
    whole = TarShards(folder, KEYS, **OPTIONS)
    whole.set_epoch(1)
    uninterrupted = _keys(whole)
    with _store(backing, folder) as store:
        got, state, resumed = _error_while_passing_over(folder, store)
        assert _saved(resumed) == state  # 30 handed out, as before the error (it said 6)
        resumed.load_state_dict(_saved(resumed))  # and again, the store answering now
        rest = _keys(resumed)
    assert got + rest == uninterrupted  # each sample once, in the uninterrupted order
    _exactly_once(resumed.ledger_stats(), len(EVERY))
    assert _shard_threads() == []


def test_the_ledger_refuses_a_position_that_went_back_on_a_read_error(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The defect, put back: while passing over what was handed out, the position counts up
    # from 0, so the read error leaves a state that says 6 where 30 were handed out.
    monkeypatch.setattr(
        shards_module, "_position_while_skipping", lambda handed_out, passed: passed
    )
    got, _, resumed = _error_while_passing_over(folder, RemoteStore(folder.as_uri()))
    state = _saved(resumed)
    went_back = 2 * PER_SHARD - OPTIONS["shuffle"]  # two shards read, the buffer full
    assert state["yielded"] == went_back
    repeated = HANDED_OUT - went_back
    refused = (
        rf"TarShards epoch 1: the saved position resumes at sample {went_back} but "
        rf"{repeated} sample\(s\) it does not pass over were handed out already "
        rf"\(first: sample {went_back}\)"
    )
    for shards in (resumed, TarShards(folder, KEYS, **OPTIONS)):
        with pytest.raises(LedgerError, match=refused):
            shards.load_state_dict(state)
    # Unchecked (a state without its ledger loads as an older one), it repeats them.
    again = TarShards(folder, KEYS, **OPTIONS)
    again.load_state_dict({"epoch": 1, "yielded": went_back})
    counts = collections.Counter(got + _keys(again))
    assert sum(n - 1 for n in counts.values()) == repeated
    assert again.ledger_stats() is None  # not checked


def test_a_position_moved_by_hand_is_refused_and_a_damaged_state_named(folder: Path) -> None:
    shards = TarShards(folder, KEYS, **OPTIONS)
    _take(shards, 10)
    state = _saved(shards)
    for moved, pattern in (
        (12, r"2 sample\(s\) passed over by the saved position but never handed out"),
        (7, r"resumes at sample 7 but 3 sample\(s\) .* handed out already \(first: sample 7\)"),
    ):
        with pytest.raises(LedgerError, match=pattern):
            TarShards(folder, KEYS, **OPTIONS).load_state_dict(dict(state, yielded=moved))
    with pytest.raises(ValueError, match="damaged ledger"):
        TarShards(folder, KEYS).load_state_dict(dict(state, ledger={"delivered": "x"}))
    with pytest.raises(ValueError, match=r"'yielded' must be an int >= 0, got None"):
        TarShards(folder, KEYS).load_state_dict({"epoch": 0})


def test_an_iterations_end_checks_its_position_against_the_ledger(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A position that runs ahead of what was handed out while a resume passes over it: the
    # iteration's end says so in StopIteration's place.
    shards = TarShards(folder, KEYS)
    _take(shards, 10)
    shards.load_state_dict(shards.state_dict())
    monkeypatch.setattr(
        shards_module, "_position_while_skipping", lambda handed_out, _: handed_out + 1
    )
    with pytest.raises(LedgerError, match=r"1 sample\(s\) passed over .*first: sample 42"):
        list(shards)


def test_iter_again_without_a_loaded_state_is_a_new_pass(folder: Path) -> None:
    whole = _keys(TarShards(folder, KEYS, **OPTIONS))
    shards = TarShards(folder, KEYS, **OPTIONS)
    assert _take(shards, 9) == whole[:9]
    assert shards.state_dict()["yielded"] == 9
    it = iter(shards)  # a new pass: from the epoch's first sample, its own ledger
    assert shards.state_dict() == {"epoch": 0, "yielded": 0, "ledger": _saved(shards)["ledger"]}
    assert _keys(it) == whole
    _exactly_once(shards.ledger_stats(), len(EVERY))
    # A loaded state is taken by one iteration only; the next one is a new pass.
    shards.load_state_dict(_saved(shards))  # after its end
    assert _keys(shards) == []
    assert _keys(shards) == whole


def test_set_epoch_or_a_loaded_state_detaches_a_running_iteration(folder: Path) -> None:
    shards = TarShards(folder, KEYS, **OPTIONS)
    it = iter(shards)
    old = [next(it)["__key__"] for _ in range(5)]
    shards.set_epoch(1)
    assert shards.state_dict() == {"epoch": 1, "yielded": 0, "ledger": None}
    old += _keys(it)  # the running one goes on in epoch 0's order, counted apart
    assert old == _keys(TarShards(folder, KEYS, **OPTIONS))
    assert shards.state_dict() == {"epoch": 1, "yielded": 0, "ledger": None}
    assert shards.ledger_stats() is None
    it = iter(shards)
    next(it)
    shards.load_state_dict({"epoch": 1, "yielded": 0, "ledger": None})
    next(it)
    assert shards.state_dict()["yielded"] == 0
    it.close()


def _key_list(samples: list[dict[str, Any]]) -> list[str]:
    return [str(s["__key__"]) for s in samples]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_resumes_each_workers_shards_with_its_ledger(
    folder: Path, workers: int
) -> None:
    def loader() -> DataLoader[Any]:
        shards = TarShards(folder, KEYS, **OPTIONS)
        shards.set_epoch(1)
        return DataLoader(shards, batch_size=3, num_workers=workers, collate_fn=_key_list)

    whole = [k for batch in loader() for k in batch]
    assert sorted(whole) == EVERY
    first, got = loader(), []
    for batch in first:
        got += batch
        if len(got) == 15:
            break
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    saved = state["dataset_state"]
    assert len(saved) == max(1, workers)
    assert all(len(pickle.dumps(part)) < 300 for part in saved)  # sent with every batch
    for part in saved:  # each worker's ledger holds what its own stream handed out
        ledger = Ledger("saved")
        ledger.load_state_dict(part["ledger"])
        assert ledger.stats().delivered == part["yielded"]
    assert sum(part["yielded"] for part in saved) == len(got)
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [k for batch in resumed for k in batch]
    resumed.close()
    assert got + rest == whole  # each sample once, in the uninterrupted order
    no_children_left()
    assert zombies() == []


def test_a_dataloader_worker_refuses_its_moved_position(folder: Path) -> None:
    shards = TarShards(folder, KEYS, **OPTIONS)
    loader = DataLoader(shards, batch_size=3, num_workers=2, collate_fn=_key_list)
    for k, _ in enumerate(loader):
        if k == 3:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    state["dataset_state"][1]["yielded"] += 3  # worker 1 would lose a batch
    resumed = DataLoader(
        TarShards(folder, KEYS, **OPTIONS), batch_size=3, num_workers=2, collate_fn=_key_list
    )
    resumed.load_state_dict(state)
    with pytest.raises(LedgerError, match=r"DataLoader worker 1 of 2.*3 sample\(s\) passed over"):
        list(resumed)
    resumed.close()
    no_children_left()
    assert zombies() == []


def test_a_damaged_shard_raises_naming_it(folder: Path, tmp_path: Path) -> None:
    for key in KEYS:
        (tmp_path / key).write_bytes((folder / key).read_bytes())
    broken = bytearray((folder / KEYS[2]).read_bytes())
    broken[700] ^= 0xFF  # in the second member's header
    (tmp_path / KEYS[2]).write_bytes(bytes(broken[:3000]))
    with pytest.raises(ValueError, match=r"shard-2\.tar: .*offset"):
        list(TarShards(tmp_path, KEYS))
    assert _shard_threads() == []


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_read_ahead_reads_that_many_shards_past_the_one_walked(folder: Path, ahead: int) -> None:
    tars = TarShards(folder, KEYS, read_ahead=ahead)
    begun: list[int] = []
    read = tars.shards.read

    def counted(index: int) -> Any:
        begun.append(index)
        return read(index)

    tars.shards.read = counted  # type: ignore[method-assign]
    it = iter(tars)
    next(it)  # shard 0's first sample: the reads ahead have been asked for
    time.sleep(0.2)
    assert sorted(begun) == list(range(1 + ahead))
    assert _keys(it) == EVERY[1:]


def test_leaving_the_loop_waits_for_no_shard_read_under_way(folder: Path) -> None:
    # A read ahead on a stalled store (until its timeout, minutes with retries) neither
    # holds up a break nor an error in the loop body, nor the process's exit.
    tars = TarShards(folder, KEYS, read_ahead=2)
    read, release = tars.shards.read, threading.Event()

    def stalls(index: int) -> Any:
        if index > 0:
            release.wait(30)
        return read(index)

    tars.shards.read = stalls  # type: ignore[method-assign]
    began = time.monotonic()
    for _ in tars:
        break
    with pytest.raises(KeyError), contextlib.suppress(ZeroDivisionError):
        for _ in tars:
            raise KeyError("in the loop body")
    assert time.monotonic() - began < 2
    release.set()
    assert _shard_threads() == []


def _with_damaged(folder: Path, tmp_path: Path, shard: int, at: int) -> Path:
    # A copy of the shards where the header of ``shard``'s sample ``at`` fails its checksum:
    # the shard gives the samples before it but the last (whose fields might go on).
    for key in KEYS:
        (tmp_path / key).write_bytes((folder / key).read_bytes())
    data = bytearray((folder / KEYS[shard]).read_bytes())
    header = 2 * at * 1024  # each sample: two members of a header block and a data block
    assert data[header : header + 1] == b"s"  # a member's name begins there
    data[header + 3] ^= 0xFF
    (tmp_path / KEYS[shard]).write_bytes(bytes(data))
    return tmp_path


def test_a_damaged_shard_is_skipped_within_max_failures_keeping_its_samples_before(
    folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = _with_damaged(folder, tmp_path, shard=2, at=4)
    lost = [k for k in EVERY if k.startswith("s2/")][3:]
    with caplog.at_level("WARNING", logger="feedline.source"):
        shards = TarShards(root, KEYS, max_failures=1)
        assert _keys(shards) == [k for k in EVERY if k not in lost]
    (record,) = caplog.records
    assert "skipped shard 'shard-2.tar' after 3 sample(s) (1 skipped of max_failures=1)" in (
        record.getMessage()
    )
    assert "checksum" in record.getMessage()
    assert shards.state_dict()["skipped"] == {KEYS[2]: 3}
    _exactly_once(shards.ledger_stats(), len(EVERY) - len(lost))
    # The default, 0, raises at the first; a budget spent raises the next and says so.
    with pytest.raises(ValueError, match=r"shard-2\.tar: .*checksum") as raised:
        list(TarShards(root, KEYS))
    assert not getattr(raised.value, "__notes__", None)
    broken = bytearray((root / KEYS[4]).read_bytes()[:1500])
    (root / KEYS[4]).write_bytes(bytes(broken))  # ends inside a member
    with pytest.raises(ValueError, match=r"shard-4\.tar") as raised:
        list(TarShards(root, KEYS, max_failures=1))
    assert "2 shards failed in this pass, over max_failures=1" in raised.value.__notes__[0]
    assert len(_keys(TarShards(root, KEYS, max_failures=None))) == len(EVERY) - 4 - PER_SHARD
    assert _shard_threads() == []


def test_a_skipped_shard_is_skipped_again_on_resume_though_the_store_answers_now(
    folder: Path,
) -> None:
    # A shard the store failed to read (its retries spent) is skipped; the resumed pass
    # skips it too, so the position means the same samples and nothing comes twice.
    def shards(store: Any) -> TarShards:
        tars = TarShards(store, KEYS, max_failures=2, **OPTIONS)
        tars.set_epoch(1)
        return tars

    store = RemoteStore(folder.as_uri())
    flaky = _FailsOnce(store, shards(store).my_shards()[1])
    first = shards(flaky)
    got = _take(first, 20)
    state = _saved(first)
    assert state["skipped"] == {flaky.key: 0}
    resumed = shards(store)  # the shard reads now
    resumed.load_state_dict(state)
    rest = _keys(resumed)
    unread = f"s{KEYS.index(flaky.key)}/"
    assert sorted(got + rest) == sorted(k for k in EVERY if not k.startswith(unread))
    _exactly_once(resumed.ledger_stats(), len(EVERY) - PER_SHARD)
    assert resumed.state_dict()["skipped"] == {flaky.key: 0}
    # Not a budget of its own: the resumed pass has one failure left of its two.
    assert resumed.max_failures == 2


def test_a_shard_damaged_part_way_resumes_to_the_same_cut(folder: Path, tmp_path: Path) -> None:
    walked_first = TarShards(folder, KEYS, **OPTIONS).my_shards()[0]
    root = _with_damaged(folder, tmp_path, shard=KEYS.index(walked_first), at=6)
    whole = _keys(TarShards(root, KEYS, max_failures=1, **OPTIONS))
    first = TarShards(root, KEYS, max_failures=1, **OPTIONS)
    got = _take(first, 12)
    state = _saved(first)
    assert state["skipped"] == {walked_first: 5}
    resumed = TarShards(root, KEYS, max_failures=1, **OPTIONS)
    resumed.load_state_dict(state)
    assert got + _keys(resumed) == whole
    # A failure met anew while a resumed pass re-reads what was handed out raises, whatever
    # the budget: skipping it would change what the position means.
    store = RemoteStore(folder.as_uri())
    early = TarShards(folder, KEYS, max_failures=5, **OPTIONS)
    early.set_epoch(1)
    _take(early, HANDED_OUT)
    state = _saved(early)
    again = TarShards(_FailsOnce(store, early.my_shards()[2]), KEYS, max_failures=5, **OPTIONS)
    again.load_state_dict(state)
    with pytest.raises(OSError, match="connection dropped") as raised:
        next(iter(again))
    assert "skipping it now would repeat or lose samples" in raised.value.__notes__[0]
    assert _saved(again) == state


def test_a_pass_whose_every_shard_fails_raises_whatever_the_budget(folder: Path) -> None:
    class Down:
        def read_sync(self, key: str) -> Any:
            raise OSError(f"{key}: the store refused the credentials")

    with pytest.raises(OSError, match="refused the credentials") as raised:
        list(TarShards(Down(), KEYS, max_failures=None))
    assert f"every shard of this pass ({len(KEYS)}) failed" in raised.value.__notes__[0]
    assert _shard_threads() == []


def test_max_failures_and_a_saved_skip_list_are_checked(folder: Path) -> None:
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigurationError, match="max_failures must be an int >= 0"):
            TarShards(folder, KEYS, max_failures=bad)  # type: ignore[arg-type]
    shards = TarShards(folder, KEYS)
    for skipped in ([KEYS[0]], {KEYS[0]: -1}, {KEYS[0]: "3"}):
        with pytest.raises(ValueError, match="'skipped' must map shard keys to ints"):
            shards.load_state_dict({"epoch": 0, "yielded": 0, "skipped": skipped})


def test_a_dataloader_worker_skips_a_damaged_shard_and_resumes_past_it(
    folder: Path, tmp_path: Path
) -> None:
    root = _with_damaged(folder, tmp_path, shard=3, at=3)

    def loader() -> DataLoader[Any]:
        tars = TarShards(root, KEYS, max_failures=1, **OPTIONS)
        return DataLoader(tars, batch_size=3, num_workers=2, collate_fn=_key_list)

    whole = [k for batch in loader() for k in batch]
    assert sorted(whole) == sorted(k for k in EVERY if not k.startswith("s3/") or k < "s3/00023")
    first, got = loader(), []
    for batch in first:
        got += batch
        if len(got) >= 18:
            break
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [k for batch in resumed for k in batch]
    resumed.close()
    assert sorted(got + rest) == sorted(whole)
    no_children_left()
    assert zombies() == []
