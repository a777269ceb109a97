"""TarShards: samples of tar shards from a directory or S3, shuffled, split and resumed."""

from __future__ import annotations

import collections
import io
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("obstore")
torch = pytest.importorskip("torch")

from feedline import DataLoader, RemoteStore  # noqa: E402
from feedline.source import TarShards  # noqa: E402

from ._s3 import CREDENTIALS, moto_bucket  # noqa: E402

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
    return [t.name for t in threading.enumerate() if t.name.startswith("feedline-shard")]


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


@pytest.mark.parametrize("stop", [1, 9, 30])
def test_break_then_resume_hands_out_the_rest(folder: Path, stop: int) -> None:
    whole = _keys(TarShards(folder, KEYS, shuffle=8, seed=4))
    shards = TarShards(folder, KEYS, shuffle=8, seed=4)
    first = []
    for sample in shards:
        first.append(sample["__key__"])
        if len(first) == stop:
            break
    state = shards.state_dict()
    assert state == {"epoch": 0, "yielded": stop}
    resumed = TarShards(folder, KEYS, shuffle=8, seed=4)
    resumed.load_state_dict(state)
    assert first + _keys(resumed) == whole
    assert _shard_threads() == []  # the break closed the readers


def test_a_damaged_shard_raises_naming_it(folder: Path, tmp_path: Path) -> None:
    for key in KEYS:
        (tmp_path / key).write_bytes((folder / key).read_bytes())
    broken = bytearray((folder / KEYS[2]).read_bytes())
    broken[700] ^= 0xFF  # in the second member's header
    (tmp_path / KEYS[2]).write_bytes(bytes(broken[:3000]))
    with pytest.raises(ValueError, match=r"shard-2\.tar: .*offset"):
        list(TarShards(tmp_path, KEYS))
    assert _shard_threads() == []
