"""The ``freethreaded`` scenario: the same pipelines with the GIL and without it.

Two kinds of work, each at 1 and 2 threads: a loop of Python bytecode (about half a
millisecond, the GIL held throughout), and ``numpy.load`` of a 64 KiB NPY file in memory
(Python parsing of its header, then a copy). Each runs as a feedline pipeline of one stage
and as ``ThreadPoolExecutor.map``, on this interpreter and on a free-threaded CPython
(3.13t), every pass in a fresh process of its interpreter, the contenders in alternating
rounds. With the GIL, a second thread cannot make Python code faster; without it, the
pipeline should scale as the plain pool does (the ratios to one pool thread show both the
scaling and what the engine costs).

The free-threaded interpreter is ``$FEEDLINE_FREE_THREADED_PYTHON``, or the one that
``free-threaded-python`` builds into ``~/.cache/feedline/python3.13t`` (NumPy is installed
for it in a virtual environment beside it on first use), or ``python3.13t`` on the PATH.
Without one, only this interpreter is measured, and a note says how to get one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ._common import Contender, Measurement, ScenarioResult, alternate, make_result
from ._registry import BenchOptions

__all__ = ["free_threaded_python", "run"]

ENV = "FEEDLINE_FREE_THREADED_PYTHON"
_CACHE = Path.home() / ".cache" / "feedline"
_BASELINE = "ThreadPoolExecutor.map, 1 thread"
_ONE, _TWO = "feedline pipeline, 1 thread", "feedline pipeline, 2 threads"
_WORK = (("python", "pure-Python loop (GIL held)"), ("npy", "numpy.load of 64 KiB NPY"))
_PACKAGE = Path(__file__).resolve().parents[1]  # the feedline package this runs


def _has_numpy(python: str) -> bool:
    try:
        probe = subprocess.run([python, "-c", "import numpy"], capture_output=True, timeout=120)
    except OSError:
        return False
    return probe.returncode == 0


def _gil_enabled(python: str) -> bool:
    probe = subprocess.run(
        [python, "-c", "import sys; print(getattr(sys, '_is_gil_enabled', lambda: True)())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return probe.stdout.strip() != "False"


def _with_numpy(python: str, progress: Callable[[str], None] | None) -> str | None:
    """``python``, or a virtual environment of it with NumPy; None if neither can run."""
    if _has_numpy(python):
        return python
    venv = _CACHE / "ft-venv"
    interpreter = venv / "bin" / "python"
    if not interpreter.exists():
        if progress is not None:
            progress(f"making {venv} with NumPy for the free-threaded interpreter")
        made = subprocess.run([python, "-m", "venv", str(venv)], capture_output=True)
        if made.returncode != 0:
            return None
    if not _has_numpy(str(interpreter)):
        pip = [str(interpreter), "-m", "pip", "install", "--quiet", "--only-binary=numpy"]
        if subprocess.run([*pip, "numpy<2.5"], capture_output=True).returncode != 0:
            return None
    return str(interpreter)


def free_threaded_python(
    progress: Callable[[str], None] | None = None,
) -> tuple[str | None, str]:
    """A free-threaded interpreter that can import NumPy (see the module's text), or None.

    Returns:
        The interpreter, or None, and a note on which was taken or why none was.

    """
    named = os.environ.get(ENV)
    if named:
        if not os.access(named, os.X_OK):
            return None, f"{ENV}={named} is not an executable: point it at a python3.13t"
        candidate = named
    else:
        built = _CACHE / "python3.13t" / "bin" / "python3.13t"
        found = str(built) if built.exists() else shutil.which("python3.13t")
        if found is None:
            return None, (
                f"no free-threaded interpreter found: set {ENV} to one, or build one (CPython "
                "3.13 configured with --disable-gil) into ~/.cache/feedline/python3.13t"
            )
        candidate = found
    python = _with_numpy(candidate, progress)
    if python is None:
        return None, f"{candidate} cannot import NumPy, nor install it into {_CACHE / 'ft-venv'}"
    if _gil_enabled(python):
        return None, f"{candidate} runs with the GIL: not a free-threaded build, left out"
    return python, f"free-threaded interpreter: {candidate}"


def _importable_feedline() -> str:
    """A folder holding only this feedline, for another interpreter's ``PYTHONPATH``.

    Not the folder feedline sits in: an installed feedline sits beside this interpreter's
    compiled packages (NumPy among them), which another interpreter must not import.
    """
    folder = Path(tempfile.mkdtemp(prefix="feedline-ft-"))
    (folder / "feedline").symlink_to(_PACKAGE)
    return str(folder)


def _pass(
    python: str, path: str, work: str, runner: str, threads: int, items: int
) -> tuple[int, float]:
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run(
        [python, "-m", "feedline.bench._ft_child", work, runner, str(threads), str(items)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{python} failed a pass of {work} on {runner}: {done.stderr[-2000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return int(found["items"]), float(found["seconds"])


def _contenders(python: str, path: str, work: str, items: int) -> list[Contender]:
    def make(runner: str, threads: int) -> Contender:
        label = "feedline pipeline" if runner == "feedline" else "ThreadPoolExecutor.map"
        name = f"{label}, {threads} thread{'s' if threads > 1 else ''}"
        return Contender(name, lambda: _pass(python, path, work, runner, threads, items))

    return [make(runner, threads) for threads in (1, 2) for runner in ("pool", "feedline")]


def _scaling_notes(found: list[Measurement], labels: list[str]) -> list[str]:
    notes = []
    for label in labels:
        for work, what in _WORK:
            case = {m.contender: m.items_per_s for m in found if m.case == f"{what}, {label}"}
            one, two = case.get(_ONE), case.get(_TWO)
            pool1, pool2 = case.get(_BASELINE), case.get("ThreadPoolExecutor.map, 2 threads")
            if one and two and pool1 and pool2:
                notes.append(
                    f"{label}, {work}: feedline 2 threads / 1 thread {two / one:.2f}x (pool "
                    f"{pool2 / pool1:.2f}x); feedline / pool {one / pool1:.2f}x at 1 thread, "
                    f"{two / pool2:.2f}x at 2"
                )
    return notes


def run(options: BenchOptions) -> ScenarioResult:
    """Run the freethreaded scenario; ``options.quick`` shrinks it to a smoke test."""
    quick, progress = options.quick, options.progress
    repeats = 1 if quick else 5
    items = {"python": 40 if quick else 2000, "npy": 100 if quick else 6000}
    interpreters = [(sys.executable, f"{sys.version_info.major}.{sys.version_info.minor}")]
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        interpreters[0] = (sys.executable, interpreters[0][1] + "t")
    notes = [
        f"{repeats} alternating round(s); items/s; every pass in a fresh process of its "
        "interpreter (timed after a warm-up pass); ratios to one ThreadPoolExecutor thread on "
        "the same interpreter",
    ]
    free, said = free_threaded_python(progress)
    notes.append(said)
    if free is not None and free != sys.executable:
        interpreters.append((free, "3.13t (free-threaded)"))
    if interpreters[0][1][-1] != "t":
        interpreters[0] = (interpreters[0][0], interpreters[0][1] + " (GIL)")
    measurements: list[Measurement] = []
    path = _importable_feedline()
    try:
        for work, what in _WORK:
            for python, label in interpreters:
                case = f"{what}, {label}"
                contenders = _contenders(python, path, work, items[work])
                measurements += alternate(case, contenders, repeats, _BASELINE, progress)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    notes += _scaling_notes(measurements, [label for _, label in interpreters])
    return make_result("freethreaded", _BASELINE, measurements, notes, True, headline=[_ONE, _TWO])
