"""Draw :class:`gfxgraph.bench_charts.Chart` objects as PNGs readable at README width (800 px).

matplotlib is optional (``pip install 'gfxgraph[plot]'``): :func:`draw` returns False without it.
One colour per mode key in every chart, so a mode looks the same across suites.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gfxgraph.bench_charts import BarPanel, Chart, LinePanel

__all__ = ["draw", "WIDTH_IN", "DPI"]

WIDTH_IN, DPI = 8.0, 100  # 800 px wide
_COLOURS = {"eager": "#7f7f7f", "hand": "#1f77b4", "pool": "#2a9d8f", "backend": "#e76f51",
            "reduce-overhead": "#8e44ad", "default": "#b08d57", "floor": "#222222",
            "device": "#d62728", "piecewise": "#f4a261", "backend-regions": "#e9c46a", "backend-saved": "#c1121f"}
# overlapping pairs (pool on hand-captured, backend on reduce-overhead) stay visible: the second of
# each pair is dashed with a larger hollow marker around the first's filled one
_STYLE = {"eager": ("-", "o", True), "hand": ("--", "s", False), "pool": ("-", "o", True),
          "backend": ("-", "^", True), "reduce-overhead": ("--", "o", False), "default": ("-", "D", True),
          "floor": (":", "", True), "device": ("-", "v", True), "piecewise": ("-", "P", True)}


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _plain_log(axis: Any, lo: float, hi: float) -> None:
    """Log-scale ticks labelled as plain numbers (0.5, 2, 10), no minor labels: at 1, 2, 5 x 10^k
    over up to two decades, at powers of ten beyond."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # optional: the plot extra

    subs = (1.0, 2.0, 5.0) if lo > 0 and hi / lo <= 200 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=12))
    axis.set_major_formatter(FuncFormatter(lambda v, _: _fmt(v)))
    axis.set_minor_formatter(NullFormatter())


def _pyplot() -> Any:
    try:
        import matplotlib  # optional: the plot extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: the plot extra
    except ImportError:
        return None
    return plt


def _heading(chart: Chart, env: dict[str, Any]) -> str:
    where = " · ".join(str(x) for x in (env.get("device"), f"torch {env['torch']}" if env.get("torch") else None,
                                        str(env.get("date") or "")[:10] or None) if x)
    return f"{chart.title}\n{where}" if where else chart.title


def _lines(ax: Any, panel: LinePanel) -> None:
    sizes: set[float] = set()
    for s in panel.series:
        xs, ys = [p[0] for p in s.points], [p[1] for p in s.points]
        dash, marker, filled = _STYLE.get(s.key, ("-", "o", True))
        colour = _COLOURS.get(s.key, "#333333")
        size = 0 if s.reference or len(xs) > 12 else 5 + (0 if filled else 4)  # a dense sweep: lines only
        ax.plot(xs, ys, dash, marker=marker or None, color=colour, label=s.label, markersize=size,
                linewidth=1.2 if s.reference else 1.6, markerfacecolor=colour if filled else "none")
        if s.reference:
            ax.annotate(f"{_fmt(ys[-1])} {panel.unit}".strip(), (xs[-1], ys[-1]), xytext=(-2, 3),
                        textcoords="offset points", ha="right", fontsize=8, color=colour)
        else:
            sizes.update(xs)
    if panel.logx:
        ax.set_xscale("log", base=2)
    if panel.logy:
        ax.set_yscale("log")
        _plain_log(ax.yaxis, *ax.get_ylim())
    else:
        ax.set_ylim(bottom=0)
    if panel.logx and 1 < len(sizes) <= 8:
        ax.set_xticks(sorted(sizes))
        ax.set_xticklabels([f"{x:g}" for x in sorted(sizes)])
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, which="major", alpha=0.3)


def _bars(ax: Any, panel: BarPanel) -> None:
    labels = [b[0] for b in panel.bars]
    values = [b[2] for b in panel.bars]
    ys = list(range(len(values)))
    xerr = None
    if panel.errors:
        xerr = [[v - lo for v, (lo, _) in zip(values, panel.errors)],
                [hi - v for v, (_, hi) in zip(values, panel.errors)]]
    ax.barh(ys, values, color=[_COLOURS.get(b[1], "#999999") for b in panel.bars], xerr=xerr, capsize=4,
            height=0.6)
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ends = [hi for _, hi in panel.errors] if panel.errors else values
    top = max(ends) if ends else 1.0
    if panel.log:
        ax.set_xscale("log")
        ax.set_xlim(min(v for v in values if v > 0) / 3, top * 8)
        _plain_log(ax.xaxis, *ax.get_xlim())
    else:
        ax.set_xlim(0, top * 1.3 if top > 0 else 1)
    for y, v, end in zip(ys, values, ends):
        ax.text(end * 1.1 if panel.log else end + top * 0.02, y, _fmt(v), va="center", fontsize=8)
    ax.set_xlabel(panel.xlabel)
    ax.grid(True, axis="x", which="major", alpha=0.3)


def _size(chart: Chart) -> tuple[float, float]:
    if any(isinstance(p, LinePanel) for p in chart.panels):
        return WIDTH_IN, 4.5
    most = max(len(p.bars) for p in chart.panels if isinstance(p, BarPanel))
    return WIDTH_IN, max(2.8, min(6.0, 1.7 + 0.45 * most))  # at most 600 px tall: bars get thinner


def draw(chart: Chart, env: dict[str, Any], path: Path) -> bool:
    """Write ``chart`` to ``path`` (PNG, 800 px wide); False when matplotlib is not installed."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(chart.panels), figsize=_size(chart), squeeze=False)
    for ax, panel in zip(axes[0], chart.panels):
        (_lines if isinstance(panel, LinePanel) else _bars)(ax, panel)
        ax.set_title(panel.title, fontsize=9)
    bars = [p for p in chart.panels if isinstance(p, BarPanel)]
    if len(bars) == len(chart.panels) > 1 and len({tuple(b[0] for b in p.bars) for p in bars}) == 1:
        for ax in axes[0][1:]:  # the same modes in every panel: name them once, on the left
            ax.set_yticklabels([])
    fig.suptitle(_heading(chart, env), fontsize=10)
    bottom = 0.0
    if chart.legend and any(isinstance(p, LinePanel) for p in chart.panels):
        handles: dict[str, Any] = {}
        for ax in axes[0]:
            for h, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, h)
        ncol = min(3 if max(len(k) for k in handles) < 34 else 2, len(handles))
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=8,
                   frameon=False)
        bottom = 0.05 + 0.045 * -(-len(handles) // ncol)
    fig.tight_layout(rect=(0, bottom, 1, 0.97))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True
