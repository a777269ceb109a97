r"""The stall watchdog: a consumer that waits with nothing coming is reported, once, in detail.

PyTorch's DataLoader waits for ever by default (``timeout=0``), and a job that stopped moving
says nothing: a dataset blocked on a lock, a worker stopped by a signal, a store that never
answers. feedline's consumers (a pipeline's ``for`` loop and ``get_item``, the DataLoader,
TarShards) each hold a :class:`StallWatch`, which the waits that serve them tick (a sleeping
wait wakes every :data:`TICK` seconds to do so; nothing is done while items arrive).
After ``after`` seconds without an item and without progress, it logs one warning on the
``feedline.watchdog`` logger, in a few lines:

- what is in flight (each stage's running calls and the source items they work on, reads
  waiting on a store: whatever the consumer and the registered :class:`Reporter`\\ s say);
- where every busy thread of this process stands (its innermost frames of user code), and
  each child process's state (a stopped one is named as such; a running one is asked to
  write its threads' stacks to its standard error, see :func:`dump_stacks_on_signal`).

Then it goes on waiting (unless the caller set a ``timeout``), and reports again only after
progress was made and stopped again. Nothing runs while nobody waits: no thread of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from feedline.errors import ConfigurationError

__all__ = [
    "STALL_AFTER",
    "TICK",
    "Reporter",
    "StallWatch",
    "check_after",
    "dump_stacks_on_signal",
    "register",
]

STALL_AFTER = 60.0
"""Seconds a consumer waits with no progress before the stall is reported (the default)."""

TICK = 1.0
"""The longest a waiting thread sleeps between two looks at its watch."""

_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
_FRAMES = 3  # innermost frames of user code shown per thread
_log = logging.getLogger("feedline.watchdog")


class Reporter(Protocol):
    """Anything that can say what it has in flight (a store's reads, a child process)."""

    def stall_report(self) -> list[str]:
        """Lines saying what is in flight now (empty when idle)."""
        ...


_reporters: weakref.WeakSet[Any] = weakref.WeakSet()
_reporters_lock = threading.Lock()


def register(reporter: Reporter) -> None:
    """Have ``reporter`` describe itself in every stall report (held weakly)."""
    with _reporters_lock:
        _reporters.add(reporter)


def check_after(value: Any, name: str = "report_stall_after") -> float | None:
    """Validate a ``report_stall_after=`` argument: seconds > 0, or ``None`` (never)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigurationError(
            f"{name} must be a number of seconds > 0 (how long a wait with no progress goes "
            f"before it is reported), or None to never report, got {value!r}"
        )
    return float(value)


class StallWatch:
    """Watches one consumer's waits.

    The waits that serve the consumer hold the watch and call :meth:`tick` while they wait
    (at least every :data:`TICK` seconds), saying when the wait began: nothing is done while
    items arrive.

    Args:
        name: Who waits, for the report (``"feedline.DataLoader"``).
        after: Seconds without an item and without progress before reporting (``None``:
            never).
        describe: Lines saying what the consumer has in flight (its stages, its workers).
        progress: A number that grows while work gets done (items out of any stage): a
            wait during which it moves is not a stall.

    """

    def __init__(
        self,
        name: str,
        after: float | None = STALL_AFTER,
        describe: Callable[[], list[str]] | None = None,
        progress: Callable[[], int] | None = None,
    ) -> None:
        self.name = name
        self.after = after
        self.describe = describe
        self.progress = progress
        self._wait: float | None = None  # when the wait being watched began
        self._clock = 0.0  # since when nothing moved
        self._mark = 0
        self._reported = False
        self.reports = 0  # how many stalls were reported (for tests and statistics)

    def tick(self, since: float) -> None:
        """A wait that began at ``since`` (``time.monotonic()``) goes on: report it if stalled."""
        after = self.after
        if after is None:
            return
        if since != self._wait:  # a new wait
            self._wait, self._clock, self._reported = since, since, False
            self._mark = self._moved()
        if self._reported:
            return
        now = time.monotonic()
        if now - self._clock < after:
            return
        mark = self._moved()
        if mark != self._mark:  # work moved meanwhile: not stalled, watch from now
            self._clock, self._mark = now, mark
            return
        self._reported = True
        self.reports += 1
        self.report(now - since)

    def _moved(self) -> int:
        if self.progress is None:
            return 0
        try:
            return self.progress()
        except Exception:
            return 0

    def report(self, waited: float) -> None:
        """Log what is in flight and where every thread stands."""
        lines = [
            f"{self.name} has waited {waited:.0f} s with no progress (it goes on waiting; "
            "report_stall_after=None turns this report off). In flight:"
        ]
        details: list[str] = []
        if self.describe is not None:
            try:
                details += self.describe()
            except Exception as error:  # a report must not raise into the consumer
                details.append(f"(could not describe it: {error!r})")
        with _reporters_lock:
            reporters = list(_reporters)
        for reporter in reporters:
            with contextlib.suppress(Exception):
                details += reporter.stall_report()
        lines += [f"  {line}" for line in details or ["nothing that feedline can see"]]
        threads = busy_threads()
        if threads:
            lines.append("Threads at work (innermost frames first):")
            lines += [f"  {line}" for line in threads]
        _log.warning("\n".join(lines))


# -- where threads stand --------------------------------------------------------------------

_OWN = f"{os.sep}feedline{os.sep}"
_WAITS = tuple(
    f"{os.sep}{part}"
    for part in (
        "threading.py",
        "queue.py",
        "selectors.py",
        f"concurrent{os.sep}futures{os.sep}",
        f"asyncio{os.sep}",
        f"multiprocessing{os.sep}",
        # feedline's own pools wait for work here
        f"feedline{os.sep}pipeline{os.sep}_executors.py",
        f"feedline{os.sep}loader{os.sep}_pool.py",
    )
)


def _waits(filename: str) -> bool:
    # The standard library's ways of waiting for work: a thread there is idle.
    return any(part in filename for part in _WAITS)


def _user_frame(filename: str) -> bool:
    # Neither feedline's own code nor the standard library's waits.
    return _OWN not in filename and not _waits(filename)


def busy_threads() -> list[str]:
    """The threads of this process at work, each with where it stands.

    A thread is at work unless it waits in the standard library for work (a pool's idle
    thread); the calling thread (the consumer) is left out. Each is shown by its innermost
    frame and its innermost frames of user code, with the source item a stage's op works
    on, where the stack shows it.
    """
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    out: list[str] = []
    for ident, frame in sys._current_frames().items():
        if ident == me or frame is None:
            continue
        mine: list[str] = []
        source = ""
        walk: Any = frame
        while walk is not None:
            code = walk.f_code
            if walk is frame or (_user_frame(code.co_filename) and len(mine) <= _FRAMES):
                mine.append(f"{code.co_filename}:{walk.f_lineno} in {code.co_name}{_arg(walk)}")
            elif not source and code.co_name == "__call__" and "item" in code.co_varnames:
                source = _source_of(walk.f_locals.get("item"))
            walk = walk.f_back
        if _waits(frame.f_code.co_filename) and len(mine) == 1:
            continue  # waits for work, and no user code under it
        where = f" (on {source})" if source else ""
        out.append(f"thread {names.get(ident, ident)!r}{where}: " + " <- ".join(mine))
    return out


def _source_of(item: Any) -> str:
    from feedline.pipeline._resume import Tagged

    return item.source() if isinstance(item, Tagged) else ""


def _arg(frame: Any) -> str:
    # The item a __getitem__ (or an op called with one argument) works on, shortly.
    code = frame.f_code
    if code.co_argcount < 2 or code.co_name not in ("__getitem__", "__getitems__"):
        return ""
    from feedline.pipeline._resume import sample_repr

    name = code.co_varnames[1]
    return f"({name}={sample_repr(frame.f_locals.get(name))})"


# -- child processes ------------------------------------------------------------------------


def process_state(pid: int) -> str:
    """What the kernel says a process is doing: ``running``, ``stopped``, ``gone``..."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return "gone" if sys.platform.startswith("linux") else "unknown"
    state = text[text.rfind(")") + 2 :][:1]
    return {
        "R": "running",
        "S": "waiting",
        "D": "waiting on the disk (uninterruptible)",
        "T": f"stopped (SIGSTOP or a debugger: it cannot run until continued, kill -CONT {pid})",
        "t": "stopped by a debugger",
        "Z": "exited (a zombie)",
    }.get(state, f"in state {state!r}")


def describe_child(name: str, pid: int | None, ready: bool = True) -> str:
    """A child process's state, and a request for its stacks where it can answer.

    ``ready``: whether it said it runs (else it is starting: importing, unpickling).
    """
    if pid is None:
        return f"{name}: not started"
    state = process_state(pid)
    if not ready and state in ("running", "waiting"):
        state = f"starting ({state}: importing modules, unpickling what it was sent)"
    line = f"{name} (pid {pid}): {state}"
    signum = _STACK_SIGNAL
    if (
        signum is not None
        and state.startswith(("running", "waiting", "starting"))
        and _catches(pid)
    ):
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
            line += "; its threads' stacks follow on its standard error"
    return line


def _catches(pid: int) -> bool:
    # Whether the process handles the stack signal (SigCgt in /proc): one that does not yet
    # (still starting), or could not register it, would be killed by it.
    if _STACK_SIGNAL is None:
        return False
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(_STACK_SIGNAL) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def dump_stacks_on_signal() -> None:
    """In a child process: write every thread's stack to stderr on SIGUSR1 (for reports)."""
    if _STACK_SIGNAL is None:
        return
    import faulthandler

    with contextlib.suppress(Exception):  # no stderr to write to: nothing to do
        faulthandler.register(_STACK_SIGNAL, all_threads=True)
