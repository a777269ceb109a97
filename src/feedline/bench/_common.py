"""Shared benchmark machinery: alternating repeats, medians, result records, tables."""

from __future__ import annotations

import json
import math
import resource
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._machine import machine_info

__all__ = [
    "Contender",
    "Measurement",
    "ScenarioResult",
    "alternate",
    "fmt",
    "make_result",
    "paired_ratio",
    "process_cpu_seconds",
    "round_ratios",
    "spread",
    "threaded_loop",
]


@dataclass(frozen=True)
class Contender:
    """One way of doing the work: ``run()`` does it once and returns (items, seconds)."""

    name: str
    run: Callable[[], tuple[int, float]]


@dataclass
class Measurement:
    """The medians of one contender in one configuration."""

    case: str
    contender: str
    items_per_s: float
    runs: list[float]
    ratio: float | None = None  # to the case's baseline
    extra: dict[str, float] = field(default_factory=dict)
    ratio_runs: list[float] = field(default_factory=list)  # the per-round ratios behind it


@dataclass
class ScenarioResult:
    """All measurements of a scenario, with what is needed to read them."""

    scenario: str
    baseline: str
    measurements: list[Measurement]
    notes: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None  # why the scenario did not run (a module to install)
    unit: str = "items/s"  # what items_per_s counts
    headline: list[str] = field(default_factory=list)  # contenders with default settings
    command: str = ""  # the command line that produced it
    # Per case, points (seconds, items/s, {stage: concurrency}) over a run: a second chart.
    timelines: dict[str, Any] = field(default_factory=dict)
    # Cases whose ratios are to another baseline than the scenario's: case -> its name.
    case_baselines: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> ScenarioResult:
        """Read a result that :meth:`save` wrote."""
        data = json.loads(path.read_text())
        data["measurements"] = [Measurement(**m) for m in data["measurements"]]
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    def save(self, directory: Path) -> Path:
        """Write the result as ``<scenario>.json`` under ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.scenario}.json"
        path.write_text(json.dumps(self.to_json(), indent=2))
        return path


def fmt(value: float) -> str:
    """A figure for a table: thousands separated, no exponent, about three significant digits.

    >>> fmt(1784.2), fmt(43.21), fmt(2.345), fmt(0.01234)
    ('1,784', '43.2', '2.35', '0.0123')
    """
    if not math.isfinite(value):
        return str(value)
    size = abs(value)
    if size >= 100 or value == 0:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    digits = 2 - math.floor(math.log10(size))
    return f"{value:.{digits}f}"


def spread(runs: Sequence[float]) -> str:
    """How much the rounds of a figure varied: ``min-max`` (one round: empty)."""
    finite = [r for r in runs if math.isfinite(r)]
    if len(finite) < 2:
        return ""
    return f"{fmt(min(finite))}-{fmt(max(finite))}"


def alternate(
    case: str,
    contenders: Sequence[Contender],
    repeats: int,
    baseline: str | None,
    progress: Callable[[str], None] | None = None,
    *,
    cpu_seconds: Callable[[], float] | None = None,
) -> list[Measurement]:
    """Run each contender ``repeats`` times, round-robin, and summarise by the median.

    Alternating spreads the noise of a shared machine over every contender instead of
    letting it land on whichever ran during a busy moment. The ratio to ``baseline`` is the
    median of the per-round ratios (each run against the baseline's run of the same round),
    so that a machine whose speed drifts between rounds does not skew it. Each measurement's
    ``extra["cpu_s_per_1000"]`` is the median CPU time per 1000 items of its runs, as
    ``cpu_seconds`` counts it (default :func:`process_cpu_seconds`: this process and the
    children it has waited for; a contender whose worker processes outlive its runs needs
    them counted too).
    """
    clock = process_cpu_seconds if cpu_seconds is None else cpu_seconds
    rates: dict[str, list[float]] = {c.name: [] for c in contenders}
    cpu: dict[str, list[float]] = {c.name: [] for c in contenders}
    if len(rates) != len(contenders):
        raise ValueError(f"contender names must be unique: {[c.name for c in contenders]}")
    for r in range(repeats):
        for c in contenders:
            if progress is not None:
                progress(f"{case}: {c.name} (run {r + 1}/{repeats})")
            cpu0 = clock()
            items, seconds = c.run()
            spent = clock() - cpu0
            rates[c.name].append(items / seconds if seconds > 0 else float("nan"))
            # Per item of the pass; scenarios that count items otherwise (a steady window,
            # one first batch) overwrite it with their own figure (LoaderCosts.attach).
            cpu[c.name].append(1000 * spent / items if items > 0 else float("nan"))
    out = [
        Measurement(
            case=case,
            contender=name,
            items_per_s=statistics.median(v),
            runs=v,
        )
        for name, v in rates.items()
    ]
    for m in out:
        per_run = [c for c in cpu[m.contender] if math.isfinite(c)]  # runs with items
        if per_run:
            m.extra["cpu_s_per_1000"] = statistics.median(per_run)
    base = rates.get(baseline) if baseline is not None else None
    if base is not None:
        for m in out:
            m.ratio = paired_ratio(m.runs, base)
            m.ratio_runs = round_ratios(m.runs, base)
    return out


def drop_cpu(found: Sequence[Measurement]) -> None:
    """Leave out the CPU per item of runs that report rates, not items (not comparable)."""
    for m in found:
        m.extra.pop("cpu_s_per_1000", None)


def process_cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for (user + system)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def round_ratios(runs: Sequence[float], base: Sequence[float]) -> list[float]:
    """``runs[i] / base[i]`` for each round with a finite rate and a positive finite baseline."""
    return [
        r / b
        for r, b in zip(runs, base, strict=True)
        if math.isfinite(r) and math.isfinite(b) and b > 0
    ]


def paired_ratio(runs: Sequence[float], base: Sequence[float]) -> float | None:
    """The median over rounds of ``runs[i] / base[i]``, skipping rounds without a valid pair.

    Each round's runs were taken moments apart, so a machine that drifts between rounds
    cancels out. ``None`` if no round has a finite rate and a positive finite baseline.
    """
    pairs = round_ratios(runs, base)
    return statistics.median(pairs) if pairs else None


def make_result(
    scenario: str,
    baseline: str,
    measurements: list[Measurement],
    notes: list[str],
    spdl_installed: bool,
    *,
    unit: str = "items/s",
    headline: Sequence[str] = (),
) -> ScenarioResult:
    """Wrap a scenario's measurements with its notes and where they were taken.

    ``unit`` says what ``items_per_s`` counts; ``headline`` names the contenders that run
    with feedline's default settings, the ones a summary's headline may quote.
    """
    if not spdl_installed:
        notes = [*notes, "spdl is not installed (pip install 'feedline[bench]'): no SPDL column"]
    return ScenarioResult(
        scenario=scenario,
        baseline=baseline,
        measurements=measurements,
        notes=notes,
        machine=machine_info(),
        unit=unit,
        headline=list(headline),
    )


def threaded_loop(
    fn: Callable[[Any], Any], samples: Sequence[Any], threads: int
) -> tuple[int, float]:
    """Call ``fn`` on every sample from ``threads`` threads, each looping over its share.

    Returns (items, seconds), timed from a common start. No pool hands work out, so what
    scales (or not) is ``fn`` itself.
    """
    shares = [samples[i::threads] for i in range(threads)]
    start = threading.Barrier(threads + 1)

    def work(share: list[bytes]) -> None:
        start.wait()
        for data in share:
            fn(data)

    workers = [threading.Thread(target=work, args=(s,)) for s in shares]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    return len(samples), time.perf_counter() - t0
