from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from collections.abc import Iterator

import pytest

# A shell without job control starts background commands (``./run test &``, nohup) with
# Ctrl-C ignored, and children inherit that: the tests of what Ctrl-C does need Python's
# handler back, in this process and in the processes they start.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The fork server of a test run imports torch once, with what the workers of feedline's
# DataLoader and the ranks of the distributed tests import: every process forked from it then
# starts in a fraction of a second, where importing torch took each 3 s of CPU. feedline's
# DataLoader asks the same of a fork server it is the first to start
# (feedline.loader._workers._PRELOAD); here it holds whichever test starts the server first
# (PyTorch's DataLoader, a pipeline's processes). The server skips a module not installed.
multiprocessing.set_forkserver_preload(
    ["__main__", "feedline.loader._workers", "torch", "torch.distributed", "numpy.random"]
)


def _live_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    """Every test must leave no thread behind (a short grace period covers thread exit)."""
    before = _live_threads()
    yield
    deadline = time.monotonic() + 2.0
    while True:
        leaked = {t for t in _live_threads() - before if not t.name.startswith("QueueFeederThread")}
        leaked = {t for t in leaked if "pydevd" not in t.name}

        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not leaked, f"threads left running: {sorted(t.name for t in leaked)}"
