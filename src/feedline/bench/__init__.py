"""Benchmarks behind ``feedline bench``: feedline against what users would otherwise run.

Each scenario runs every contender in one process, alternating between them, repeats, and
reports medians and ratios to a baseline. See ``README.md`` in this folder.
"""

from __future__ import annotations

from ._common import Measurement, ScenarioResult
from ._registry import SCENARIOS, BenchOptions, run_scenarios

__all__ = ["SCENARIOS", "BenchOptions", "Measurement", "ScenarioResult", "run_scenarios"]
