"""The ``feedline`` command.

``feedline bench [SCENARIO ...] [--quick] [--out DIR]`` runs benchmarks that compare feedline
with what users would otherwise run, prints a table per scenario and writes JSON results.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _progress(message: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{time.strftime('%H:%M:%S')} {message}")
    else:
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {message}\n")
    sys.stderr.flush()


def _bench(args: argparse.Namespace) -> int:
    from feedline.bench import SCENARIOS, BenchOptions, run_scenarios

    names = args.scenarios or sorted(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(
            f"feedline bench: unknown scenario(s): {', '.join(unknown)}. "
            f"Available: {', '.join(sorted(SCENARIOS))}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    options = BenchOptions(
        quick=args.quick,
        progress=_progress,
        data_dir=Path(args.data) if args.data is not None else None,
    )
    results = run_scenarios(names, options=options, out=out)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    for result in results:
        print(f"\n== {result.scenario} ==")
        print(result.table())
    print(f"\nresults written to {out.resolve()}")
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
        help=f"scenarios to run (default: all): {', '.join(sorted(SCENARIOS))}",
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
        help="where generated datasets are cached (default: $FEEDLINE_BENCH_DATA or "
        "~/.cache/feedline/bench)",
    )
    bench.add_argument(
        "--out",
        default="bench-results",
        metavar="DIR",
        help="where to write JSON results (default: ./bench-results)",
    )
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``feedline`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
