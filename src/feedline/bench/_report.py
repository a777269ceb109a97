"""Turning results into what a person reads: ``summary.md`` and PNG charts.

``summary.md`` says where the figures were taken (machine, versions, commit, date, command),
then a headline table (feedline with its default settings against the usual way, per case),
then every scenario's table with the spread of each figure over its rounds. The README's
Benchmarks section is one such file, pasted whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ._common import Measurement, ScenarioResult, fmt, spread

__all__ = ["MARKERS", "log_axis", "plot", "splice", "summary"]

MARKERS = ("<!-- feedline report: start -->", "<!-- feedline report: end -->")
"""What encloses a summary pasted into a Markdown file by :func:`splice`."""


@dataclass(frozen=True)
class _Metric:
    """The figure a scenario is read by: its label, where it is, and which way is better."""

    label: str
    get: Callable[[Measurement], float | None]
    higher_is_better: bool


def _extra(key: str) -> Callable[[Measurement], float | None]:
    return lambda m: m.extra.get(key)


@dataclass(frozen=True)
class _Reading:
    """How a scenario is read where it is not a rate (higher is better) against a baseline.

    ``metric`` is the figure its charts and headline show; ``invert`` turns its ratio of
    rates into one of waits; ``ratio_of`` names what the ratio compares.
    """

    metric: _Metric
    invert: bool = False
    ratio_of: str = ""


_READINGS = {
    "memory": _Reading(
        _Metric("peak PSS (MiB)", lambda m: m.extra.get("peak_pss_mib"), False), ratio_of="peak PSS"
    ),
    "startup": _Reading(
        _Metric("first batch (ms)", lambda m: m.extra.get("first_batch_ms"), False),
        invert=True,
        ratio_of="wait",
    ),
}


def _reading(result: ScenarioResult) -> _Reading:
    found = _READINGS.get(result.scenario)
    if found is not None:
        return found
    return _Reading(_Metric(result.unit, lambda m: m.items_per_s, True))


def _primary(result: ScenarioResult) -> _Metric:
    return _reading(result).metric


# Extra figures worth a column: key -> (label, how to write it).
def _percent(v: float) -> str:
    return f"{100 * v:.0f}%"


def _off_by(v: float) -> str:
    return f"{100 * v:+.0f}%"


def _times(v: float) -> str:
    return f"{v:.2f}x"


_COLUMNS: dict[str, tuple[str, Callable[[float], str]]] = {
    "of_bound": ("of bound", _percent),
    "of_decode_alone": ("of decode alone", _percent),
    "vs_spdl": ("vs SPDL", _times),
    "vs_pytorch": ("vs best PyTorch", _times),
    "vs_better_feedline": ("vs better of feedline's", _times),
    "step_p50_ms": ("step p50 (ms)", fmt),
    "p50_vs_cached": ("p50 vs cached", _times),
    "step_p99_ms": ("step p99 (ms)", fmt),
    "p99_vs_cached": ("p99 vs cached", _times),
    "wait_p50_ms": ("wait p50 (ms)", fmt),
    "scaling": ("vs 1 thread", _times),
    "first_batch_ms": ("first batch (ms)", fmt),
    "p50_us": ("p50 (µs)", fmt),
    "p99_us": ("p99 (µs)", fmt),
    "cpu_s_per_1000": ("CPU s / 1000", fmt),
    "peak_pss_mib": ("peak PSS (MiB)", fmt),
    "peak_rss_mib": ("peak RSS (MiB)", fmt),
    "epoch_s": ("s per epoch", fmt),
    "model_s": ("cost model (s)", fmt),
    "model_off": ("model off by", _off_by),
    "store_gets": ("store GETs", fmt),
    "exchanged_mb": ("exchanged (MB)", fmt),
    "beta_percent": ("beta (%)", fmt),
    "to_90_s": ("s to 90 %", fmt),
    "recovery_s": ("s back to 90 %", fmt),
    "share_of_cap": ("of the cap", _percent),
    "refused_percent": ("refused (%)", fmt),
    "lost": ("reads lost", fmt),
    "wait_p99_ms": ("wait p99 (ms)", fmt),
    "p99_vs_no_tail": ("p99 vs no tail", _times),
    "extra_gets_percent": ("extra GETs (%)", fmt),
    "unthrottled_per_s": ("after the cap (/s)", fmt),
    "tuner_cpu_percent": ("tuner CPU (%)", fmt),
    "rss_growth_mib": ("RSS growth (MiB)", fmt),
}


def _by_case(result: ScenarioResult) -> dict[str, list[Measurement]]:
    cases: dict[str, list[Measurement]] = {}
    for m in result.measurements:
        cases.setdefault(m.case, []).append(m)
    return cases


def _ratio(result: ScenarioResult, m: Measurement, *, named: bool = False) -> str:
    """The ratio to the baseline as the scenario is read, with its range over rounds.

    ``startup`` measures a rate of first batches but is read as a wait (lower is better),
    so its ratio is inverted; ``memory``'s is already one of peak memory. ``named`` says
    what the ratio compares after it ("1.05x the wait"), for tables without a column label.
    """
    if not m.ratio:
        return ""
    reading = _reading(result)
    runs = [1 / r if reading.invert else r for r in m.ratio_runs if r]
    text = _times(1 / m.ratio if reading.invert else m.ratio)
    if named and reading.ratio_of:
        text += f" the {reading.ratio_of}"
    if len(runs) > 1:
        text += f" ({_times(min(runs))}-{_times(max(runs))})"
    return text


def _ratio_label(result: ScenarioResult) -> str:
    what = _reading(result).ratio_of
    return f"{what + ' ' if what else ''}x {result.baseline}"


def _header(results: Sequence[ScenarioResult], command: str, dated: bool) -> list[str]:
    # A result saved before skipped results recorded the machine holds only its start time.
    info = next((r.machine for r in results if "versions" in r.machine), {})
    versions = info.get("versions", {})
    ours = versions.get("feedline", "?")
    commit = info.get("commit") if dated else None

    # Results gathered from several runs say so, each with its own command and time.
    def started(r: ScenarioResult) -> str:
        return str(r.machine.get("run_started", ""))

    def said(r: ScenarioResult | None) -> str:
        # The command; for a README (undated), without where its results were written.
        text = (r.command if r is not None else "") or command or "feedline bench"
        return text if dated else re.sub(r" --out(=| )\S+", "", text)

    runs = {(r.command or command, started(r)) for r in results if r.machine}
    if len(runs) > 1:
        shown = [
            f"`{r.scenario}`: `{said(r)}`" + (f" ({started(r)})" if dated and started(r) else "")
            for r in results
        ]
        where = "- **Commands** (results of several runs): " + "; ".join(shown)
    else:
        when = str(info.get("run_started") or info.get("time", ""))
        where = f"- **Command**: `{said(None)}`" + (f", run {when}" if dated and when else "")
    lines = [
        "# feedline bench",
        "",
        where,
        f"- **feedline**: {ours}" + (f", commit {commit}" if commit else ""),
    ]
    if dated and info and not commit:
        lines[-1] += " (not run from a git checkout: no commit to name)"
    if any(re.search(r"(^| )--quick( |$)", said(r)) for r in results) or "--quick" in command:
        lines.append(
            "- **Quick run** (`--quick`): one round per contender on less data, a smoke test "
            "of the benchmark and not a measurement; its ratios are noise"
        )
    if info:
        memory = info.get("memory_gib")
        lines.append(
            f"- **Machine**: {info.get('cpu', '?')}, {info.get('cpus', '?')} cores"
            + (f", {memory} GiB memory" if memory else "")
            + f"; {info.get('platform', '?')}; Python {info.get('python', '?')}"
        )
    others = [f"{name} {v}" for name, v in versions.items() if name != "feedline"]
    if others:
        lines.append(f"- **Libraries**: {', '.join(others)}")
    lines += [
        "- **Reading the figures**: each is the median of the rounds a scenario ran (every "
        "contender once per round, in turn); the range after it is the lowest and highest "
        "round. A ratio is the median of per-round ratios to the baseline's run in the same "
        "round, so that a machine whose speed drifts between rounds does not skew it; its "
        "range is over the rounds too. Compare ratios within one run, not figures across runs.",
        "",
    ]
    return lines


def _headline(results: Sequence[ScenarioResult]) -> list[str]:
    rows = [
        "## Headline (feedline with its default settings)",
        "",
        "| scenario | case | feedline | figure | baseline | ratio (range) |",
        "|---|---|---|---:|---|---:|",
    ]
    for result in results:
        if result.skipped is not None:
            continue
        metric = _primary(result)
        for case, ms in _by_case(result).items():
            for m in ms:
                if m.contender not in result.headline:
                    continue
                value = metric.get(m)
                if value is None:
                    continue
                ratio = _ratio(result, m, named=True)
                baseline = result.case_baselines.get(case, result.baseline)
                rows.append(
                    f"| {result.scenario} | {case} | {m.contender} | {fmt(value)} "
                    f"{metric.label} | {baseline} | {ratio or '-'} |"
                )
    return [*rows, ""]


def _section(result: ScenarioResult) -> list[str]:
    from ._registry import SCENARIOS  # the one-line descriptions

    title = f"## {result.scenario}: {SCENARIOS.get(result.scenario, '')}".rstrip(": ")
    if result.skipped is not None:
        return [title, "", f"Skipped: {result.skipped}.", ""]
    keys = [k for k in _COLUMNS if any(k in m.extra for m in result.measurements)]
    head = ["case", "contender", result.unit, "range", _ratio_label(result)]
    head += [_COLUMNS[k][0] for k in keys]
    rows = [
        "| " + " | ".join(head) + " |",
        "|---|---|" + "---:|" * (len(head) - 2),
    ]
    for case, ms in _by_case(result).items():
        for m in ms:
            cells = [case, m.contender, fmt(m.items_per_s), spread(m.runs), _ratio(result, m)]
            cells += [_COLUMNS[k][1](m.extra[k]) if k in m.extra else "" for k in keys]
            rows.append("| " + " | ".join(cells) + " |")
    notes = [f"- {n}" for n in result.notes]
    return [title, "", *rows, "", *notes, ""]


def summary(
    results: Sequence[ScenarioResult],
    *,
    command: str = "",
    dated: bool = True,
    headline_only: bool = False,
) -> str:
    """The Markdown report of a run: where, the headline, then each scenario in full.

    ``dated=False`` leaves out the date and the git commit, for documents that describe the
    code rather than one run (a README: its commit message says which run it was).
    ``headline_only`` stops after the headline table (for a README that links to the rest).
    """
    lines = _header(results, command, dated)
    lines += _headline(results)
    if headline_only:
        return "\n".join(lines)
    for result in results:
        lines += _section(result)
    skipped = [r for r in results if r.skipped is not None]
    if skipped:
        lines += ["## Not run", ""]
        lines += [f"- {r.scenario}: {r.skipped}" for r in skipped]
        lines.append("")
    return "\n".join(lines)


def splice(document: str, summary_text: str) -> str:
    """``document`` with the text between its :data:`MARKERS` replaced by ``summary_text``.

    The summary's title is left out and its sections become subsections (``###``), so that
    it sits under a heading of the document's own.

    Raises:
        ValueError: If the document lacks either marker, or has them out of order.

    """
    start, end = MARKERS
    i, j = document.find(start), document.find(end)
    if i < 0 or j < i:
        raise ValueError(
            f"put the lines {start!r} and {end!r} where the results should go, in that order"
        )
    lines = summary_text.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    body = "\n".join("#" + line if line.startswith("## ") else line for line in lines)
    return document[: i + len(start)] + "\n" + body.strip("\n") + "\n" + document[j:]


def _tick(value: float, _position: object) -> str:
    return f"{value:,.0f}" if abs(value) >= 10 else fmt(value)


def log_axis(values: Sequence[float]) -> bool:
    """Whether a chart of ``values`` needs a logarithmic axis: they span more than 10x."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return bool(positive) and max(positive) > 10 * min(positive)


def plot(result: ScenarioResult, path: Path) -> Path | None:
    """Draw the result as a PNG, one unit per chart.

    The scenario's own figure per case and contender comes first, then first-batch time,
    CPU and memory, each on a chart of its own. An axis whose values span more than 10x is
    logarithmic. Returns the path, or ``None`` when matplotlib is not installed or there is
    nothing to draw.
    """
    if result.skipped is not None or not result.measurements:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return None
    primary = _primary(result)
    panels: list[_Metric] = [primary]
    titles = {
        "first_batch_ms": "first batch (ms)",
        "cpu_s_per_1000": "CPU s per 1000 items",
        "peak_pss_mib": "peak PSS (MiB)",
    }
    for key, label in titles.items():
        if label != primary.label and any(key in m.extra for m in result.measurements):
            panels.append(_Metric(label, _extra(key), False))
    cases = _by_case(result)
    flat = [m for ms in cases.values() for m in ms]
    labels, ys, y = [], [], 0.0
    for case, ms in cases.items():
        for m in ms:
            labels.append(f"{case} | {m.contender}" if len(cases) > 1 else m.contender)
            ys.append(y)
            y += 1
        y += 0.6
    colours = ["tab:orange" if m.contender.startswith("feedline") else "tab:gray" for m in flat]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.5 * len(panels), 1.2 + 0.3 * len(ys)), squeeze=False
    )
    for k, metric in enumerate(panels):
        ax = axes[0][k]
        values = [metric.get(m) for m in flat]
        shown = [v if v is not None and math.isfinite(v) and v > 0 else 0.0 for v in values]
        positive = [v for v in shown if v > 0]
        log = log_axis(positive)
        if log:
            # On a log axis a bar's length says nothing: dots, with a guide line.
            ax.set_xscale("log")
            for yy, v in zip(ys, shown, strict=True):
                if v > 0:
                    ax.axhline(yy, color="0.92", linewidth=0.8, zorder=0)
            ax.scatter([v if v > 0 else float("nan") for v in shown], ys, c=colours, s=22, zorder=2)
        else:
            ax.barh(ys, shown, color=colours)
        if positive:
            left = min(positive) / 2 if log else 0
            ax.set_xlim(left, max(positive) * (8 if log else 1.6))  # room for the labels
        for yy, v, m in zip(ys, shown, flat, strict=True):
            if v <= 0:
                continue
            note = f" {fmt(v)}"
            if k == 0 and m.ratio is not None and primary.higher_is_better:
                note += f" ({m.ratio:.2f}x)"
            ax.text(v, yy, note, va="center", fontsize=7)
        ax.set_yticks(ys, labels if k == 0 else [""] * len(ys), fontsize=7)
        ax.invert_yaxis()
        ax.xaxis.set_major_formatter(FuncFormatter(_tick))
        better = "higher" if metric.higher_is_better else "lower"
        ax.set_title(f"{metric.label} ({better} is better)", fontsize=9)
    from matplotlib.patches import Patch

    fig.legend(
        handles=[
            Patch(color="tab:orange", label="feedline"),
            Patch(color="tab:gray", label="others"),
        ],
        loc="upper right",
        fontsize=8,
        ncols=2,
    )
    fig.suptitle(f"feedline bench {result.scenario}", fontsize=10, x=0.02, ha="left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # grows to fit every label: none clipped
    plt.close(fig)
    if result.timelines:
        _plot_timelines(result, path.with_name(f"{path.stem}-over-time.png"))
    return path


def _plot_timelines(result: ScenarioResult, path: Path) -> None:
    """One chart per case: items/s over time (left axis) and each stage's concurrency (right)."""
    import matplotlib.pyplot as plt

    cases = list(result.timelines.items())
    fig, axes = plt.subplots(
        len(cases), 1, figsize=(8, 2.6 * len(cases)), squeeze=False, layout="constrained"
    )
    for ax, (case, points) in zip((row[0] for row in axes), cases, strict=True):
        times = [p[0] for p in points]
        ax.plot(times, [p[1] for p in points], color="black", label="items/s")
        ax.set_ylabel("items/s", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.set_title(case, fontsize=9, loc="left")
        right = ax.twinx()
        stages = sorted({name for p in points for name in p[2]})
        for k, stage in enumerate(stages):
            right.step(
                times,
                [p[2].get(stage, 0) for p in points],
                where="post",
                color=("tab:orange", "tab:blue", "tab:green", "tab:purple")[k % 4],
                linestyle="--",
                label=stage if " " in stage or "/" in stage else f"{stage} concurrency",
            )
        plain = not any(" " in s or "/" in s for s in stages)
        right.set_ylabel("concurrency" if plain else "", fontsize=8)
        right.set_ylim(bottom=0)
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles=handles, fontsize=7, loc="lower right")
    axes[-1][0].set_xlabel("seconds from a cold start", fontsize=8)
    fig.suptitle(f"feedline bench {result.scenario}: over time", fontsize=10, x=0.02, ha="left")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
