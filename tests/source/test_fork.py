"""A store or a cache in a forked process: it works there, or says at once why it cannot.

obstore's runtime threads start with a process's first request; a child forked after that has
none, and an obstore request there would wait forever. The pytest process has made requests,
so its forked children show the error; a scenario that needs a parent that never made one
runs in a fresh interpreter (``_forking.py``). The S3 and HTTP servers run in this process,
and every process reaches them over loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, ClassVar

import pytest

from feedline import RemoteStore
from feedline.source import ObjectCache

from .._system import starts_processes
from ._forking import digest, in_fork
from ._http import Handler, serving
from ._s3 import BUCKET, CREDENTIALS, _body

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

FORKING = Path(__file__).with_name("_forking.py")


def _options(endpoint: str) -> dict[str, Any]:
    return {"endpoint": endpoint, **CREDENTIALS}


def _scenario(scenario: str, seconds: float = 45, **spec: Any) -> dict[str, Any]:
    # Plays a scenario of _forking.py in a fresh interpreter; its outcome as a dict. In a
    # session of its own, so that a scenario that hangs is killed with the processes it
    # started (which would keep the pipes open).
    command = [sys.executable, str(FORKING), json.dumps({"scenario": scenario, **spec})]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            out, err = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"the {scenario!r} scenario still ran after {seconds} s: {err[-3000:]}")
    assert process.returncode == 0, err[-3000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_a_fork_after_a_request_raises_at_once_and_says_what_to_do(s3: str) -> None:
    store = RemoteStore(f"s3://{BUCKET}/data", **_options(s3))
    assert bytes(store.read_sync("1")) == _body(1)  # obstore's runtime runs in this process

    calls = {
        "read_sync": lambda: store.read_sync("2"),
        "read": lambda: asyncio.run(store.read("2")),
        "keys": lambda: store.keys(),
        # A store built in the child has the same runtime, whose threads are gone.
        "a new store": lambda: RemoteStore(f"s3://{BUCKET}/data", **_options(s3)).read_sync("2"),
    }
    for name, call in calls.items():
        outcome = in_fork(call)  # returns once the child has exited and been reaped
        assert os.WIFEXITED(outcome["status"]), (name, outcome)  # not killed by its alarm
        assert os.WEXITSTATUS(outcome["status"]) == 0
        assert outcome.get("type") == "ConfigurationError", (name, outcome)
        assert outcome["seconds"] < 1.0
        message = outcome["error"]
        assert f"forked (directly or not) from process {os.getpid()}" in message
        assert "'spawn' or 'forkserver'" in message
        assert "multiprocessing_context='forkserver'" in message
    assert bytes(store.read_sync("3")) == _body(3)  # the parent reads on


def test_a_fork_of_a_process_that_only_built_a_store_reads(s3: str) -> None:
    outcome = _scenario("construct", url=f"s3://{BUCKET}/data", options=_options(s3), key="3")
    assert outcome["status"] == 0
    assert outcome["ok"] == {"sync": digest(_body(3)), "async": digest(_body(3)), "keys": 40}
    assert outcome["parent"] == digest(_body(3))


def _read_remote(store: RemoteStore, key: str) -> str:
    return digest(store.read_sync(key))


@starts_processes
def test_a_store_pickled_to_a_forkserver_process_reads_there(s3: str) -> None:
    store = RemoteStore(f"s3://{BUCKET}/data", **_options(s3))
    assert bytes(store.read_sync("4")) == _body(4)  # this process runs obstore: no fork
    with ProcessPoolExecutor(1, mp_context=get_context("forkserver")) as pool:
        assert pool.submit(_read_remote, store, "5").result(timeout=150) == digest(_body(5))


class _AllAtOnce(Handler):
    """``/slow-<i>``: held until ``parties`` requests are in at once (else HTTP 500)."""

    parties: ClassVar[int] = 3
    barrier: ClassVar[threading.Barrier] = threading.Barrier(3)

    def do_GET(self) -> None:
        try:
            self.barrier.wait(timeout=15)
        except threading.BrokenBarrierError:
            self.reply(500, b"fewer requests at once than expected")
            return
        self.reply(200, self.path.encode())


def test_a_fork_rebuilds_the_locks_and_limits_the_parents_reads_held() -> None:
    _AllAtOnce.barrier = threading.Barrier(3)
    with serving(_AllAtOnce, before_stop=_AllAtOnce.barrier.abort) as url:
        options = {"max_in_flight": 3, "retries": 0, "timeout": 20}
        outcome = _scenario("held", url=url, options=options)
    assert outcome["status"] == 0, outcome  # not killed by its alarm: nothing stayed held
    assert outcome["ok"] == ["/slow-0", "/slow-1", "/slow-2"]  # 3 requests in flight at once


def test_a_cache_in_a_fork_whose_parent_held_its_lock(tmp_path: Path) -> None:
    cache = ObjectCache(1 << 20, directory=tmp_path)
    cache.put("a", b"kept on disk")
    assert cache.get("a") == b"kept on disk"
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # as a thread of the parent in the middle of a put at the fork
        with cache._lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:

        def child() -> dict[str, Any]:
            found = cache.get("a")  # from disk: the memory tier starts empty
            cache.put("b", b"written by the child")
            kept = cache.peek("b")
            stats = cache.stats()
            return {
                "a": None if found is None else found.decode(),
                "b": None if kept is None else kept.decode(),
                "hits": [stats.memory_hits, stats.disk_hits],
            }

        outcome = in_fork(child)
    finally:
        release.set()
        holder.join()
    assert outcome["status"] == 0, outcome  # not killed by its alarm: the lock was rebuilt
    # The child starts as a pickled copy does: the memory tier empty, the files found.
    assert outcome["ok"] == {"a": "kept on disk", "b": "written by the child", "hits": [1, 1]}
    assert cache.get("b") == b"written by the child"  # the directory is shared
    assert cache.stats().memory_hits == 1  # the parent's books are its own
