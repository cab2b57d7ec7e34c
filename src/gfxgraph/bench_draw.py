"""Draw :class:`gfxgraph.bench_charts.Chart` objects as PNGs readable at README width (800 px).

matplotlib is optional (``pip install 'gfxgraph[bench]'``): :func:`draw` returns False without it.
One colour per mode key in every chart, so a mode looks the same across suites.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gfxgraph.bench_charts import BarPanel, Chart, LinePanel

__all__ = ["draw", "WIDTH_IN", "DPI"]

WIDTH_IN, DPI = 8.0, 100  # 800 px wide
_COLOURS = {"eager": "#7f7f7f", "hand": "#1f77b4", "pool": "#2a9d8f", "backend": "#e76f51",
            "reduce-overhead": "#8e44ad", "default": "#b08d57", "floor": "#222222"}
# overlapping pairs (pool on hand-captured, backend on reduce-overhead) stay visible: other dash and marker
_STYLE = {"eager": ("-", "o"), "hand": ("--", "s"), "pool": ("-", "o"), "backend": ("-", "^"),
          "reduce-overhead": ("--", "v"), "default": ("-", "D"), "floor": (":", "")}


def _pyplot() -> Any:
    try:
        import matplotlib  # optional: the bench extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: the bench extra
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
        dash, marker = _STYLE.get(s.key, ("-", "o"))
        ax.plot(xs, ys, dash, marker=marker or None, color=_COLOURS.get(s.key, "#333333"), label=s.label,
                linewidth=1.2 if s.reference else 1.8, markersize=0 if s.reference else (3 if len(xs) > 12 else 6))
        if not s.reference:
            sizes.update(xs)
    if panel.logx:
        ax.set_xscale("log", base=2)
    if panel.logy:
        ax.set_yscale("log")
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
    top = max(values) if values else 1.0
    if panel.log:
        ax.set_xscale("log")
        low = min(v for v in values if v > 0)
        ax.set_xlim(low / 3, top * 8)
    else:
        ax.set_xlim(0, top * 1.3 if top > 0 else 1)
    for y, v in zip(ys, values):
        ax.text(v * 1.08 if panel.log else v + top * 0.02, y, f"{v:.3g}", va="center", fontsize=8)
    ax.set_xlabel(panel.xlabel)
    ax.grid(True, axis="x", which="major", alpha=0.3)


def _size(chart: Chart) -> tuple[float, float]:
    if any(isinstance(p, LinePanel) for p in chart.panels):
        return WIDTH_IN, 4.5
    most = max(len(p.bars) for p in chart.panels if isinstance(p, BarPanel))
    return WIDTH_IN, max(2.4, 1.3 + 0.42 * most)


def draw(chart: Chart, env: dict[str, Any], path: Path) -> bool:
    """Write ``chart`` to ``path`` (PNG, 800 px wide); False when matplotlib is not installed."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(chart.panels), figsize=_size(chart), squeeze=False)
    for ax, panel in zip(axes[0], chart.panels):
        (_lines if isinstance(panel, LinePanel) else _bars)(ax, panel)
        ax.set_title(panel.title, fontsize=9)
    fig.suptitle(_heading(chart, env), fontsize=10)
    bottom = 0.0
    if chart.legend and any(isinstance(p, LinePanel) for p in chart.panels):
        handles: dict[str, Any] = {}
        for ax in axes[0]:
            for h, label in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(label, h)
        ncol = min(3, len(handles))
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, fontsize=8,
                   frameon=False)
        bottom = 0.05 + 0.045 * -(-len(handles) // ncol)
    fig.tight_layout(rect=(0, bottom, 1, 0.97))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True
