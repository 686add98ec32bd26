"""bench's chart: decode tokens/s and time to first token per backend on linear axes, values on the bars, and the
latency breakdown, in one PNG. matplotlib is imported only here, when a chart is asked for."""

from __future__ import annotations

from pathlib import Path

from runner.app.bench.report import FIGURE, FIGURES, BenchRun, Figure, _label, short_sha
from runner.errors import RunnerError

CHART_SIZE = (13.0, 9.0)  # inches
CHART_DPI = 110


def _short(x: float) -> str:
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def chart_figure(run: BenchRun):
    """The chart as a matplotlib Figure (not saved): on top, decode tokens/s and time to first token per backend
    on linear axes, each bar labelled with its value; below, the latency breakdown (per method and end to end:
    median, whiskers min..max, log scale, since a decode step and a whole transcription differ by orders of
    magnitude)."""
    try:
        from matplotlib.figure import Figure as MplFigure
        from matplotlib.patches import Patch
    except ImportError:
        raise RunnerError("--chart: needs matplotlib (pip install '.[bench]')") from None

    backends = [r for r in run.results if r.error is None]
    color = {b.backend: f"C{i}" for i, b in enumerate(run.results)}  # one colour per backend in every panel
    fig = MplFigure(figsize=CHART_SIZE, layout="constrained")
    axes = fig.subplots(2, 2, gridspec_kw={"height_ratios": [1, 1.3]})
    for ax, key in zip(axes[0], ("decode_tokens_per_s", "ttft_ms")):
        _bars(ax, FIGURE[key], backends, color)
    panels = [
        ("latency per method", [f for f in FIGURES if f.group == "method"]),
        ("latency end to end", [f for f in FIGURES if f.group == "e2e" and f.unit == "ms"] + [FIGURE["load_total_ms"]]),
    ]
    for ax, (title, figs) in zip(axes[1], panels):
        _latencies(ax, title, figs, backends, color)
    handles = [Patch(color=color[b.backend], label=_label(b.backend)) for b in backends]
    try:
        fig.legend(handles=handles, loc="outside lower center", ncols=max(len(handles), 1))
    except ValueError:  # matplotlib < 3.7 has no "outside" placement
        axes[1][0].legend(handles=handles, loc="lower right")
    ctx = run.context
    fig.suptitle(
        f"Voxtral {ctx['model']} on {ctx['arch']} ({ctx['device']}, {ctx['dtype']}), git {short_sha(ctx['git_sha'], 8)}"
    )
    return fig


def _bars(ax, f: Figure, backends: list, color: dict[str, str]) -> None:
    """One figure's median per backend on a linear axis, each bar labelled with its value."""
    have = [(b, s) for b in backends if (s := b.summary(f.key)) is not None]
    bars = ax.bar(
        [_label(b.backend) for b, _ in have],
        [s.median for _, s in have],
        color=[color[b.backend] for b, _ in have],
    )
    ax.bar_label(bars, labels=[_short(s.median) for _, s in have])
    ax.set_yscale("linear")
    ax.set_ylim(0, max((s.median for _, s in have), default=1) * 1.15 or 1)  # room for the labels
    ax.set_ylabel(f"{f.unit} (median)")
    ax.set_title(f"{f.label.removeprefix('e2e: ')} ({f.unit}, {f.better} is better)")
    ax.grid(axis="y", alpha=0.3)


def _latencies(ax, title: str, figs: list[Figure], backends: list, color: dict[str, str]) -> None:
    """Latencies per backend as horizontal bars: median, whiskers min..max, log scale."""
    height = 0.8 / max(len(backends), 1)
    figs = [f for f in figs if any(b.samples.get(f.key) for b in backends)]
    for i, b in enumerate(backends):
        ys, xs, lo, hi = [], [], [], []
        for j, f in enumerate(figs):
            s = b.summary(f.key)
            if s is None or s.median <= 0:
                continue
            ys.append(j + (i - (len(backends) - 1) / 2) * height)
            xs.append(s.median)
            lo.append(s.median - s.min)
            hi.append(s.max - s.median)
        if xs:
            bars = ax.barh(ys, xs, height=height, xerr=[lo, hi], capsize=2, color=color[b.backend])
            ax.bar_label(bars, labels=[_short(x) for x in xs], padding=2, fontsize=7)
    ax.set_yticks(range(len(figs)), [f.label for f in figs])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ms (median; whiskers min..max)")
    ax.set_title(title)
    ax.grid(axis="x", which="both", alpha=0.3)


def write_chart(run: BenchRun, path: Path) -> None:
    fig = chart_figure(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=CHART_DPI)
