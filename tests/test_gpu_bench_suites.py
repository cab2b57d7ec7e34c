"""The shipped suites on a GPU, run as ``python -m gfxgraph.suites.NAME`` from outside the checkout
(short settings: these check that each suite runs from the package and writes what its charts
read, not the figures themselves)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SRC
from gfxgraph.bench_charts import LinePanel, charts

pytestmark = pytest.mark.gpu


def _run(tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=timeout)
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def _suite(tmp_path: Path, name: str, *args: str, timeout: int = 600) -> dict:
    _run(tmp_path, "-m", f"gfxgraph.suites.{name}", "--out", str(tmp_path / "out"), *args, timeout=timeout)
    return json.loads((tmp_path / "out" / f"{name}.json").read_text())


def test_shape_bucketing_writes_its_per_batch_sweep(tmp_path: Path):
    from gfxgraph.suites.shape_bucketing import SWEEP

    doc = _suite(tmp_path, "shape_bucketing", "--quick")
    per = doc["per_batch_ms"]
    assert sorted(per) == ["eager", "hand-written", "pool", "reduce-overhead"]
    for mode, points in per.items():
        assert list(points) == [str(n) for n in SWEEP], mode
        assert all(v > 0 for v in points.values()), mode
    assert len(doc["figures"]) == 18
    assert isinstance(charts(doc)[0].panels[0], LinePanel)


@pytest.mark.slow
def test_compile_backend_children_run_from_the_package(tmp_path: Path):
    from gfxgraph.suites.shape_bucketing import SWEEP

    doc = _suite(tmp_path, "compile_backend", "--quick")
    for name, res in doc["results"].items():
        assert "error" not in res, (name, res.get("error"), res.get("stderr_tail"))
        assert len(res["per_batch_ms"]) == len(SWEEP), name
    assert len(doc["results"]["pool-eager"]["eager_per_batch_ms"]) == len(SWEEP)
    steady = charts(doc)[0].panels[0]
    assert isinstance(steady, LinePanel) and len(steady.series) == 5  # eager + 4 contenders


def test_bench_command_runs_a_suite_and_renders_it(tmp_path: Path):
    _run(tmp_path, "-m", "gfxgraph", "bench", "--suite", "replay_overhead", "--out", str(tmp_path / "b"))
    out = tmp_path / "b"
    assert (out / "replay_overhead.json").is_file() and (out / "summary.md").is_file()
    assert "| figure | value | target | result |" in (out / "replay_overhead.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "replay_overhead.png").is_file()


def test_tier2_runs_from_the_package(tmp_path: Path):
    doc = _suite(tmp_path, "tier2", "--quick")
    assert len(doc["figures"]) == 16
    assert charts(doc)[0].panels


def test_conditional_runs_from_the_package(tmp_path: Path):
    if importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("native conditional nodes need cuda-bindings (pip install 'gfxgraph[cuda]')")
    doc = _suite(tmp_path, "conditional", "--quick")
    assert len(doc["figures"]) == 20
    assert charts(doc)[0].panels


def test_llm_decode_small_model_from_the_package(tmp_path: Path):
    pytest.importorskip("transformers")
    doc = _suite(tmp_path, "llm_decode", "--models", "llama-small", "--batch", "1,3", "--steps", "8",
                 "--prompt", "8", "--no-compile")
    cfg = doc["results"]["llama-small"]
    assert sorted(cfg["bs3"]) == ["eager", "gfxgraph_pool", "gfxgraph_pool_copy", "hand_captured"]
    assert cfg["bs1"]["gfxgraph_pool"]["setup_s"] > 0
    assert [c.stem for c in charts(doc)] == ["llm_decode", "llm_decode_warmup"]


@pytest.mark.slow
def test_llm_decode_compile_modes_from_the_package(tmp_path: Path):
    pytest.importorskip("transformers")
    doc = _suite(tmp_path, "llm_decode", "--models", "llama-1.2b", "--batch", "1", "--compile-batch", "1",
                 "--steps", "8", "--prompt", "8")
    case = doc["results"]["llama-1.2b"]["bs1"]
    assert sorted(case) == ["backend_gfxgraph", "backend_gfxgraph_copy", "eager", "gfxgraph_pool",
                            "gfxgraph_pool_copy", "hand_captured", "reduce_overhead"]
    assert case["backend_gfxgraph"]["subgraphs"], "the backend compiled nothing"
    for mode in ("gfxgraph_pool", "backend_gfxgraph", "reduce_overhead"):
        assert case[mode]["max_abs_logit_diff"] <= 0.25, (mode, case[mode]["max_abs_logit_diff"])
    speed = charts(doc)[0].panels[0]
    assert {s.key for s in speed.series} >= {"eager", "hand", "pool", "backend", "reduce-overhead"}


def test_the_hand_step_graph_of_a_draw_keeps_its_settings_alive():
    """device_generate's own step graph of a sampling setting reads the draw's settings (temperature, k,
    the Philox key) by address; once other tensors take the memory the allocator freed, its replays must
    still draw what the chooser draws on the same logits (it did not while HandCaptured dropped the step)."""
    pytest.importorskip("transformers")
    import gc

    import torch

    from gfxgraph.suites.device_generate import SAMPLING, HandLoop, _draw_step
    from gfxgraph.suites.llm_decode import build_model, prefill
    from hipgraph_bridge.generation.sampling import SamplingParams, chooser

    settings, b, n = SAMPLING["sample top-k 50 top-p 0.9"], 4, 8
    model = build_model("llama-small")
    ids = torch.randint(0, model.config.vocab_size, (b, n), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(3))
    with torch.no_grad():
        hand = HandLoop(model, b, 64)
        own = _draw_step(hand, settings)
        gc.collect()
        junk = [torch.full((m,), 0x7F, dtype=torch.uint8, device="cuda") for m in range(1, 4096, 3)]
        for g in (hand.graph, own):
            g.ids.copy_(ids[:, -1:])
            g.pos.fill_(n)
            g.cp.fill_(n)
        drawn = {}
        for name, g in (("greedy", hand.graph), ("own", own)):
            hand.cache.reset()
            prefill(model, hand.cache, ids)
            g.g.replay()
            drawn[name] = (g.out[0] if name == "greedy" else g.out).clone()
        expected = chooser(SamplingParams(**settings), model.config.vocab_size, "cuda")(
            drawn["greedy"], torch.arange(b, device="cuda"), torch.full((), n, device="cuda"))
        del junk
    assert torch.equal(drawn["own"], expected), (drawn["own"].tolist(), expected.tolist())
