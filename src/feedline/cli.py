"""The ``feedline`` command.

``feedline bench [SCENARIO ...] [--quick] [--data DIR] [--out DIR]`` runs benchmarks that
compare feedline with what users would otherwise run, prints ``summary.md`` (a headline
table, then every scenario's table) and writes it with JSON results and PNG charts.
``feedline report [DIR] [--into FILE]`` writes the summary and charts again from the JSON.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "console", "main"]


class _Progress:
    """Progress on stderr: a rich display on a terminal (when rich is installed), else lines."""

    def __init__(self, scenarios: list[str]) -> None:
        self._scenarios = scenarios
        self._rich: Any = None
        if sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    SpinnerColumn,
                    TextColumn,
                    TimeElapsedColumn,
                )
            except ImportError:
                pass
            else:
                self._rich = Progress(
                    SpinnerColumn(),
                    TextColumn("[bold]{task.fields[scenario]}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    TextColumn("{task.description}"),
                    console=Console(stderr=True),
                )
                self._task = self._rich.add_task("", total=len(scenarios), scenario="")
        self._step_task: Any = None
        self._step_shown = -1  # plain lines: the last tenth of the work written

    def __enter__(self) -> _Progress:
        if self._rich is not None:
            self._rich.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()

    def scenario(self, index: int) -> None:
        """Scenario ``index`` starts."""
        name = self._scenarios[index]
        if self._rich is not None:
            self._rich.update(self._task, completed=index, scenario=name, description="")
        else:
            self(f"scenario {index + 1}/{len(self._scenarios)}: {name}")

    def done(self) -> None:
        """All scenarios ran."""
        if self._rich is not None:
            self._rich.update(self._task, completed=len(self._scenarios), description="done")

    def steps(self, what: str, done: int, total: int) -> None:
        """Long preparation work advances: a second bar on a terminal, else a line per 10%."""
        if self._rich is not None:
            if self._step_task is None:
                self._step_task = self._rich.add_task("", total=total, scenario=what)
            self._rich.update(
                self._step_task, completed=done, total=total, scenario=what, description=""
            )
            if done >= total:
                self._rich.remove_task(self._step_task)
                self._step_task = None
            return
        tenth = 10 * done // max(total, 1)
        if done == 0:
            self._step_shown = -1
        if tenth > self._step_shown:
            self._step_shown = tenth
            self(f"{what}: {done}/{total}")

    def __call__(self, message: str) -> None:
        if self._rich is not None:
            self._rich.update(self._task, description=message)
        else:
            sys.stderr.write(f"{time.strftime('%H:%M:%S')} {message}\n")
            sys.stderr.flush()


_SPDL_DECODES = ("decode", "images")  # scenarios with an SPDL image-decoding contender


def _restart_for_spdl(args: argparse.Namespace, names: list[str]) -> None:
    """Restart this command so that SPDL finds PyAV's FFmpeg, if that is what it lacks.

    Only the ``feedline`` command and ``python -m feedline`` restart (:func:`console`):
    :func:`main` called from Python, as the tests do, never replaces its process. The
    restart runs the same interpreter with the same arguments and flags (``sys.orig_argv``).
    """
    if not args.may_restart or not any(n in _SPDL_DECODES for n in names):
        return
    from feedline.bench._data import cache_dir
    from feedline.bench._ffmpeg import MARKER, spdl_env

    env = spdl_env(cache_dir(args.data))
    if env is None:
        return
    print(
        "feedline bench: SPDL's wheel ships no FFmpeg; restarting with PyAV's FFmpeg on "
        f"LD_LIBRARY_PATH (links in {env[MARKER]})",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _bench(args: argparse.Namespace) -> int:
    from feedline.bench import SCENARIOS, BenchOptions, run_scenarios
    from feedline.bench._report import plot, summary

    names = args.scenarios or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(
            f"feedline bench: unknown scenario(s): {', '.join(unknown)}. "
            f"Available: {', '.join(sorted(SCENARIOS))}",
            file=sys.stderr,
        )
        return 2
    if args.data is not None and not Path(args.data).is_dir():
        print(
            f"feedline bench: --data {args.data}: no such folder. Give a folder of JPEGs to "
            "measure on your own pictures, or leave --data out to generate pictures in the "
            "cache (~/.cache/feedline/bench, or $FEEDLINE_BENCH_DATA).",
            file=sys.stderr,
        )
        return 2
    if args.data is not None and _foreign_folder(Path(args.data)):
        print(
            f"feedline bench: --data {args.data} holds files but no JPEG (*.jpg, *.jpeg): the "
            "picture scenarios would write their generated pictures there. Give a folder of "
            "JPEGs, an empty folder (or one an earlier run generated pictures in), or leave "
            "--data out.",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(
            f"feedline bench: --out {args.out} is a file; give a folder for the results "
            "(JSON, charts and summary.md), new or existing.",
            file=sys.stderr,
        )
        return 2
    _restart_for_spdl(args, names)
    # PyTorch warns whenever a loader has more workers than cores; the benchmark means to.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    results = []
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if len(names) > 1 and args.may_restart:
        return _bench_apart(args, names, out, started)
    with _Progress(names) as progress:
        options = BenchOptions(
            quick=args.quick,
            progress=progress,
            data_dir=Path(args.data) if args.data is not None else None,
            steps=progress.steps,
        )
        command = " ".join(["feedline bench", *args.argv])
        charts: list[Path] = []
        for i, name in enumerate(names):
            progress.scenario(i)
            (result,) = run_scenarios([name], options=options, out=None)
            result.command = command  # what reproduces it
            result.machine["run_started"] = started  # which results came from one run
            result.save(out)  # as each scenario ends: a run cut short keeps what it measured
            results.append(result)
            chart = plot(result, out / f"{name}.png")
            if chart is not None:
                charts.append(chart)
        progress.done()
    text = summary(results, command=command)
    (out / "summary.md").write_text(text)
    print(f"\n{text}")
    written = ["JSON", "summary.md"] + (["PNG charts"] if charts else [])
    print(f"results ({', '.join(written)}) written to {out.resolve()}")
    if not charts:
        print("no charts drawn: matplotlib is not installed (pip install 'feedline[bench]')")
    skipped = [r for r in results if r.skipped is not None]
    for r in skipped:
        print(f"skipped {r.scenario}: {r.skipped}")
    return 0


def _bench_apart(args: argparse.Namespace, names: list[str], out: Path, started: str) -> int:
    """Run each scenario in a process of its own, then write the summary of them all.

    What one scenario leaves in its process would change the next one's: a scenario that
    reads through a RemoteStore leaves obstore's runtime threads, beside which feedline's
    DataLoader starts its workers from the fork server rather than by a fork (see the loader
    README), and freed memory stays with the process.
    """
    from feedline.bench._common import ScenarioResult
    from feedline.bench._report import summary

    command = " ".join(["feedline bench", *args.argv])
    flags = ["--quick"] if args.quick else []
    if args.data is not None:
        flags += ["--data", str(args.data)]
    out.mkdir(parents=True, exist_ok=True)
    results: list[ScenarioResult] = []
    charts: list[Path] = []
    for i, name in enumerate(names):
        print(f"feedline bench: scenario {i + 1}/{len(names)}: {name}", file=sys.stderr)
        child = [sys.executable, "-m", "feedline", "bench", name, "--out", str(out), *flags]
        code = subprocess.run(child, check=False).returncode
        path = out / f"{name}.json"
        if code != 0 or not path.exists():
            print(f"feedline bench: {name} failed (exit code {code})", file=sys.stderr)
            continue
        result = ScenarioResult.load(path)
        result.command = command  # what reproduces the whole run
        result.machine["run_started"] = started  # which results came from one run
        result.save(out)
        results.append(result)
        if (out / f"{name}.png").exists():
            charts.append(out / f"{name}.png")
    text = summary(results, command=command)
    (out / "summary.md").write_text(text)
    print(f"\n{text}")
    print(f"results written to {out.resolve()}")
    for r in results:
        if r.skipped is not None:
            print(f"skipped {r.scenario}: {r.skipped}")
    return 0 if len(results) == len(names) else 1


def _foreign_folder(folder: Path) -> bool:
    # A folder of files that are neither JPEGs nor what the benchmarks generate (a dataset of
    # PNGs, say), which the picture scenarios would otherwise take as their cache.
    from feedline.bench._data import GENERATED, user_jpegs

    if user_jpegs(folder):
        return False
    return any(not GENERATED.fullmatch(entry.name) for entry in folder.iterdir())


def _report(args: argparse.Namespace) -> int:
    from feedline.bench._common import ScenarioResult
    from feedline.bench._report import plot, splice, summary

    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"feedline report: {folder}: no such folder", file=sys.stderr)
        return 2
    results = []
    for path in sorted(folder.glob("*.json")):
        try:
            results.append(ScenarioResult.load(path))
        except (ValueError, TypeError, KeyError, AttributeError):
            print(f"feedline report: {path.name} is not a feedline bench result: left out")
    if not results:
        print(
            f"feedline report: no results of feedline bench (*.json) in {folder}",
            file=sys.stderr,
        )
        return 2
    for result in results:
        plot(result, folder / f"{result.scenario}.png")
    text = summary(results, command=results[0].command)
    (folder / "summary.md").write_text(text)
    if args.into is None:
        print(text)
        return 0
    target = Path(args.into)
    try:
        pasted = summary(
            results, command=results[0].command, dated=False, headline_only=args.headline
        )
        target.write_text(splice(target.read_text(), pasted))
    except (OSError, ValueError) as error:
        print(f"feedline report: --into {target}: {error}", file=sys.stderr)
        return 2
    what = "its headline" if args.headline else "it"
    print(f"summary.md written to {folder}, and {what} into {target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (exposed for tests and docs)."""
    from feedline.bench import SCENARIOS  # the registry imports each scenario lazily

    parser = argparse.ArgumentParser(
        prog="feedline", description="feedline: fast, threaded data loading."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench",
        help="compare feedline with the usual alternatives on this machine",
        description="Run benchmark scenarios; each alternates contenders and reports medians.",
    )
    bench.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help="scenarios to run (default: all): "
        + "; ".join(f"{name}: {what}" for name, what in SCENARIOS.items()),
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and one repeat: a smoke test, not a measurement",
    )
    bench.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="a folder of your own JPEGs (searched recursively) for the picture scenarios "
        "instead of generated ImageNet-like ones (nothing is written there), or an empty "
        "folder where generated datasets are cached "
        "(default: $FEEDLINE_BENCH_DATA or ~/.cache/feedline/bench)",
    )
    bench.add_argument(
        "--out",
        default="bench-results",
        metavar="DIR",
        help="where to write the results: JSON, PNG plots, summary.md (default: ./bench-results)",
    )
    bench.set_defaults(func=_bench)
    report = sub.add_parser(
        "report",
        help="write summary.md and the charts again from a results folder's JSON",
        description="Regenerate summary.md (tables with spreads, machine, versions, commit) "
        "and the PNG charts from the JSON results that feedline bench wrote.",
    )
    report.add_argument(
        "folder",
        nargs="?",
        default="bench-results",
        help="the folder feedline bench wrote its JSON results to (default: ./bench-results)",
    )
    report.add_argument(
        "--into",
        metavar="FILE",
        help="also paste the summary, without its date and commit, into this Markdown file (a "
        "README), between the lines '<!-- feedline report: start -->' and "
        "'<!-- feedline report: end -->'",
    )
    report.add_argument(
        "--headline",
        action="store_true",
        help="with --into: paste only the machine, the versions and the headline table (for a "
        "README that links to the full report)",
    )
    report.set_defaults(func=_report)
    return parser


def main(argv: list[str] | None = None, *, may_restart: bool = False) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Args:
        argv: The arguments after the program name.
        may_restart: Whether ``feedline bench`` may restart the process so that SPDL finds
            an FFmpeg (see :mod:`feedline.bench._ffmpeg`); only :func:`console` sets it.

    """
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help()  # what the commands are, rather than the one argument missing
        return 2
    args = parser.parse_args(argv)
    args.may_restart = may_restart
    args.argv = list(sys.argv[1:] if argv is None else argv)[1:]
    code: int = args.func(args)
    return code


def console() -> int:
    """Entry point of the ``feedline`` command and of ``python -m feedline``."""
    return main(may_restart=True)


if __name__ == "__main__":
    sys.exit(console())
