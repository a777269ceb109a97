from __future__ import annotations

import importlib.util
import multiprocessing
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator

import pytest

# Packages that free-threaded Python has no wheels of (`./run test-ft`) are missing there: each
# test module that needs one skips at its top (pytest.importorskip). --markdown-docs collects
# every module for the code in its docstrings, helpers too: those that import such a package
# at their top are left out where it is missing, as the tests that use them skip.
collect_ignore = [
    helper
    for helper, package in {
        "loader/_datasets.py": "torch",
        "loader/_reference.py": "torchdata",
    }.items()
    if importlib.util.find_spec(package) is None
]


def _missing_package(error: BaseException | None) -> str | None:
    """The package not installed that ``error`` (or what caused it) failed to import."""
    while error is not None:
        if isinstance(error, ModuleNotFoundError) and error.name:
            top = error.name.split(".")[0]
            if importlib.util.find_spec(top) is None:
                return top
        error = error.__cause__ or error.__context__
    return None


class _SkipBlocksMissingAPackage:
    """A README block that needs a package missing here (PyTorch on 3.13t) skips, naming it.

    The blocks are pytest-markdown-docs' items, which carry their source as ``code``; what a
    block needs shows only as it runs (``feedline.DataLoader`` imports PyTorch when made).
    A plugin, not a hook of this file: those apply to the items under tests/ only.
    """

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        try:
            return (yield)
        except ImportError as error:
            missing = _missing_package(error)
            if missing is None or not isinstance(getattr(item, "code", None), str):
                raise
            pytest.skip(f"needs {missing}, which is not installed")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_SkipBlocksMissingAPackage(), "feedline-readme-blocks")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On free-threaded Python, fail a run after which the GIL is on.

    CPython turns it on, with a RuntimeWarning, when a module is imported whose extension does
    not declare that it runs without it: the tests would then run with the GIL after all.
    """
    if sysconfig.get_config_var("Py_GIL_DISABLED") and sys._is_gil_enabled():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        why = "the GIL was turned on during the run: an extension module imported needs it"
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(why, red=True)
        else:
            print(why, file=sys.stderr)


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
