"""Where the calls of a stage built with ``executor="auto"`` run: threads, or worker processes.

Such a stage is a threaded stage like any other, whose work is a :class:`PlacedWork`. On
threads the :class:`Placement` calls the user's function and adds up the CPU time the calls
took (the tuner reads it: calls that keep a core busy and gain nothing from more threads hold
the GIL). When the tuner moves the stage, it first starts a process region
(:class:`RegionPool`) and sends it a probe that only unpickles the op there; once the probe
answers, each job of the stage takes a chunk of the items waiting (as many as make about
:data:`CHUNK_SECONDS` of calls, :data:`MAX_CHUNK` at most), sends them to a worker in one
message and waits for their results, on the pool thread that would have run them: one
hand-off per chunk, not per item. An item whose call raises fails alone. No item is moved:
calls under way finish where they started, and a stage moved back to threads retires its
region, which is closed once its calls have ended.

A stage that cannot move stays on threads, and says why (:attr:`Placement.stays`): an op that
does not pickle, a generator, task hooks (they run in this process), free-threaded Python
(threads run Python code side by side there).
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from feedline._proc.pipe_pool import rebuilt
from feedline.errors import portable

from ._region import RegionPool, RunOfStages
from ._settings import CHUNK_SECONDS, MAX_CHUNK, PICKLE_LIMIT, PROBE_LIMIT

__all__ = [
    "Failed",
    "PlacedWork",
    "Placement",
    "cannot_move",
    "raised",
]


def cannot_move(op: Callable[..., Any]) -> str | None:
    """Why ``op`` cannot run in worker processes, or ``None`` if it can."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return "free-threaded Python runs Python code on threads side by side"
    try:
        pickle.Pickler(_Capped(), pickle.HIGHEST_PROTOCOL).dump(op)
    except _TooLarge:
        return (
            f"the op pickles to over {PICKLE_LIMIT >> 20} MiB, which would travel with every "
            "item (a bound method of a large object?)"
        )
    except Exception as error:  # what pickling a user's object raises is open-ended
        return (
            f"the op cannot be pickled ({type(error).__name__}: {error}); define it at "
            "module level, not as a lambda or a nested function"
        )
    return None


class _TooLarge(Exception):
    pass


class _Capped:
    # A file that takes PICKLE_LIMIT bytes, then stops the pickler (a large object's pickle
    # is not made in full to learn that it is too large).

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        if self.size > PICKLE_LIMIT:
            raise _TooLarge
        return len(data)


def _unpickled(_run: RunOfStages) -> bool:
    # The probe: the worker unpickled the op (importing its module) to get here.
    return True


class Failed:
    """An item whose call raised in a worker: ``portable(error)``, rebuilt in this process."""

    def __init__(self, sent: tuple[BaseException | None, str]) -> None:
        self.sent = sent

    def failed(self, stage: str) -> Exception:
        """The exception, as this process can raise it, naming the stage's region."""
        return raised(self, stage)


class _Each:
    # The op applied to each value of a chunk, in a worker: an error is its item's alone.

    def __init__(self, op: Callable[[Any], Any]) -> None:
        self.op = op

    def __call__(self, values: list[Any]) -> list[Any]:
        out = []
        for value in values:
            try:
                out.append(self.op(value))
            except Exception as error:
                out.append(Failed(portable(error)))
        return out


class Placement:
    """The op of an ``executor="auto"`` stage, called on pool threads; see the module docstring.

    Args:
        op: The user's function, applied to an item's value.
        name: The stage's name, for the workers and errors.
        stays: Why the stage cannot move (``None``: it can).

    """

    def __init__(
        self,
        op: Callable[[Any], Any],
        name: str,
        stays: str | None = None,
    ) -> None:
        self.op = op
        self.name = name
        self.stays = stays
        self._run = RunOfStages([_Each(op)], name)
        self.takes = 1  # items a job sends at once: more than one in processes
        # unlocked: set by the tuner's thread (the event loop), read by each call; a call that
        # read the old value runs where it was sent (a retired region is closed once idle; a
        # call sent to it as it closes runs on its thread).
        self._region: RegionPool | None = None
        self._held = False  # closed by a stop (close(hold=True)) until reopen()
        self._probe: tuple[RegionPool, list[Future[Any]], float] | None = None  # a move under way
        self._retired: list[RegionPool] = []  # regions moved away from, closed when idle
        # CPU seconds and count of the calls run on threads, per thread (each key is written
        # by its own thread only, so no update is lost on free-threaded Python either).
        self._cpu: dict[int, tuple[float, int]] = {}
        # The tuner's moves back, kept across epochs (each run's tuner starts from them):
        # how many, and the ``perf_counter()`` before which no move is tried again.
        self.backs = 0
        self.retry_at = 0.0

    @property
    def processes(self) -> int:
        """Worker processes the calls go to now (0: threads)."""
        region = self._region
        return region.processes if region is not None else 0

    @property
    def moving(self) -> bool:
        """Whether a move to processes waits for its probe."""
        return self._probe is not None

    @property
    def broken(self) -> bool:
        """Whether the workers died as they started (see :attr:`RegionPool.broken`)."""
        region = self._region
        return region is not None and region.broken

    def cpu_seconds(self) -> float:
        """CPU seconds the calls on threads took so far."""
        return sum(cpu for cpu, _ in list(self._cpu.values()))

    def _chunk(self) -> int:
        # Items per message to a worker: CHUNK_SECONDS of calls as measured on threads.
        spent = list(self._cpu.values())
        cpu, calls = sum(c for c, _ in spent), sum(n for _, n in spent)
        if calls == 0 or cpu <= 0:
            return 1
        return max(1, min(MAX_CHUNK, round(CHUNK_SECONDS * calls / cpu)))

    def where(self) -> str:
        """Where the calls run, for ``StageStats.runs_in``."""
        n = self.processes
        if n:
            return f"processes ({n})"
        return "threads" if self.stays is None else f"threads (stays: {self.stays})"

    def __call__(self, value: Any) -> Any:
        """The op's result for ``value``, from a thread or a worker."""
        region = self._region
        if region is None:
            ident = threading.get_ident()
            t = time.thread_time()
            try:
                return self.op(value)
            finally:
                cpu, calls = self._cpu.get(ident, (0.0, 0))
                self._cpu[ident] = (cpu + time.thread_time() - t, calls + 1)
        (out,) = self.many([value])
        if isinstance(out, Failed):
            raise raised(out, self.name)
        return out

    def many(self, values: list[Any]) -> list[Any]:
        """The results for ``values``, from one message to a worker.

        A :class:`Failed` stands for each call that raised; a hand-off that fails raises.
        """
        region = self._region
        if region is not None:
            try:
                future = region.submit(self._run, values)
            except Exception as error:  # the items do not pickle, or the workers are gone
                self._stay(f"its items cannot be sent to processes ({_text(error)})")
            else:
                try:
                    return future.result()  # type: ignore[no-any-return]
                except CancelledError:
                    if self._held or region is self._region:
                        raise  # a stop: they fail (uncounted)
                    # sent to a region moved away from and closed as this call read it
                except BrokenProcessPool:
                    raise  # a worker that died running them: they fail
                except Exception as error:  # the results do not pickle (each op's is caught)
                    self._stay(f"its results cannot be sent back ({_text(error)})")
        # On threads (moved back meanwhile, or now: nothing is lost to a move).
        return [self._on_thread(value) for value in values]

    def _stay(self, why: str) -> None:
        # Back on threads for good (a pool thread's call: the tuner's next look closes the
        # region once its calls have ended, and judges the move as one that could not be).
        self.stays = why
        self.back()

    def _on_thread(self, value: Any) -> Any:
        try:
            return self(value)
        except Exception as error:
            return Failed((error, ""))

    # -- moves (the tuner's thread) --------------------------------------------------------------

    def move(self, processes: int) -> None:
        """Start ``processes`` workers and probe each; calls stay on threads until all answer."""
        if self.stays is not None or self._region is not None or self._probe is not None:
            return
        if self._held:  # a stop closed the stage's regions: no new workers until reopen()
            return
        region = RegionPool(processes, None, self.name)
        try:  # one probe for each worker (each goes to the worker with the fewest calls)
            probes = [region.submit(_unpickled, self._run) for _ in range(processes)]
        except Exception as error:  # the workers could not start
            region.close()
            self.stays = f"its workers did not start ({type(error).__name__}: {error})"
            return
        self._probe = (region, probes, time.monotonic())

    def poll(self) -> bool:
        """Finish a move whose probe answered; True while one still waits."""
        if self._probe is None:
            return False
        region, probes, t0 = self._probe
        if not all(probe.done() for probe in probes):
            if time.monotonic() - t0 < PROBE_LIMIT:
                return True
            error: BaseException | None = TimeoutError(f"no answer in {PROBE_LIMIT:g} s")
        else:
            error = next((e for p in probes if (e := p.exception()) is not None), None)
        self._probe = None
        if error is None:
            self.takes = self._chunk()
            self._region = region
        else:
            region.close()
            self.stays = f"its workers did not take the op ({type(error).__name__}: {error})"
        return False

    def back(self) -> None:
        """Send the next calls to threads; the region is closed once its calls have ended."""
        self.takes = 1
        region, self._region = self._region, None
        if region is not None:
            self._retired.append(region)
        probe, self._probe = self._probe, None
        if probe is not None:
            probe[0].close(hold=True)

    def tidy(self) -> None:
        """Close the retired regions that no call uses any more."""
        for region in [r for r in self._retired if r.idle]:
            region.close(hold=True)  # a call that read it as it retired goes to threads
            with contextlib.suppress(ValueError):  # a stop's close() took the list meanwhile
                self._retired.remove(region)

    def close(self, hold: bool = False) -> None:
        """End every worker process (calls under way fail) and any move under way.

        A stage in processes stays there: its next call starts new workers (with ``hold``,
        only after :meth:`reopen`; until then its calls fail as cancelled).
        """
        self._held = self._held or hold  # before the closes: a call they cancel sees it
        probe, self._probe = self._probe, None
        if probe is not None:  # held: a poll() under way may still make it the region
            probe[0].close(hold=True)
        retired, self._retired = self._retired, []
        for old in retired:
            old.close(hold=True)
        region = self._region
        if region is not None:
            region.close(hold)

    def reopen(self) -> None:
        """Let the next call start workers again after ``close(hold=True)``."""
        self._held = False
        region = self._region
        if region is not None:
            region.reopen()


class PlacedWork:
    """A threaded stage's work: a :class:`Placement` applied to ``Tagged`` items' values.

    One item at a time on threads, chunks in processes (:attr:`takes`).
    """

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    @property
    def takes(self) -> int:
        """Items a job takes at once: more than one while the stage runs in processes."""
        return self.placement.takes

    def __call__(self, item: Any) -> Any:
        item.value = self.placement(item.value)
        return item

    def many(self, items: list[Any]) -> list[Any]:
        """The result for each item, or a :class:`Failed` for each whose call raised."""
        outs = self.placement.many([item.value for item in items])
        for k, (item, out) in enumerate(zip(items, outs, strict=True)):
            if not isinstance(out, Failed):
                item.value, outs[k] = out, item
        return outs


def raised(failed: Failed, name: str) -> Exception:
    """The exception a :class:`Failed` stands for, as this process can raise it."""
    error, text = failed.sent
    if isinstance(error, Exception) and not text:  # raised on a thread of this process
        return error
    found = rebuilt(failed.sent, f"process region {name!r}", None)
    return found if isinstance(found, Exception) else RuntimeError(repr(found))


def _text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
