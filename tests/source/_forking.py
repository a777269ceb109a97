"""Forked children for the fork tests, and the scenarios that need a process of their own.

:func:`in_fork` runs a function in a child made by ``os.fork`` and returns what it returned
or raised; a child that hangs is killed by its own alarm, so a regression fails rather than
hangs. Run as a script (``python _forking.py '<json>'``), this module plays a scenario in a
fresh interpreter, one that no test has made obstore requests in, and prints its outcome as
JSON: the pytest process has, and obstore cannot run in a child forked from it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

CHILD_SECONDS = 10  # a child still running after this is killed (SIGALRM)


def in_fork(work: Callable[[], Any]) -> dict[str, Any]:
    """Run ``work`` in a forked child: ``{"ok": result}`` or ``{"error": ..., "type": ...}``.

    Also ``"status"``, the child's exit status as ``os.waitpid`` gave it (the child is
    reaped here), and ``"seconds"``, how long ``work`` took in the child.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        try:
            os.close(read_end)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not the parent's handler
            signal.alarm(CHILD_SECONDS)
            start = time.monotonic()
            try:
                out: dict[str, Any] = {"ok": work()}
            except BaseException as error:
                out = {"error": str(error), "type": type(error).__name__}
            out["seconds"] = time.monotonic() - start
            data = json.dumps(out).encode()
            while data:
                data = data[os.write(write_end, data) :]
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    reaped, status = os.waitpid(pid, 0)
    assert reaped == pid
    return {"status": status, **(json.loads(data) if data else {})}


def digest(view: Any) -> str:
    """The MD5 of what a read returned, to compare in another process."""
    return hashlib.md5(bytes(view)).hexdigest()


def _construct_then_fork(spec: dict[str, Any]) -> dict[str, Any]:
    # A parent that built a store and made no request: its forked child reads.
    from feedline import RemoteStore

    store = RemoteStore(spec["url"], **spec["options"])
    key = spec["key"]

    def child() -> dict[str, Any]:
        return {
            "sync": digest(store.read_sync(key)),
            "async": digest(asyncio.run(store.read(key))),
            "keys": len(store.keys()),
        }

    outcome = in_fork(child)
    outcome["parent"] = digest(store.read_sync(key))  # and the parent still reads, after
    return outcome


def _held_then_fork(spec: dict[str, Any]) -> dict[str, Any]:
    # A parent whose threads hold the store's locks and all its room for requests at the fork,
    # as reads in flight do (each has room in the throttle, and takes the locks to count); none
    # has made a request, so obstore may run in the child. The child reads max_in_flight keys
    # at once, each held by the server until all of them have arrived.
    from feedline import RemoteStore

    store = RemoteStore(spec["url"], **spec["options"])
    n = store._max_in_flight
    release = threading.Event()

    def hold(what: Any) -> None:
        with what:
            holding.wait()
            release.wait()

    for _ in range(n):  # every request the store allows is in flight, as far as it knows
        store._throttle.take_sync()
    holding = threading.Barrier(3)
    holders = [
        threading.Thread(target=hold, args=(lock,)) for lock in (store._lock, store._throttle._lock)
    ]
    for thread in holders:
        thread.start()
    holding.wait()  # all the room, and both locks, are held now

    def child() -> list[str]:
        got: list[str] = [""] * n

        def read(i: int) -> None:
            got[i] = bytes(store.read_sync(f"slow-{i}")).decode()

        readers = [threading.Thread(target=read, args=(i,)) for i in range(n)]
        for thread in readers:
            thread.start()
        for thread in readers:
            thread.join()
        return got

    try:
        return in_fork(child)
    finally:
        release.set()
        for thread in holders:
            thread.join()


_SCENARIOS = {
    "construct": _construct_then_fork,
    "held": _held_then_fork,
}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(_SCENARIOS[spec["scenario"]](spec)))
