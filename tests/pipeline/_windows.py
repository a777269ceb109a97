"""Windows of figures given by hand to :func:`feedline.pipeline._decide.decide`, and models of
ops that make them.

A real run measures its windows on the machine it runs on (a loaded machine measures other
figures, and rightly decides otherwise); here they are given, so that a test asserts what the
tuner decides from them. :class:`Play` threads the state from window to window and applies
the decisions to the stages' concurrency, as the tuner does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from feedline.pipeline._decide import Memory, Sample, StageSample, State, decide

PerStage = float | tuple[float, ...]


@dataclass(frozen=True)
class W:
    """One window: its length, items out a second, the cores the process kept busy, and each
    stage's call time (``task``, 0: none ended), share of its slots busy and of the window
    its output was full (one figure for every stage, or one per stage)."""

    rate: float
    cores: float = 0.5
    task: PerStage = 0.004
    busy: PerStage = 1.0
    blocked: PerStage = 0.0
    sink_full: float = 0.0
    seconds: float = 0.3
    first: bool = False
    ended: bool = False
    room: int | None = None
    cpu: PerStage = 0.0  # cores each stage's calls on threads kept busy
    idle: float | None = None  # cores the whole machine left idle (None: not known)


def _each(value: PerStage, n: int) -> list[float]:
    return [float(value)] * n if isinstance(value, int | float) else [float(v) for v in value]


class Play:
    """Tuned stages in a row (2 cores of CPU budget) fed windows by hand.

    Args:
        start: Each stage's concurrency to begin with.
        names: The stages' names.
        high: Each stage's upper bound (one for all, or one per stage); the lower is 1.
        memory: What the tuner knows of the first stage to begin with.
        movable: The first stage may move to worker processes (``executor="auto"``); it
            moves when decided (``moves=False``: its workers do not take the op).

    """

    def __init__(
        self,
        start: Sequence[int] = (4,),
        names: Sequence[str] = ("s",),
        high: int | Sequence[int] = 8,
        memory: Memory | None = None,
        movable: bool = False,
        moves: bool = True,
    ) -> None:
        self.names = list(names)
        self.concurrency = list(start)
        self.movable, self.moves = movable, moves
        self.processes = [0] * len(start)
        self.cpu_budget = 2.0
        self.high = [high] * len(start) if isinstance(high, int) else list(high)
        self.state = State.start(len(start))
        if memory is not None:
            self.state = replace(self.state, memory=(memory, *self.state.memory[1:]))
        self.t = 0.0
        self.log: list[str] = []

    def window(self, w: W) -> str:
        """Decide on one window; returns its decisions as ``"s raise 8; s keep 8"``."""
        n = len(self.names)
        tasks, busies, blocked = _each(w.task, n), _each(w.busy, n), _each(w.blocked, n)
        cpus, procs = _each(w.cpu, n), self.processes
        self.t += w.seconds
        stages = tuple(
            StageSample(
                self.names[i],
                self.concurrency[i],
                busy=busies[i],
                task=tasks[i],
                blocked=blocked[i],
                low=self.concurrency[i] if procs[i] else 1,
                high=self.concurrency[i] if procs[i] else self.high[i],
                room=w.room,
                cpu=cpus[i],
                movable=i == 0 and self.movable and not procs[i],
                processes=procs[i],
            )
            for i in range(n)
        )
        sample = Sample(
            stages,
            rate=w.rate,
            cores=w.cores,
            cpu_budget=self.cpu_budget,
            idle=w.idle,
            t=self.t,
            sink_full=w.sink_full,
            first=w.first,
            ended=w.ended,
        )
        self.state, decisions = decide(self.state, sample)
        for d in decisions:
            self.concurrency[d.stage] = d.to
            if d.action == "move" and self.moves:
                self.processes[d.stage] = d.processes
            elif d.action == "back":
                self.processes[d.stage] = 0
            self.log.append(f"{self.names[d.stage]}: {d.why}")
        return "; ".join(f"{self.names[d.stage]} {d.action} {d.to}" for d in decisions)

    def memory(self, stage: int = 0) -> Memory:
        """What the tuner knows of a stage now."""
        return self.state.memory[stage]

    def of(self, name: str) -> int:
        """Stage ``name``'s concurrency now."""
        return self.concurrency[self.names.index(name)]

    def run(self, model: Model, windows: int) -> list[int]:
        """``windows`` windows of 0.3 s (after the run's first, of 0.1 s) of what ``model``
        says one stage does at its concurrency then; returns the concurrency of each."""
        seen = []
        for k in range(windows + 1):
            c = self.concurrency[0]
            seen.append(c)
            rate, cores, task = model(c)
            self.window(W(rate, cores, task, seconds=0.1 if k == 0 else 0.3, first=k == 0))
        return seen

    def run_row(
        self, stages: list[Callable[[int], tuple[float, float]]], windows: int
    ) -> list[tuple[int, ...]]:
        """``windows`` windows of stages in a row, each ``stages[i](c) -> (calls it can end a
        second, seconds a call)`` at its concurrency ``c``: the output goes at the slowest's
        pace, the others' slots busy that share of the time, the cores idle (the calls wait).
        Returns the stages' concurrency in each window."""
        seen = []
        for k in range(windows + 1):
            seen.append(tuple(self.concurrency))
            capacity, task = zip(
                *(f(c) for f, c in zip(stages, self.concurrency, strict=True)), strict=True
            )
            rate = min(capacity)
            busy = tuple(min(1.0, rate / c) for c in capacity)
            self.window(W(rate, 0.1, task, busy, seconds=0.1 if k == 0 else 0.3, first=k == 0))
        return seen

    @property
    def decisions(self) -> str:
        """Every decision's text so far, one a line."""
        return "\n".join(self.log)


Model = Callable[[int], tuple[float, float, float]]
"""What one stage does at a concurrency: ``(items out a second, cores busy, seconds a call)``."""


def server(k: int, latency: float) -> Model:
    """Calls to a server that serves ``k`` at once, each ``latency`` s: the calls beyond
    ``k`` wait their turn (longer calls, no more items), and the cores stay idle."""
    return lambda c: (min(c, k) / latency, 0.05, latency * max(1.0, c / k))


def holds_the_gil(seconds: float) -> Model:
    """Calls of ``seconds`` on a core each that hold the GIL: one runs at a time, so more of
    them at once only take longer each; the process keeps one core busy."""
    return lambda c: (1 / seconds, 1.0, c * seconds)


def computes(seconds: float, cores: int = 2) -> Model:
    """Calls of ``seconds`` on a core each, without the GIL (an op that releases it, or Python
    code on free-threaded Python): up to ``cores`` run at once (nearly every core busy then);
    the calls beyond them queue for a core."""
    return lambda c: (
        min(c, cores) / seconds,
        0.98 * min(c, cores),
        seconds * max(1.0, c / cores),
    )


def waits(seconds: float) -> Callable[[int], tuple[float, float]]:
    """For :meth:`Play.run_row`: calls that wait ``seconds`` each, however many at once."""
    return lambda c: (c / seconds, seconds)


def gate(k: int, seconds: float) -> Callable[[int], tuple[float, float]]:
    """For :meth:`Play.run_row`: a server that serves ``k`` calls of ``seconds`` at once."""
    model = server(k, seconds)
    return lambda c: (model(c)[0], model(c)[2])
