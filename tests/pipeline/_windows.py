"""A tuner fed windows of figures made up by hand, and models of ops that make them.

The tuner decides from what it measures in each window: items out, the cores the process
kept busy, each tuned stage's calls ended and slot time used. A real run measures those on
the machine it runs on (a loaded machine measures different figures, and rightly decides
differently); here they are given, so that a test asserts what the tuner decides from them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from feedline.pipeline._tuner import Knob, Tuner, _Mark
from feedline.pipeline._tuning import Tuning


class Counters:
    """What the tuner reads of a stage's counters, set by hand."""

    def __init__(self, concurrency: int) -> None:
        self.lock = threading.Lock()
        self.concurrency = concurrency
        self.busy_time = 0.0
        self.calls = 0
        self.ewma = 0.0

    def slots(self, t: float) -> float:
        return 0.0


class Stage:
    """A tuned stage as the tuner sees it: a name, counters, a concurrency to set."""

    def __init__(self, concurrency: int, name: str = "decode") -> None:
        self.name = name
        self.counters = Counters(concurrency)

    def set_concurrency(self, concurrency: int) -> None:
        self.counters.concurrency = concurrency


class FakeChannel:
    """A channel that never grows, never closes and is never full."""

    growth = None
    closed = False
    puts = 0

    def full_seconds(self) -> float:
        return 0.0


def _each(value: float | Sequence[float], n: int) -> list[float]:
    return [float(value)] * n if isinstance(value, int | float) else [float(v) for v in value]


class Windows:
    """A tuner over tuned stages in a row (2 cores of budget), fed windows by hand.

    Each window gives its length, the items out, the cores the process kept busy, and each
    stage's calls (each ``task`` seconds long, its slots busy a ``busy`` share of the time);
    ``task`` and ``busy`` are one figure for every stage, or one per stage.

    Args:
        concurrency: Each stage's concurrency to begin with (one int: one stage).
        names: The stages' names.
        high: Each stage's upper bound (the lower is 1).

    """

    def __init__(
        self,
        concurrency: int | Sequence[int] = 2,
        names: Sequence[str] = ("decode",),
        high: int = 8,
    ) -> None:
        start = [concurrency] if isinstance(concurrency, int) else list(concurrency)
        self.stages = [Stage(c, name) for c, name in zip(start, names, strict=True)]
        self.knobs = [Knob(stage, i + 1, 1, high) for i, stage in enumerate(self.stages)]
        self.stage, self.knob = self.stages[0], self.knobs[0]
        channels = [FakeChannel() for _ in range(len(self.stages) + 1)]
        self.tuner = Tuner(self.knobs, channels, Tuning(cpu_budget=2))  # type: ignore[arg-type]
        self.tuner.decisions = deque()  # all of them, not the last few that stats show
        n = len(self.stages)
        self.t = self.out = self.cpu = self.sink_full = 0.0
        self.busy, self.slots, self.calls = [0.0] * n, [0.0] * n, [0] * n

    def mark(self) -> _Mark:
        n = len(self.stages)
        return _Mark(
            self.t,
            int(self.out),
            self.cpu,
            list(self.busy),
            list(self.calls),
            list(self.slots),
            [0.0] * n + [self.sink_full],
        )

    def window(
        self,
        seconds: float,
        rate: float,
        cores: float,
        task: float | Sequence[float],
        first: bool = False,
        sink_full: float = 0.0,
        busy: float | Sequence[float] = 1.0,
    ) -> None:
        """One window; ``task`` 0: the stage ended no call; ``sink_full``: share of it full;
        ``busy``: share of the slots busy."""
        before = self.mark()
        n = len(self.stages)
        tasks, busies = _each(task, n), _each(busy, n)
        self.sink_full += sink_full * seconds
        self.t += seconds
        self.out += rate * seconds
        self.cpu += cores * seconds
        for i, stage in enumerate(self.stages):
            c = stage.counters.concurrency
            self.busy[i] += seconds * c * busies[i]
            self.slots[i] += seconds * c
            # Each call ``task`` long.
            self.calls[i] += round(seconds * c * busies[i] / tasks[i]) if tasks[i] else 0
        now = self.mark()
        self.tuner._mark = before
        self.tuner._decide(before, now, raise_only=first, first=first)

    def run(self, model: Model, windows: int) -> list[int]:
        """``windows`` windows of 0.3 s (after the run's first, of 0.1 s) of what ``model``
        says one stage does at its concurrency then; returns the concurrency of each."""
        seen = []
        for k in range(windows + 1):
            c = self.concurrency
            seen.append(c)
            rate, cores, task = model(c)
            self.window(0.1 if k == 0 else 0.3, rate=rate, cores=cores, task=task, first=k == 0)
        return seen

    @property
    def concurrency(self) -> int:
        """The first stage's concurrency now."""
        return int(self.stage.counters.concurrency)

    def of(self, name: str) -> int:
        """Stage ``name``'s concurrency now."""
        return next(int(s.counters.concurrency) for s in self.stages if s.name == name)

    @property
    def decisions(self) -> str:
        return "\n".join(self.tuner.decisions)


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
    """Calls of ``seconds`` on a core each, the GIL released: up to ``cores`` run at once
    (nearly every core busy then); the calls beyond them queue for a core."""
    return lambda c: (
        min(c, cores) / seconds,
        0.98 * min(c, cores),
        seconds * max(1.0, c / cores),
    )
