"""`gfxgraph bench --render`: the series each suite's charts take from its JSON (no matplotlib
needed), and the PNGs drawn from the committed results (skipped without matplotlib)."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest

from conftest import REPO
from gfxgraph.bench import render_results
from gfxgraph.bench_charts import (
    SUITE_CHARTS,
    BarPanel,
    LinePanel,
    charts,
    decode_floor_ms,
    decode_series,
    peak_bandwidth,
)

RESULTS = REPO / "benchmarks" / "results"


def _doc(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _series(panel: LinePanel) -> dict[str, tuple]:
    return {s.key: s.points for s in panel.series}


def _bars(panel: BarPanel) -> dict[str, float]:
    return {label: value for label, _, value in panel.bars}


def test_llm_decode_ms_per_token_per_mode_against_batch_size():
    doc = _doc("llm_decode")
    speed = next(c for c in charts(doc) if c.stem == "llm_decode")
    big = speed.panels[0]
    assert isinstance(big, LinePanel) and big.title.startswith("llama-1.2b")
    got = _series(big)
    assert list(got) == ["eager", "hand", "pool", "backend", "reduce-overhead", "floor"]
    res = doc["results"]["llama-1.2b"]
    for key, mode in (("eager", "eager"), ("hand", "hand_captured"), ("pool", "gfxgraph_pool"),
                      ("backend", "backend_gfxgraph"), ("reduce-overhead", "reduce_overhead")):
        assert got[key] == tuple((float(b), res[f"bs{b}"][mode]["ms_per_token"]) for b in (1, 8, 32))
    floor = res["params"] * 2 / 4.8e12 * 1e3  # bf16 weights over the H200's 4.8 TB/s
    assert got["floor"] == ((1.0, pytest.approx(floor)), (32.0, pytest.approx(floor)))
    assert [s.reference for s in big.series] == [False] * 5 + [True]
    small = _series(speed.panels[1])  # no compile modes ran on the small model
    assert list(small) == ["eager", "hand", "pool", "floor"]


def test_llm_decode_warmup_only_where_a_compile_mode_ran():
    doc = _doc("llm_decode")
    warm = next(c for c in charts(doc) if c.stem == "llm_decode_warmup")
    assert len(warm.panels) == 1 and warm.panels[0].title.startswith("llama-1.2b")
    got = _series(warm.panels[0])
    assert "eager" not in got and "floor" not in got
    assert got["reduce-overhead"][0] == (1.0, doc["results"]["llama-1.2b"]["bs1"]["reduce_overhead"]["setup_s"])
    assert warm.panels[0].logy  # milliseconds of capture beside seconds of compilation


def test_decode_floor_needs_a_known_device_or_the_json_value():
    cfg = {"params": 1_000_000_000, "bs1": {"eager": {"ms_per_token": 5.0}}}
    assert decode_floor_ms(cfg, "Some Unknown GPU") is None
    assert [s.key for s in decode_series(cfg, "Some Unknown GPU")] == ["eager"]
    assert decode_floor_ms(cfg, "NVIDIA H100 80GB HBM3") == pytest.approx(2e9 / 3.35e12 * 1e3)
    assert decode_floor_ms({**cfg, "weight_floor_ms": 0.5}, None) == 0.5
    assert peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12 and peak_bandwidth(None) is None


def test_shape_bucketing_bars_without_a_sweep_lines_with_one():
    doc = _doc("shape_bucketing")
    doc.pop("per_batch_ms", None)
    steady, total = charts(doc)
    assert (steady.stem, total.stem) == ("shape_bucketing", "shape_bucketing_total")
    v = {f["name"]: f["value"] for f in doc["figures"]}
    bars = _bars(steady.panels[0])
    assert bars["eager"] == v["eager, per call"]
    assert bars["gfxgraph ShapeBucketPool"] == v["ShapeBucketPool (20 buckets), per call"]
    assert len(bars) == 4
    first_pass, memory = total.panels
    assert _bars(first_pass)['compile(mode="reduce-overhead")'] == \
        v["reduce-overhead total for the stream (compile + recording)"]
    assert _bars(memory)['compile(mode="reduce-overhead")'] == v["reduce-overhead graph memory (all its pools)"]
    doc["per_batch_ms"] = {"pool": {"8": 0.1, "1": 0.05, "24": 0.2}, "eager": {"1": 0.3, "8": 0.4}}
    lines = charts(doc)[0].panels[0]
    assert isinstance(lines, LinePanel)
    assert _series(lines) == {"eager": ((1.0, 0.3), (8.0, 0.4)), "pool": ((1.0, 0.05), (8.0, 0.1), (24.0, 0.2))}


def test_compile_backend_per_contender_and_a_failed_one_dropped():
    doc = _doc("compile_backend")
    steady, total = charts(doc)
    res = doc["results"]
    lines = _series(steady.panels[0])  # the committed run has a per-batch sweep: lines against batch size
    assert set(lines) == {"eager", "backend", "reduce-overhead", "default", "pool"}
    assert lines["backend"] == tuple((float(b), v) for b, v in sorted(res["gfxgraph"]["per_batch_ms"].items(),
                                                                          key=lambda kv: float(kv[0])))
    assert _bars(total.panels[0])['compile(backend="gfxgraph")'] == res["gfxgraph"]["total_s"]
    assert _bars(total.panels[1])['compile(mode="reduce-overhead")'] == res["reduce-overhead"]["graph_bytes"] / 2**20
    broken = copy.deepcopy(doc)
    broken["results"]["default"] = {"contender": "default", "error": "timed out"}
    assert 'compile(mode="default")' not in _bars(charts(broken)[1].panels[0])
    broken["results"]["gfxgraph"]["per_batch_ms"] = {"1": 0.1, "2": 0.11}
    lines = charts(broken)[0].panels[0]
    assert isinstance(lines, LinePanel) and _series(lines)["backend"] == ((1.0, 0.1), (2.0, 0.11))
    assert "default" not in _series(lines)  # the failed contender has no line


def test_replay_overhead_bars_with_quartiles():
    doc = _doc("replay_overhead")
    (chart,) = charts(doc)
    panel = chart.panels[0]
    assert [b[2] for b in panel.bars] == [doc["figures"][0]["value"], doc["figures"][1]["value"]]
    q = doc["raw_us_samples_quartiles"]
    assert panel.errors[0] == (q[0], q[2])


def test_a_missing_figure_drops_its_bar_not_the_chart():
    doc = _doc("tier2")
    doc["figures"] = [f for f in doc["figures"] if "ctypes" not in f["name"]]
    launch = charts(doc)[0].panels[0]
    assert len(launch.bars) == 3 and all("ctypes" not in label for label, _, _ in launch.bars)
    doc["figures"] = []
    assert charts(doc) == []


def test_unknown_suite_gets_one_bar_chart_of_its_main_unit():
    doc = {"benchmark": "some_new_suite", "environment": {}, "figures": [
        {"name": "a", "value": 3.0, "unit": "us", "target": None, "pass": None},
        {"name": "b", "value": 4.0, "unit": "us", "target": None, "pass": None},
        {"name": "c", "value": 1.0, "unit": "ms", "target": None, "pass": None},
        {"name": "ratio", "value": 1.1, "unit": "", "target": "<= 2", "pass": True}]}
    (chart,) = charts(doc)
    assert chart.stem == "some_new_suite"
    assert chart.panels[0].bars == (("a", "default", 3.0), ("b", "default", 4.0))
    assert charts({"benchmark": "x", "environment": {}, "figures": doc["figures"][3:]}) == []


def test_every_committed_result_has_its_charts():
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        made = charts(doc)
        stems = [c.stem for c in made]
        assert len(stems) == len(set(stems)), path.name
        if doc["benchmark"] == "reliability":
            assert made == []  # its table is the result
        else:
            assert doc["benchmark"] in SUITE_CHARTS and stems[0] == doc["benchmark"], path.name
            assert all(c.caption.endswith(".") for c in made)


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_render_draws_readable_pngs_from_the_committed_results(tmp_path: Path):
    pytest.importorskip("matplotlib")
    assert render_results(str(RESULTS), str(tmp_path)) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    expected = sorted(f"{c.stem}.png" for p in RESULTS.glob("*.json") for c in charts(json.loads(p.read_text())))
    assert pngs == expected
    for name in pngs:
        width, height = _png_size(tmp_path / name)
        assert width == 800 and 200 <= height <= 600, (name, width, height)
    md = (tmp_path / "llm_decode.md").read_text()
    assert "| figure | value | target | result |" in md and "![" in md and "(llm_decode.png)" in md
    assert (tmp_path / "reliability.md").is_file() and not (tmp_path / "reliability.png").exists()


def test_render_without_matplotlib_still_writes_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import gfxgraph.bench_draw as draw

    monkeypatch.setattr(draw, "_pyplot", lambda: None)
    assert render_results(str(RESULTS), str(tmp_path)) == 0
    assert not list(tmp_path.glob("*.png"))
    assert "![" not in (tmp_path / "llm_decode.md").read_text()


def test_device_generate_one_bar_panel_per_model_and_batch():
    r = {"eager": {"tokens_per_s": 100.0}, "pool": {"tokens_per_s": 300.0}, "device K=16": {"tokens_per_s": 350.0},
         "eos_token_id": 7}
    (chart,) = charts({"benchmark": "device_generate", "results": {"llama-small bs1": r, "llama-small bs4": r}})
    assert [p.title for p in chart.panels] == ["llama-small, bs 1", "llama-small, bs 4"]
    assert chart.panels[0].bars == (("eager", "eager", 100.0), ("pool", "pool", 300.0),
                                    ("device K=16", "device", 350.0))


def test_prefill_lines_of_median_latency_per_length_bin():
    doc = {"benchmark": "prefill", "results": [{"model": "m", "stream_lengths": [3, 10, 100, 700],
                                                 "eager": {"stream_ms": [1.0, 3.0, 5.0, 9.0]},
                                                 "piecewise": {"stream_ms": [0.1, 0.2, 0.5, 0.9]},
                                                 "default": {"error": "timed out"}}]}
    (chart,) = charts(doc)
    assert _series(chart.panels[0]) == {"eager": ((64.0, 3.0), (128.0, 5.0), (1024.0, 9.0)),
                                        "piecewise": ((64.0, 0.2), (128.0, 0.5), (1024.0, 0.9))}
