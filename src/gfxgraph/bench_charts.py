"""What ``gfxgraph bench --render`` plots, read from a suite's JSON; no matplotlib needed here.

:func:`charts` turns one benchmark document (the JSON a suite writes) into a few
:class:`Chart` objects: plain data (panels of lines or bars, labels with units, a caption)
that :mod:`gfxgraph.bench_draw` draws. Each suite with a plot people look for has its own
function in :data:`SUITE_CHARTS`, driven by the figure names and result keys its JSON holds: a
figure missing from the JSON drops its bar or line, not the chart. Any other suite gets one
generic bar chart of the figures in its most common unit (none when it has no such figures).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Series", "LinePanel", "BarPanel", "Chart", "charts", "SUITE_CHARTS", "peak_bandwidth", "MODE_LABELS"]

# Mode keys name the same thing in every chart (the renderer gives each key one colour).
MODE_LABELS = {
    "eager": "eager",
    "hand": "hand-captured torch.cuda.graph",
    "pool": "gfxgraph ShapeBucketPool",
    "backend": 'compile(backend="gfxgraph")',
    "reduce-overhead": 'compile(mode="reduce-overhead")',
    "default": 'compile(mode="default")',
    "floor": "weight-streaming floor",
    "device": "gfxgraph DeviceDecodeLoop (EOS on the device)",
    "piecewise": 'compile(backend="gfxgraph", piecewise)',
    "backend-regions": 'compile(backend="gfxgraph"), layers one region',
    "backend-saved": "saved frame (cache.save_compiled, load_compiled)",
}
# prompt-length bins of the prefill chart (the prefill suite's)
_PREFILL_BINS = ((1, 64), (65, 128), (129, 256), (257, 512), (513, 1024))

# Peak HBM bandwidth (bytes/s, vendor data sheets), longest name first so "H100 PCIe" wins over "H100".
_PEAK_BANDWIDTH = (("H100 PCIe", 2.0e12), ("MI300X", 5.3e12), ("MI250X", 3.2e12), ("A100", 2.0e12),
                   ("H200", 4.8e12), ("H100", 3.35e12), ("B200", 8.0e12), ("L40S", 0.864e12))


@dataclass(frozen=True)
class Series:
    """One line: ``points`` (x, y) in x order; ``key`` picks its colour; ``reference``: a dashed bound."""

    label: str
    key: str
    points: tuple[tuple[float, float], ...]
    reference: bool = False


@dataclass(frozen=True)
class LinePanel:
    """Lines against a shared x axis; labels carry the units."""

    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    logx: bool = False
    logy: bool = False
    unit: str = ""  # of y, for the value written beside a reference line


@dataclass(frozen=True)
class BarPanel:
    """Horizontal bars, one per (label, key, value); ``errors``: (low, high) per bar or None."""

    title: str
    xlabel: str
    bars: tuple[tuple[str, str, float], ...]
    log: bool = False
    errors: tuple[tuple[float, float], ...] | None = None


@dataclass(frozen=True)
class Chart:
    """One PNG, ``stem``.png: a title (the renderer adds device and date), panels, one caption sentence."""

    stem: str
    title: str
    panels: tuple[LinePanel | BarPanel, ...]
    caption: str
    legend: bool = field(default=True)


def peak_bandwidth(device: str | None) -> float | None:
    """The data-sheet peak memory bandwidth of ``device`` (bytes/s), None when it is not in the table."""
    for name, bw in _PEAK_BANDWIDTH:
        if device and name.lower() in device.lower():
            return bw
    return None


def _values(doc: dict[str, Any]) -> dict[str, float]:
    return {f["name"]: float(f["value"]) for f in doc.get("figures", [])
            if isinstance(f.get("value"), (int, float)) and not isinstance(f.get("value"), bool)}


def _bars(values: dict[str, float], wanted: list[tuple[str, str, str]], scale: float = 1.0
          ) -> tuple[tuple[str, str, float], ...]:
    """(label, key, value) for each (figure name, label, key) the document has."""
    return tuple((label, key, values[name] * scale) for name, label, key in wanted if name in values)


def _spread(values: list[float]) -> bool:
    positive = [v for v in values if v > 0]
    return len(positive) > 1 and max(positive) / min(positive) > 30


def _sized(points: dict[str, Any] | None) -> tuple[tuple[float, float], ...]:
    """``{"8": ms, ...}`` as sorted (batch size, ms) points."""
    if not isinstance(points, dict):
        return ()
    return tuple(sorted((float(k), float(v)) for k, v in points.items() if isinstance(v, (int, float))))


# --------------------------------------------------------------------- llm_decode
_DECODE_MODES = (("eager", "eager"), ("hand_captured", "hand"), ("gfxgraph_pool", "pool"),
                 ("backend_gfxgraph", "backend"), ("reduce_overhead", "reduce-overhead"))


def _per_batch(cfg: dict[str, Any], mode: str, metric: str) -> tuple[tuple[float, float], ...]:
    pts = []
    for key, case in cfg.items():
        m = re.fullmatch(r"bs(\d+)", key)
        if m and isinstance(case, dict) and isinstance(case.get(mode, {}).get(metric), (int, float)):
            pts.append((float(m.group(1)), float(case[mode][metric])))
    return tuple(sorted(pts))


def decode_floor_ms(cfg: dict[str, Any], device: str | None) -> float | None:
    """Milliseconds to read every bf16 weight once at peak bandwidth (the JSON's ``weight_floor_ms`` if given)."""
    if isinstance(cfg.get("weight_floor_ms"), (int, float)):
        return float(cfg["weight_floor_ms"])
    bw = peak_bandwidth(device)
    if bw is None or not isinstance(cfg.get("params"), (int, float)):
        return None
    return cfg["params"] * 2 / bw * 1e3


def decode_series(cfg: dict[str, Any], device: str | None, metric: str = "ms_per_token") -> tuple[Series, ...]:
    """One series per decode mode the config ran (ms/token against batch size), plus the floor."""
    out = [Series(MODE_LABELS[key], key, pts) for mode, key in _DECODE_MODES
           if (pts := _per_batch(cfg, mode, metric))]
    floor = decode_floor_ms(cfg, device) if metric == "ms_per_token" else None
    sizes = sorted({x for s in out for x, _ in s.points})
    if floor is not None and sizes:
        out.append(Series(f"{MODE_LABELS['floor']} (bf16 weights read once at peak bandwidth)", "floor",
                          ((sizes[0], floor), (sizes[-1], floor)), reference=True))
    return tuple(out)


def _line(title: str, xlabel: str, ylabel: str, series: tuple[Series, ...], unit: str = "") -> LinePanel:
    """Lines against batch size: a few sizes on a log-2 axis, a dense sweep on a linear one; log y
    when the values span more than 30x."""
    ys = [y for s in series for _, y in s.points]
    few = max((len(s.points) for s in series), default=0) <= 12
    return LinePanel(title, xlabel, ylabel + (" (log)" if _spread(ys) else ""), series, logx=few,
                     logy=_spread(ys), unit=unit)


def _decode_title(name: str, cfg: dict[str, Any]) -> str:
    params = cfg.get("params")
    return f"{name} ({params / 1e9:.2f} B params)" if isinstance(params, (int, float)) else name


def llm_decode_charts(doc: dict[str, Any]) -> list[Chart]:
    results = doc.get("results")
    if not isinstance(results, dict):
        return []
    device = doc.get("environment", {}).get("device")
    cfgs = {n: c for n, c in results.items() if isinstance(c, dict)}
    speed = tuple(_line(_decode_title(n, c), "batch size", "ms per decode step (ms/token)",
                        decode_series(c, device), unit="ms") for n, c in cfgs.items())
    # warm-up where a compile mode ran (capture alone takes milliseconds everywhere), else everywhere
    compiled = {n: c for n, c in cfgs.items() if _per_batch(c, "reduce_overhead", "setup_s")} or cfgs
    warm = tuple(_line(_decode_title(n, c), "batch size", "seconds",
                       tuple(s for s in decode_series(c, device, "setup_s") if s.key != "eager"))
                 for n, c in compiled.items())
    return [
        Chart("llm_decode", "Greedy decode, ms per step against batch size", _nonempty(speed),
              "Time per decode step (every sequence of the batch gets one token) for each mode, with the "
              "time to read the weights once at the device's peak memory bandwidth as a floor."),
        Chart("llm_decode_warmup", "Set-up before decoding: capture, or compile and record", _nonempty(warm),
              "Seconds from the first call to a graphed step ready to decode, per mode and batch size."),
    ]


# ------------------------------------------------------- shape_bucketing, compile_backend
def _stream_panel(series: tuple[Series, ...], bars: tuple[tuple[str, str, float], ...], calls: Any
                  ) -> LinePanel | BarPanel:
    if series:
        return _line("steady state, per call, at each batch size", "batch size", "ms per call", series)
    over = f"the {calls}-call stream" if calls else "the stream"
    return BarPanel(f"steady state, per call, mean over {over}", "ms per call", bars)


def shape_bucketing_charts(doc: dict[str, Any]) -> list[Chart]:
    v, per = _values(doc), doc.get("per_batch_ms") or {}
    keys = (("eager", "eager", "eager"), ("hand-written", "hand-written bucket loop", "hand"),
            ("pool", MODE_LABELS["pool"], "pool"), ("reduce-overhead", MODE_LABELS["reduce-overhead"],
                                                    "reduce-overhead"))
    series = tuple(Series(label, key, pts) for mode, label, key in keys if (pts := _sized(per.get(mode))))
    steady = _bars(v, [("eager, per call", "eager", "eager"),
                       ("hand-written bucket loop (20 buckets), per call", "hand-written bucket loop", "hand"),
                       ("ShapeBucketPool (20 buckets), per call", MODE_LABELS["pool"], "pool"),
                       ("reduce-overhead, per call (steady state)", MODE_LABELS["reduce-overhead"],
                        "reduce-overhead")])
    total = _bars(v, [("pool total for the stream (capture + first pass)", MODE_LABELS["pool"], "pool"),
                      ("reduce-overhead total for the stream (compile + recording)", MODE_LABELS["reduce-overhead"],
                       "reduce-overhead")])
    memory = _bars(v, [("graph pool, 36 buckets shared", "pool, 36 buckets in one pool", "pool"),
                       ("graph pool, largest bucket alone", "pool, largest bucket alone", "pool"),
                       ("reduce-overhead graph memory (all its pools)", MODE_LABELS["reduce-overhead"],
                        "reduce-overhead")])
    return _stream_charts("shape_bucketing", _stream_panel(series, steady, doc.get("calls")), total, memory,
                          doc.get("calls"))


def compile_backend_charts(doc: dict[str, Any]) -> list[Chart]:
    res = doc.get("results") or {}
    keys = (("gfxgraph", "backend"), ("reduce-overhead", "reduce-overhead"), ("default", "default"),
            ("pool-eager", "pool"))
    ok = {c: res[c] for c, _ in keys if isinstance(res.get(c), dict) and "error" not in res[c]}
    series = [Series(MODE_LABELS[k], k, pts) for c, k in keys if c in ok and (pts := _sized(ok[c].get("per_batch_ms")))]
    if "pool-eager" in ok and (pts := _sized(ok["pool-eager"].get("eager_per_batch_ms"))):
        series.insert(0, Series("eager", "eager", pts))
    steady = tuple((MODE_LABELS[k], k, float(ok[c]["steady_ms"])) for c, k in keys if c in ok)
    if "pool-eager" in ok and isinstance(ok["pool-eager"].get("eager_ms"), (int, float)):
        steady = (("eager", "eager", float(ok["pool-eager"]["eager_ms"])), *steady)
    total = tuple((MODE_LABELS[k], k, float(ok[c]["total_s"])) for c, k in keys if c in ok)
    memory = tuple((MODE_LABELS[k], k, ok[c]["graph_bytes"] / 2**20) for c, k in keys
                   if c in ok and isinstance(ok[c].get("graph_bytes"), (int, float)))
    calls = doc.get("calls")
    return _stream_charts("compile_backend", _stream_panel(tuple(series), steady, calls), total, memory, calls)


def _stream_charts(stem: str, steady: LinePanel | BarPanel, total: tuple, memory: tuple, calls: Any) -> list[Chart]:
    what = "at each batch size" if isinstance(steady, LinePanel) else "averaged over the stream"
    return [
        Chart(stem, "Dynamic batch sizes: time per call", _nonempty((steady,)),
              f"Steady-state time per call {what}, once every graph is captured or compiled."),
        Chart(f"{stem}_total", f"The whole {f'{calls}-call ' if calls else ''}stream, and graph memory",
              _nonempty((BarPanel("first pass, capture and compile included",
                                  "seconds" + (" (log)" if _spread([b[2] for b in total]) else ""), total,
                                  log=_spread([b[2] for b in total])),
                         BarPanel("graph memory", "MiB", memory))),
              "Left: seconds for the first pass over the stream, capture or compilation included; "
              "right: graph-pool memory held afterwards.", legend=False),
    ]


# ------------------------------------------------------------------ small suites
def replay_overhead_charts(doc: dict[str, Any]) -> list[Chart]:
    v = _values(doc)
    wanted = [("raw torch.cuda.CUDAGraph replay (host)", "torch.cuda.CUDAGraph.replay()", "hand",
               "raw_us_samples_quartiles"),
              ("BridgedCUDAGraph replay (host, stats on)", "BridgedCUDAGraph.replay(), stats on", "pool",
               "bridged_us_samples_quartiles")]
    bars, errors = [], []
    for name, label, key, quart in wanted:
        if name in v:
            bars.append((label, key, v[name]))
            q = doc.get(quart)
            errors.append((q[0], q[2]) if isinstance(q, list) and len(q) == 3 else (v[name], v[name]))
    ratio = v.get("bridged / raw")
    title = "median host time per replay; whiskers: quartiles of the batches" + (
        f"; ratio {ratio:.3f}" if ratio is not None else "")
    panel = BarPanel(title, "microseconds", tuple(bars), errors=tuple(errors))
    return [Chart("replay_overhead", "Host time per replay of a 1-kernel graph", _nonempty((panel,)),
                  "What one replay costs the host, PyTorch's graph against gfxgraph's.", legend=False)]


def conditional_charts(doc: dict[str, Any]) -> list[Chart]:
    v = _values(doc)
    loop = _bars(v, [("WHILE (native node), 64 iterations", "device WHILE node", "pool"),
                     ("host loop, eager body + .item() per iteration", "host loop, eager + .item()", "eager"),
                     ("host-driven strategy, step graph + .item() per iteration", "step graph + .item()", "hand"),
                     ("64 iterations unrolled in one graph", "64 iterations unrolled", "default")])
    branch = _bars(v, [("branch captured unconditionally, per replay", "branch, unconditional", "hand"),
                       ("setter + IF node around the branch, per replay", "IF node, taken", "pool"),
                       ("IF replay with the predicate false (branch skipped)", "IF node, skipped", "default"),
                       ("SWITCH (4 branches, device selector), per call", "SWITCH of 4", "pool"),
                       ("per-branch dispatch after a host read, per call", "host read + dispatch", "eager")])
    return [Chart("conditional", "Control flow decided on the device",
                  _nonempty((BarPanel("a 64-iteration loop", "microseconds per run", loop),
                             BarPanel("branches", "microseconds per call", branch))),
                  "Left: one run of a 64-iteration loop; right: a branch with and without an IF node, and a "
                  "4-way SWITCH against a host read and dispatch.", legend=False)]


def tier2_charts(doc: dict[str, Any]) -> list[Chart]:
    v = _values(doc)
    launch = _bars(v, [("pipeline: torch replay() host time", "torch replay()", "hand"),
                       ("pipeline: LaunchPipeline.launch() host time (cuda-bindings)", "pipeline (cuda-bindings)",
                        "pool"),
                       ("pipeline: LaunchPipeline.launch() host time (ctypes, HIP code path)", "pipeline (ctypes)",
                        "backend"),
                       ("pipeline: raw GraphExec.launch host time", "raw GraphExec.launch", "default")])
    update = _bars(v, [("exec update: GraphExecUpdate host time", "exec update", "pool"),
                       ("exec update: instantiate + destroy host time", "instantiate + destroy", "eager")])
    return [Chart("tier2", "Launch and update, host time",
                  _nonempty((BarPanel("host time per launch", "microseconds", launch),
                             BarPanel("changing a 120-kernel graph", "microseconds", update))),
                  "Left: host time per launch of a 1-kernel graph; right: updating an instantiated graph "
                  "in place against instantiating it again.", legend=False)]


def generic_charts(doc: dict[str, Any]) -> list[Chart]:
    """One bar chart of the figures in the document's most common unit (at most 12); none without units."""
    figs = [f for f in doc.get("figures", []) if f.get("unit") and isinstance(f.get("value"), (int, float))
            and not isinstance(f.get("value"), bool)]
    if not figs:
        return []
    unit = Counter(f["unit"] for f in figs).most_common(1)[0][0]
    bars = tuple((f["name"], "default", float(f["value"])) for f in figs if f["unit"] == unit)[:12]
    panel = BarPanel(f"figures in {unit}", unit, bars, log=_spread([b[2] for b in bars]))
    return [Chart(str(doc.get("benchmark", "benchmark")), f"{doc.get('benchmark', 'benchmark')}: figures in {unit}",
                  (panel,), f"The suite's figures measured in {unit}.", legend=False)]


def hf_generate_charts(doc: dict[str, Any]) -> list[Chart]:
    res = doc.get("results", {})
    modes = (("eager", "generate(), eager", "eager"), ("gfxgraph", "generate(), gfxgraph.hf.compile_config()", "backend"),
             ("reduce-overhead", "generate(), CompileConfig() (reduce-overhead)", "reduce-overhead"),
             ("decoder", "gfxgraph.hf.StaticCacheDecoder", "pool"))
    series = tuple(Series(label, key, _per_batch({k: {mode: v} for k, v in res.get(mode, {}).items()}, mode,
                                                 "ms_per_token")) for mode, label, key in modes)
    first = tuple((label, key, float(res[mode]["bs1"]["first_call_s"])) for mode, label, key in modes
                  if isinstance(res.get(mode, {}).get("bs1", {}).get("first_call_s"), (int, float)))
    panels = (_line("greedy decode, 128 new tokens", "batch size", "ms per token", tuple(s for s in series if s.points)),
              BarPanel("first call, bs 1 (compile + capture)", "seconds", first))
    return [Chart("hf_generate", "transformers generate(): gfxgraph against reduce-overhead", _nonempty(panels),
                  "Left: ms per token against batch size (5 is not a bucket); right: the first call's seconds.")]


def call_overhead_charts(doc: dict[str, Any]) -> list[Chart]:
    res = doc.get("results", {})
    keys = {"raw replay": "default", "hand-written loop": "hand", "pool": "pool", "pool copy_outputs=False": "pool",
            "pool zero-copy": "pool", "eager": "eager", "backend=gfxgraph": "backend",
            "backend=gfxgraph copy_outputs=False": "backend", 'backend="eager" (dynamo alone)': "default",
            "reduce-overhead": "reduce-overhead"}
    calls = res.get("calls", {}).get("batch 5 in bucket 8", {})
    call_bars = tuple((k, keys.get(k, "default"), float(v)) for k, v in calls.items() if isinstance(v, (int, float)))
    decode = res.get("decode", {}).get("bs1", {})
    decode_bars = tuple((k, keys.get(k.replace("hand-written graph", "hand-written loop"), "default"),
                         float(v["ms_per_token"])) for k, v in decode.items()
                        if isinstance(v, dict) and isinstance(v.get("ms_per_token"), (int, float)))
    panels = (BarPanel("per call, bs 5 in bucket 8", "host microseconds", call_bars, log=True),
              BarPanel("decode, host read per token, bs 1", "ms per token", decode_bars))
    return [Chart("call_overhead", "What a call costs the host", _nonempty(panels),
                  "Left: host time of one call of a 64x64 Linear per mode (log scale); right: a greedy decode "
                  "loop that reads every token on the host.", legend=False)]


def device_generate_charts(doc: dict[str, Any]) -> list[Chart]:
    keys = {"eager": "eager", "hand-written graph": "hand", "pool": "pool"}
    panels = []
    for case, r in doc.get("results", {}).items():
        bars = tuple((k, keys.get(k, "device"), float(v["tokens_per_s"])) for k, v in r.items()
                     if isinstance(v, dict) and isinstance(v.get("tokens_per_s"), (int, float)))
        panels.append(BarPanel(case.replace(" bs", ", bs "), "tokens per second", bars))
    title = "Generation, EOS checked every token (greedy and sampled)"
    return [Chart("device_generate", title, _nonempty(tuple(panels)),
                  "Tokens/s of 256 new tokens: per-token loops (one host read per token) against the device "
                  "loop (one launch and one read per K tokens).", legend=False)]


def prefill_charts(doc: dict[str, Any]) -> list[Chart]:
    keys = {"eager": "eager", "piecewise": "piecewise", "gfxgraph": "backend", "default": "default",
            "reduce-overhead": "reduce-overhead"}
    panels = []
    for res in doc.get("results", []):
        lengths, series = res.get("stream_lengths", []), []
        for mode, key in keys.items():
            ms = res.get(mode, {}).get("stream_ms") if isinstance(res.get(mode), dict) else None
            if not ms:
                continue
            points = []
            for lo, hi in _PREFILL_BINS:
                xs = sorted(m for m, n in zip(ms, lengths) if lo <= n <= hi)
                if xs:
                    points.append((float(hi), xs[len(xs) // 2]))
            series.append(Series(MODE_LABELS[key], key, tuple(points)))
        panels.append(_line(f"{res.get('model')}: prefill at batch 1", "prompt length (tokens, bin upper bound)",
                            "ms per request (median in the bin)", tuple(series)))
    return [Chart("prefill", "Prefill of prompts of every length", _nonempty(tuple(panels)),
                  "Steady latency per request against prompt length, one line per mode (reduce-overhead: the "
                  "first 60 requests only).")]


def _nonempty(panels: tuple) -> tuple:
    return tuple(p for p in panels if (p.series if isinstance(p, LinePanel) else p.bars))


def startup_charts(doc: dict[str, Any]) -> list[Chart]:
    """Seconds to the first graphed call per contender, cold beside warm (the start-up suite's runs)."""
    res = doc.get("results", {})
    order = ("pool", "backend", "backend-regions", "backend-saved", "reduce-overhead")  # then any other, as run
    rank = {c: i for i, c in enumerate(order)}
    bars = []
    for name, r in sorted(res.items(), key=lambda kv: rank.get(kv[0].rpartition(" ")[0], len(order))):
        contender, _, phase = name.rpartition(" ")
        if isinstance(r, dict) and isinstance(r.get("to_first_call_s"), (int, float)):
            bars.append((f"{MODE_LABELS.get(contender, contender)}, {phase}", contender, float(r["to_first_call_s"])))
    panel = BarPanel("process start to first graphed call (36 buckets)", "seconds", tuple(bars),
                     log=_spread([b[2] for b in bars]))
    return [Chart("startup", "Start-up: cold and warm processes", _nonempty((panel,)),
                  "Seconds from a fresh process to 36 decode-step buckets graphed and the first call served "
                  "(model build excluded); warm keeps PyTorch's compile caches, portable loads the saved file.")]


def device_launch_charts(doc: dict[str, Any]) -> list[Chart]:
    """Wall time per call against the row count n, one line per way of handling an n that lives on the GPU."""
    rows = doc.get("rows", {})
    ways = (("host read", "host read of n, then a pool call", "eager"),
            ("switch", "SWITCH node over the buckets", "default"),
            ("device", "pool.device_sized (device launch)", "device"),
            ("pool, n on host", "pool call, n already on the host", "pool"))
    series = tuple(Series(label, key, tuple((float(r["n"]), float(r["wall_us"])) for r in rows.get(name, [])))
                   for name, label, key in ways)
    panel = _line("8 buckets, bf16 MLP step", "rows n (bucket: the smallest of 1, 2, 4, 8, 16, 32, 48, 64 >= n)",
                  "microseconds per call (wall, 200 calls)", tuple(s for s in series if s.points))
    return [Chart("device_launch", "A batch size on the GPU: host read, SWITCH, device launch", _nonempty((panel,)),
                  "Wall time per call against n; lower is better.")]


SUITE_CHARTS: dict[str, Callable[[dict[str, Any]], list[Chart]]] = {
    "startup": startup_charts,
    "device_launch": device_launch_charts,
    "llm_decode": llm_decode_charts,
    "shape_bucketing": shape_bucketing_charts,
    "compile_backend": compile_backend_charts,
    "replay_overhead": replay_overhead_charts,
    "conditional": conditional_charts,
    "tier2": tier2_charts,
    "hf_generate": hf_generate_charts,
    "call_overhead": call_overhead_charts,
    "device_generate": device_generate_charts,
    "prefill": prefill_charts,
    "reliability": lambda doc: [],  # its table is the result; a chart of all-green bars says nothing more
}


def charts(doc: dict[str, Any]) -> list[Chart]:
    """The charts for one benchmark document: its suite's own, else the generic one; empty ones dropped."""
    make = SUITE_CHARTS.get(str(doc.get("benchmark")), generic_charts)
    return [c for c in make(doc) if c.panels]
