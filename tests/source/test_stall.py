"""A store that never answers: the stall watchdog names the requests waiting on it."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from feedline import DataLoader, RemoteReadError, RemoteStore
from feedline.source import TarShards

from ._http import Handler, serving

pytest.importorskip("obstore")
pytestmark = pytest.mark.timeout(120)


def _silent(gate: threading.Event) -> type[Handler]:
    class Silent(Handler):
        def do_GET(self) -> None:
            gate.wait(60)  # answers nothing until the test lets go, then fails the request
            self.reply(503, b"gone")

        do_HEAD = do_GET

    return Silent


def _release_once_reported(caplog: pytest.LogCaptureFixture, gate: threading.Event) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(r.name == "feedline.watchdog" for r in caplog.records):
            break
        time.sleep(0.02)
    gate.set()


class _Reads:
    def __init__(self, store: RemoteStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> bytes:
        return bytes(self.store.read_sync(f"item-{i}"))


def test_a_store_that_never_answers_is_named_with_its_oldest_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="feedline.watchdog")
    gate = threading.Event()
    with serving(_silent(gate), before_stop=gate.set) as url:
        store = RemoteStore(url + "/data", retries=0, timeout=60)
        loader = DataLoader(_Reads(store), batch_size=4, report_stall_after=0.5)
        releaser = threading.Thread(target=_release_once_reported, args=(caplog, gate))
        releaser.start()
        with pytest.raises(RemoteReadError):
            list(loader)
        releaser.join()
    (report,) = [r.getMessage() for r in caplog.records if r.name == "feedline.watchdog"]
    assert "request(s) waiting on the store, the oldest for" in report
    assert "key 'item-" in report
    assert "__getitem__(i=" in report  # the calls that wait, and for which index


def test_tar_shards_waiting_on_a_shard_say_which(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="feedline.watchdog")
    gate = threading.Event()
    with serving(_silent(gate), before_stop=gate.set) as url:
        store = RemoteStore(url + "/shards", retries=0, timeout=60)
        shards = TarShards(store, ["a.tar", "b.tar"], report_stall_after=0.5)
        releaser = threading.Thread(target=_release_once_reported, args=(caplog, gate))
        releaser.start()
        with pytest.raises(RemoteReadError):
            list(shards)
        releaser.join()
    (report,) = [r.getMessage() for r in caplog.records if r.name == "feedline.watchdog"]
    assert report.startswith("TarShards(2 shards")
    assert "reading shard 'a.tar'" in report
    assert "key 'a.tar'" in report
