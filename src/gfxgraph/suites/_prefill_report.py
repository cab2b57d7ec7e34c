"""The prefill suite's figures and plot, computed from its results alone (no GPU, no CUDA, no torch).

:mod:`gfxgraph.suites.prefill` runs one child process per model and hands the results here;
:func:`merge` reads the ``prefill.json`` of several runs (one model each, say, where one
command may not run both) and writes one ``prefill.json`` whose figures and plot are
recomputed from every run's results, exactly as a single run of every model would have them.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gfxgraph.suites._common import figure, write

__all__ = ["BINS", "CONTENDERS", "bin_ratios", "figures_of", "merge", "model_figures", "plot"]

CONTENDERS = ("eager", "piecewise", "gfxgraph", "default", "reduce-overhead")
BINS = ((1, 64), (65, 128), (129, 256), (257, 512), (513, 1024))
# what must agree between runs for their results to form one report
_SAME = ("quick", "requests", "method")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def bin_ratios(res: dict[str, Any], mode: str, lengths: list[int]) -> list[tuple[str, float | None, int]]:
    """Per length bin: median over its requests of (mode's latency / default's), and the request count."""
    a, d = res.get(mode, {}).get("stream_ms"), res.get("default", {}).get("stream_ms")
    if not a or not d:
        return []
    out = []
    for lo, hi in BINS:
        r = [x / y for x, y, n in zip(a, d, lengths) if lo <= n <= hi]
        out.append((f"{lo}-{hi}", _median(r), len(r)))
    return out


def _mode_figures(name: str, mode: str, r: dict[str, Any]) -> list[dict[str, Any]]:
    n = r["stream_requests"]
    figs = [
        figure(f"{name} {mode}: stream total ({n} requests, compile and capture included)", r["stream_total_s"],
               None, None, "s"),
        figure(f"{name} {mode}: steady latency, median over the stream", _median(r["stream_ms"]), None, None, "ms"),
    ]
    if r.get("mixed_ms"):
        figs += [
            figure(f"{name} {mode}: mixed run total ({r['mixed_batches']} batches of 1..8)", r["mixed_total_s"],
                   None, None, "s"),
            figure(f"{name} {mode}: mixed run steady latency, median per batch", _median(r["mixed_ms"]), None,
                   None, "ms"),
        ]
    if mode != "eager":
        mixed = f"; mixed run {r['mixed_max_diff']:.3g}" if r.get("mixed_ms") else ""
        figs += [
            _memory_figure(f"{name} {mode}: graph memory", r["graph_bytes"]),
            figure(f"{name} {mode}: max |logit - eager| over the stream", r["stream_max_diff"],
                   "within bf16 tolerance of eager (rtol 5e-2, atol 1e-2)",
                   bool(r["stream_within_tol"] and r["mixed_within_tol"]),
                   note=f"first pass {r['first_pass_max_diff']:.3g}{mixed}"),
        ]
    return figs


def _memory_figure(name: str, nbytes: int) -> dict[str, Any]:
    if nbytes < 0:  # runs before the suite counted new pools only: an earlier contender's pools were freed
        return figure(name, None, None, None, "MiB", note=f"not measured: the graph-pool total fell by "
                      f"{-nbytes / 2**20:.0f} MiB during the run (an earlier contender's pools were freed)")
    return figure(name, nbytes / 2**20, None, None, "MiB")


def model_figures(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One model's figures: per contender (a failure figure for one that failed or never finished),
    the issue's targets, and a failure figure when the child stopped before its last contender."""
    name, figs, mib = res["model"], [], 2**20
    lengths = res["stream_lengths"]
    if res.get("incomplete"):
        figs.append(figure(f"{name}: incomplete run", None, None, False, note=res["incomplete"]))
    for mode in res.get("contenders", CONTENDERS):
        r = res.get(mode)
        if not isinstance(r, dict) or "stream_ms" not in r:
            figs.append(figure(f"{name} {mode}: failed", None, None, False, note=str(r)[:500]))
            continue
        figs += _mode_figures(name, mode, r)
    pw, ro = res.get("piecewise", {}), res.get("reduce-overhead", {})
    if "checkpoint_total_s" in pw and "stream_total_s" in ro:
        k = ro["stream_requests"]
        ratio = pw["checkpoint_total_s"] / ro["stream_total_s"]
        pstats = pw.get("backend", {}).get("piecewise", {})
        split = (f"; piecewise compile {pstats['compile_seconds']:.1f} s, capture {pstats['capture_seconds']:.1f} s "
                 "(whole stream)" if "compile_seconds" in pstats else "")
        figs.append(figure(f"{name}: piecewise total / reduce-overhead total, first {k} requests", ratio, "<= 0.2",
                           ratio <= 0.2, note=f"{pw['checkpoint_total_s']:.2f} s vs {ro['stream_total_s']:.2f} s{split}"))
        if ro.get("graph_bytes", 0) > 0 and pw.get("graph_bytes", 0) > 0:
            figs.append(figure(f"{name}: piecewise graph memory / reduce-overhead graph memory",
                               pw["graph_bytes"] / ro["graph_bytes"], None, None,
                               note=f"{pw['graph_bytes'] / mib:.0f} vs {ro['graph_bytes'] / mib:.0f} MiB"))
    default = res.get("default", {})
    if "stream_max_diff" in pw and "stream_max_diff" in default:
        worst = max(pw["stream_max_diff"], pw.get("mixed_max_diff", 0.0))
        ref = max(default["stream_max_diff"], default.get("mixed_max_diff", 0.0))
        figs.append(figure(f"{name}: piecewise max |logit - eager| / mode='default''s", worst / ref if ref else None,
                           "<= 1 (no error beyond inductor's own)", ref > 0 and worst <= ref,
                           note=f"{worst:.3g} vs {ref:.3g}"))
    for mode in ("piecewise", "gfxgraph", "reduce-overhead"):
        for label, ratio, count in bin_ratios(res, mode, lengths):
            target, ok = (None, None)
            if mode == "piecewise":
                target = "<= 1.02"
                ok = ratio is not None and ratio <= 1.02
                if name == "llama-small" and label == "1-64":
                    target, ok = "<= 0.77", ratio is not None and ratio <= 0.77
            figs.append(figure(f"{name}: {mode} / default steady latency, prompts {label} tokens ({count})", ratio,
                               target, ok))
    return figs


def plot(results: list[dict[str, Any]], out_dir: str) -> str | None:
    """Latency per request against prompt length, one panel per model (needs matplotlib)."""
    try:
        import matplotlib  # optional: the bench extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    good = [r for r in results if "stream_lengths" in r]
    if not good:
        return None
    fig, axes = plt.subplots(1, len(good), figsize=(7 * len(good), 4.5), squeeze=False)
    for ax, res in zip(axes[0], good):
        for mode in CONTENDERS:
            r = res.get(mode, {})
            if "stream_ms" in r:
                ax.scatter(res["stream_lengths"][:len(r["stream_ms"])], r["stream_ms"], s=6, label=mode)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("steady latency per request (ms)")
        ax.set_yscale("log")
        ax.set_title(res["model"])
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / "prefill_latency.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def figures_of(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every figure of a report: each model's, then one failure figure per model whose child gave no results."""
    figures = [f for res in results if "error" not in res for f in model_figures(res)]
    for res in results:
        if "error" in res:
            figures.append(figure(f"{res['model']}: failed", None, None, False, note=res["error"]))
    return figures


def merge(paths: Sequence[str | Path], out_dir: str) -> Path:
    """One ``prefill.json`` in ``out_dir`` from the ``prefill.json`` of several runs; returns its path.

    The figures and the plot are recomputed from the runs' results (in the order given); the
    environment is the first run's, and ``merged_from`` keeps each run's path, environment and
    models. Raises ValueError for a file that is not a prefill report, a model found in two
    runs, or runs whose settings (request counts, ``--quick``, method) differ. Cost: reads
    JSON; touches no GPU.
    """
    if len(paths) < 2:
        raise ValueError(f"--merge: expected at least two prefill.json files, got {len(paths)}")
    docs = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        if not isinstance(doc, dict) or doc.get("benchmark") != "prefill" or not isinstance(doc.get("results"), list):
            raise ValueError(f"--merge: expected a prefill.json written by gfxgraph.suites.prefill, got {p}")
        docs.append(doc)
    for key in _SAME:
        for p, doc in zip(paths[1:], docs[1:]):
            if doc.get(key) != docs[0].get(key):
                raise ValueError(f"--merge: {p} was run with {key}={doc.get(key)!r}, {paths[0]} with "
                                 f"{docs[0].get(key)!r}: expected runs of the same settings")
    results = [r for doc in docs for r in doc["results"]]
    models = [r.get("model") for r in results]
    twice = sorted({m for m in models if models.count(m) > 1})
    if twice:
        raise ValueError(f"--merge: expected each model in one run only, got {', '.join(map(str, twice))} twice")
    extra = {"method": docs[0].get("method"), "quick": docs[0].get("quick"), "plot": plot(results, out_dir),
             "results": results, "requests": docs[0].get("requests"),
             "merged_from": [{"path": str(p), "environment": doc.get("environment"),
                              "models": [r.get("model") for r in doc["results"]]} for p, doc in zip(paths, docs)]}
    return write(out_dir, "prefill", figures_of(results), extra, env=docs[0].get("environment"))
