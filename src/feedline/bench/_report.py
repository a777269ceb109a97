"""Turning results into what a person reads: PNG charts and the README's headline table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ._common import Measurement, ScenarioResult

__all__ = ["headline", "plot"]


def _best_feedline(ms: list[Measurement]) -> Measurement | None:
    ours = [m for m in ms if m.contender.startswith("feedline")]
    return max(ours, key=lambda m: m.items_per_s) if ours else None


def headline(results: Sequence[ScenarioResult]) -> str:
    """A Markdown table: per scenario and case, feedline's best contender against the baseline."""
    rows = [
        "| scenario | case | feedline | items/s | baseline | ratio |",
        "|---|---|---|---:|---|---:|",
    ]
    for result in results:
        cases: dict[str, list[Measurement]] = {}
        for m in result.measurements:
            cases.setdefault(m.case, []).append(m)
        for case, ms in cases.items():
            best = _best_feedline(ms)
            if best is None:
                continue
            ratio = "- (baseline not installed)" if best.ratio is None else f"{best.ratio:.2f}x"
            if result.scenario == "startup" and best.ratio:  # a rate of first batches: as a wait
                ratio = f"{1 / best.ratio:.2f}x the wait"
            if result.scenario == "memory":
                value = f"{best.extra['peak_pss_mib']:,.0f} MiB PSS"
            elif result.scenario == "startup":
                value = f"{best.extra['first_batch_ms']:,.0f} ms to 1st batch"
            else:
                value = f"{best.items_per_s:,.0f}"
            rows.append(
                f"| {result.scenario} | {case} | {best.contender} | {value} | "
                f"{result.baseline} | {ratio} |"
            )
    return "\n".join(rows) + "\n"


def plot(result: ScenarioResult, path: Path) -> Path | None:
    """Draw the result as a PNG (throughput per case and contender; memory and CPU beside it).

    Returns the path, or ``None`` when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError:
        return None
    cases: dict[str, list[Measurement]] = {}
    for m in result.measurements:
        cases.setdefault(m.case, []).append(m)
    side = [
        key
        for key in ("peak_pss_mib", "cpu_s_per_1000", "first_batch_ms")
        if any(key in m.extra for m in result.measurements)
    ]
    panels = 1 + len(side)
    rows = sum(len(ms) for ms in cases.values()) + len(cases)
    fig, axes = plt.subplots(
        1, panels, figsize=(7 + 4 * len(side), 1.0 + 0.32 * rows), squeeze=False
    )
    labels: list[str] = []
    ys: list[float] = []
    y = 0.0
    for case, ms in cases.items():
        for m in ms:
            labels.append(f"{case} | {m.contender}" if len(cases) > 1 else m.contender)
            ys.append(y)
            y += 1
        y += 0.6
    colours = [
        "tab:orange" if m.contender.startswith("feedline") else "tab:gray"
        for ms in cases.values()
        for m in ms
    ]
    flat = [m for ms in cases.values() for m in ms]
    ax = axes[0][0]
    ax.barh(ys, [m.items_per_s for m in flat], color=colours)
    for yy, m in zip(ys, flat, strict=True):
        note = f" {m.items_per_s:,.0f}" + (f" ({m.ratio:.2f}x)" if m.ratio is not None else "")
        ax.text(m.items_per_s, yy, note, va="center", fontsize=7)
    ax.set_yticks(ys, labels, fontsize=7)
    ax.invert_yaxis()
    top = max((m.items_per_s for m in flat), default=0.0)
    if top > 0:
        ax.set_xlim(0, top * 1.35)  # room for the figures written after the longest bar
    ax.xaxis.set_major_locator(MaxNLocator(nbins=4))  # few ticks: they never run together
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("items/s (higher is better)")
    ax.set_title(f"{result.scenario}: throughput", fontsize=9)
    titles = {
        "peak_pss_mib": "peak PSS, MiB (lower is better)",
        "cpu_s_per_1000": "CPU s per 1000 items (lower is better)",
        "first_batch_ms": "ms to the first batch (lower is better)",
    }
    for k, key in enumerate(side, start=1):
        axk = axes[0][k]
        values = [m.extra.get(key, 0.0) for m in flat]
        axk.barh(ys, values, color=colours)
        axk.set_yticks(ys, [""] * len(ys))
        axk.invert_yaxis()
        axk.set_title(titles[key], fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
