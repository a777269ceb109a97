"""The scenarios ``feedline bench`` knows, by name, what each needs, and how they are run."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ._common import ScenarioResult
from ._machine import machine_info

__all__ = [
    "EXTRAS",
    "REQUIRES",
    "SCENARIOS",
    "SMOKE_ENV",
    "BenchOptions",
    "install_hint",
    "missing_modules",
    "run_scenarios",
]


SMOKE_ENV = "FEEDLINE_BENCH_SMOKE"
"""Set to 1, ``--quick`` shrinks the scenarios further, for feedline's own tests (see
:attr:`BenchOptions.smoke`)."""

_T = TypeVar("_T")


def _smoke_from_env() -> bool:
    return os.environ.get(SMOKE_ENV, "") not in ("", "0")


@dataclass(frozen=True)
class BenchOptions:
    """What every scenario is given.

    Attributes:
        quick: Tiny sizes and one repeat: a smoke test, not a measurement.
        smoke: With ``quick``, the least work that still runs every part of a scenario once
            (every case, every kind of contender, a few items each): for feedline's test
            suite, whose tests check that a scenario runs to its end and reports in full,
            not its figures. Set by ``FEEDLINE_BENCH_SMOKE=1`` in the environment.
        progress: Called with a one-line message as work advances.
        data_dir: Where generated datasets are cached (None: the default cache), or a folder
            of the user's JPEGs for the picture scenarios (see :func:`._data.user_jpegs`).
        steps: Called with (what, done, total) during long preparation, such as generating
            pictures, so that a progress bar can show it.

    """

    quick: bool = False
    progress: Callable[[str], None] | None = None
    data_dir: Path | None = None
    steps: Callable[[str, int, int], None] | None = None
    smoke: bool = field(default_factory=_smoke_from_env)

    @property
    def smoke_run(self) -> bool:
        """Whether this run is a smoke run: :attr:`smoke` with :attr:`quick`."""
        return self.quick and self.smoke

    def size(self, full: _T, quick: _T, smoke: _T) -> _T:
        """``full``, or with ``quick`` the ``quick`` size (``smoke`` when :attr:`smoke`)."""
        if not self.quick:
            return full
        return smoke if self.smoke_run else quick


SCENARIOS: dict[str, str] = {
    "autotune": "the tuned pipeline against the best fixed one (grid search) and tf.data",
    "decode": "JPEG decode + resize per library, 1 and 2 threads",
    "distributed": "epochs on 4 and 8 ranks from a slow shared store, against the regular split",
    "engine": "pipeline overhead and hand-off latency against SPDL and a thread pool",
    "formats": "NPY / NPZ loading against numpy.load and SPDL",
    "freethreaded": "the same pipelines with the GIL and on free-threaded CPython (3.13t)",
    "images": "JPEG files to batches: DataLoaders and pipelines against the machine's bound",
    "latency": "DataLoader over reads that wait on a slow server, against PyTorch's",
    "memory": "peak memory (PSS) of a DataLoader over 2 million file paths",
    "shards": "reading tar shards in memory, against Python's tarfile",
    "startup": "time to the first batch, against PyTorch's DataLoader with workers",
    "storage": "a store that throttles (503 SlowDown) and one with a long tail of latency",
    "train": "headspace: training steps/s beside each loader, against cached batches",
    "verify": "checking object bodies (MD5, CRC-32) per GiB, against copying them",
    "webdataset": "tar shards over HTTP to decoded batches, against WebDataset + DataLoader",
}
"""Scenario name -> one line on what it measures. The module of the same name runs it."""

_PICTURES = ("cv2", "simplejpeg")  # generating the JPEGs, and feedline's decoder

REQUIRES: dict[str, tuple[str, ...]] = {
    "autotune": ("obstore", *_PICTURES),
    "decode": _PICTURES,
    "distributed": ("torch", *_PICTURES),
    "engine": (),
    "formats": (),
    "freethreaded": (),
    "images": ("torch", "PIL", *_PICTURES),  # its baseline is PyTorch + Pillow
    "latency": ("torch", *_PICTURES),
    "memory": ("torch",),
    "shards": (),
    "startup": ("torch", *_PICTURES),
    "storage": ("obstore",),
    "train": ("torch", *_PICTURES),
    "verify": (),
    "webdataset": ("torch", "webdataset", *_PICTURES),
}
"""Scenario name -> the modules it cannot run without. Contenders that need more (SPDL,
Pillow, obstore, ISA-L) are left out with a note when their module is missing."""

EXTRAS: dict[str, str] = {
    "cv2": "image",
    "simplejpeg": "image",
    "torch": "torch",
    "isal": "npz",
    "obstore": "remote",
    "av": "video",
    "spdl": "bench",
    "PIL": "bench",
    "matplotlib": "bench",
    "tensorflow": "tf",
}
"""Module -> the extra of feedline that installs it."""


def missing_modules(modules: tuple[str, ...] | list[str]) -> list[str]:
    """The modules of ``modules`` that cannot be imported here (found, not imported)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def install_hint(modules: list[str]) -> str:
    """``needs X, Y: pip install 'feedline[a,b]'`` (or ``'feedline[bench]'`` for all)."""
    extras = sorted({EXTRAS.get(m, "bench") for m in modules})
    return f"needs {', '.join(modules)}: pip install 'feedline[{','.join(extras)}]'"


def run_scenarios(
    names: list[str],
    *,
    options: BenchOptions,
    out: Path | None,
) -> list[ScenarioResult]:
    """Run the named scenarios in order; write each result as JSON under ``out``.

    A scenario whose modules are not installed is not run: its result has no measurements
    and says, in ``skipped``, what to install.
    """
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    results = []
    for name in names:
        absent = missing_modules(REQUIRES[name])
        if absent:
            result = ScenarioResult(
                scenario=name,
                baseline="",
                measurements=[],
                skipped=install_hint(absent),
                machine=machine_info(),  # the summary's header reads it from any result
            )
        else:
            module = importlib.import_module(f"feedline.bench.{name}")
            result = module.run(options)
        if out is not None:
            result.save(out)
        results.append(result)
    return results
