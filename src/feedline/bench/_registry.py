"""The scenarios ``feedline bench`` knows, by name, and how they are run."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ._common import ScenarioResult

__all__ = ["SCENARIOS", "BenchOptions", "run_scenarios"]


@dataclass(frozen=True)
class BenchOptions:
    """What every scenario is given.

    Attributes:
        quick: Tiny sizes and one repeat: a smoke test, not a measurement.
        progress: Called with a one-line message as work advances.
        data_dir: Where generated datasets are cached (None: the default cache), or a folder
            of the user's JPEGs for the picture scenarios (see :func:`._data.user_jpegs`).

    """

    quick: bool = False
    progress: Callable[[str], None] | None = None
    data_dir: Path | None = None


SCENARIOS: dict[str, str] = {
    "decode": "JPEG decode + resize per library, 1 and 2 threads",
    "engine": "pipeline overhead and hand-off latency against SPDL and a thread pool",
    "formats": "NPY / NPZ loading against numpy.load and SPDL",
    "images": "JPEG files to batches: DataLoaders and pipelines against the machine's bound",
    "latency": "DataLoader over reads that wait on a slow server, against PyTorch's",
    "memory": "peak memory (PSS) of a DataLoader over 2 million file paths",
    "startup": "time to the first batch, against PyTorch's DataLoader with workers",
    "verify": "checking object bodies (MD5, CRC-32) per GiB, against copying them",
}
"""Scenario name -> one line on what it measures. The module of the same name runs it."""


def run_scenarios(
    names: list[str],
    *,
    options: BenchOptions,
    out: Path | None,
) -> list[ScenarioResult]:
    """Run the named scenarios in order; write each result as JSON under ``out``."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    results = []
    for name in names:
        module = importlib.import_module(f"feedline.bench.{name}")
        result: ScenarioResult = module.run(options)
        if out is not None:
            result.save(out)
        results.append(result)
    return results
