"""One listing per job: ``RemoteStore.keys`` keeps a prefix's keys as a manifest in the cache
directory, which later calls and other processes read instead of listing (a moto S3 server on
loopback counts the LIST requests)."""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from feedline import RemoteStore
from feedline.errors import ConfigurationError, RemoteReadError
from feedline.source import ObjectCache

from .._system import starts_processes
from ._http import Handler, serving
from ._s3 import CREDENTIALS, moto_bucket

KEYS = 1_100  # two pages of a listing (1,000 keys each)
BUCKET = "feedline-listing"


@pytest.fixture(scope="module")
def bucket() -> Iterator[tuple[str, dict[str, int]]]:
    """The endpoint of a bucket of ``KEYS`` objects under ``train/`` and 3 under ``val/``,
    and the server's counts of requests."""
    objects = {f"train/{i:05d}.{'jpg' if i % 2 else 'png'}": b"x" for i in range(KEYS)}
    objects.update({f"val/{i}.jpg": b"y" for i in range(3)})
    with moto_bucket(BUCKET, objects) as served:
        yield served


def _store(endpoint: str, directory: Path | None) -> RemoteStore:
    cache = None if directory is None else ObjectCache(1 << 20, directory=directory)
    return RemoteStore(f"s3://{BUCKET}", endpoint=endpoint, cache=cache, **CREDENTIALS)


def test_a_prefix_is_listed_once_and_then_read_from_its_manifest(
    bucket: tuple[str, dict[str, int]], tmp_path: Path
) -> None:
    endpoint, served = bucket
    before = served["LIST"]
    first = _store(endpoint, tmp_path)
    keys = list(first.keys("train"))
    assert keys == sorted(keys)
    assert len(keys) == KEYS
    assert served["LIST"] - before == 2  # two pages
    assert first.stats().listings == 1
    # Another store on the same directory (a worker process's copy, a later run): no request.
    second = _store(endpoint, tmp_path)
    assert list(second.keys("train")) == keys
    assert list(second.keys("train", suffix=".jpg")) == [k for k in keys if k.endswith(".jpg")]
    assert served["LIST"] - before == 2
    assert (second.stats().listings, second.stats().listings_reused) == (0, 2)
    # Each prefix has its own manifest.
    assert list(second.keys("val")) == ["val/0.jpg", "val/1.jpg", "val/2.jpg"]
    assert served["LIST"] - before == 3
    # The cache's own index leaves the manifests alone.
    assert ObjectCache(1 << 20, directory=tmp_path).stats().disk_bytes == 0


def test_a_manifest_is_listed_again_when_asked_too_old_or_damaged(
    bucket: tuple[str, dict[str, int]], tmp_path: Path
) -> None:
    endpoint, served = bucket
    store = _store(endpoint, tmp_path)
    keys = list(store.keys("val"))
    listed = served["LIST"]
    assert list(store.keys("val", refresh=True)) == keys
    assert served["LIST"] == listed + 1
    assert list(store.keys("val", max_age=0)) == keys  # older than no time at all
    assert served["LIST"] == listed + 2
    assert list(store.keys("val", max_age=None)) == keys  # any age serves
    assert served["LIST"] == listed + 2
    (manifest,) = tmp_path.glob("listing-*.keys")
    data = bytearray(manifest.read_bytes())
    data[-3] ^= 0xFF  # a damaged key: its checksum no longer matches
    manifest.write_bytes(bytes(data))
    assert list(store.keys("val")) == keys  # listed again, not read damaged
    assert served["LIST"] == listed + 3
    assert list(store.keys("val")) == keys  # and the manifest is whole again
    assert served["LIST"] == listed + 3
    with pytest.raises(ConfigurationError, match="max_age"):
        store.keys("val", max_age=-1)


def test_without_a_cache_directory_every_call_lists(
    bucket: tuple[str, dict[str, int]],
) -> None:
    endpoint, served = bucket
    store = _store(endpoint, None)
    listed = served["LIST"]
    for _ in range(2):
        assert len(store.keys("val")) == 3
    assert served["LIST"] == listed + 2
    assert store.stats().listings == 2


def _count_keys(endpoint: str, directory: str) -> int:
    return len(_store(endpoint, Path(directory)).keys("train"))


@starts_processes
def test_processes_that_ask_at_once_list_once(
    bucket: tuple[str, dict[str, int]], tmp_path: Path
) -> None:
    # Four processes sharing the directory, as the workers of a machine: the first lists,
    # the others wait for its manifest.
    endpoint, served = bucket
    listed = served["LIST"]
    context: Any = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        counts = pool.starmap(_count_keys, [(endpoint, str(tmp_path))] * 4)
    assert counts == [KEYS] * 4
    assert served["LIST"] - listed == 2  # one listing (two pages) for the four


class _CutListing(Handler):
    """An S3 listing of two keys whose first ``cuts`` answers stop half-way through the body."""

    cuts: ClassVar[int] = 1
    served: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.served.append(self.path)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazon'
            'aws.com/doc/2006-03-01/"><Name>b</Name><Prefix>p/</Prefix><KeyCount>2</KeyCount>'
            "<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
            + "".join(
                f"<Contents><Key>p/{i}.jpg</Key><LastModified>2024-01-01T00:00:00.000Z"
                f"</LastModified><Size>1</Size></Contents>"
                for i in range(2)
            )
            + "</ListBucketResult>"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if len(self.served) <= self.cuts:
            self.wfile.write(body[:100])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_WR)
            return
        self.wfile.write(body)


@pytest.mark.parametrize("cuts", [1, 5])
def test_a_listing_cut_mid_body_is_asked_again_within_the_retries(cuts: int) -> None:
    # obstore retries a page's request, not its body: feedline asks again, as for a read.
    _CutListing.cuts, _CutListing.served = cuts, []
    with serving(_CutListing) as url:
        store = RemoteStore("s3://b/p", endpoint=url, retries=2, backoff=0.01, **CREDENTIALS)
        if cuts <= 2:
            assert list(store.keys()) == ["0.jpg", "1.jpg"]
            assert len(_CutListing.served) == cuts + 1
        else:
            with pytest.raises(RemoteReadError, match=r"listing keys under ''.*retried up to 2"):
                store.keys()
            assert len(_CutListing.served) == 3  # the first, and two retries


def test_a_key_obstore_cannot_handle_is_named_with_what_to_do() -> None:
    objects = {"data/0.jpg": b"x", "data/dir//x.jpg": b"y"}  # S3 allows an empty segment
    with moto_bucket("feedline-odd", objects) as (endpoint, _):
        store = RemoteStore("s3://feedline-odd/data", endpoint=endpoint, **CREDENTIALS)
        with pytest.raises(RemoteReadError, match=r"data/dir//x\.jpg.*rename the object"):
            store.keys()
