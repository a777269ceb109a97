"""The scenarios ``feedline bench`` knows, by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ._common import ScenarioResult

__all__ = ["SCENARIOS", "run_scenarios"]


def _engine(quick: bool, progress: Callable[[str], None] | None) -> ScenarioResult:
    from . import engine

    return engine.run(quick=quick, progress=progress)


def _formats(quick: bool, progress: Callable[[str], None] | None) -> ScenarioResult:
    from . import formats

    return formats.run(quick=quick, progress=progress)


SCENARIOS: dict[str, Callable[[bool, Callable[[str], None] | None], ScenarioResult]] = {
    "engine": _engine,
    "formats": _formats,
}
"""Scenario name -> function(quick, progress) returning its result."""


def run_scenarios(
    names: list[str],
    *,
    quick: bool,
    out: Path | None,
    progress: Callable[[str], None] | None = None,
) -> list[ScenarioResult]:
    """Run the named scenarios in order; write each result as JSON under ``out``."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    results = []
    for name in names:
        result = SCENARIOS[name](quick, progress)
        if out is not None:
            result.save(out)
        results.append(result)
    return results
