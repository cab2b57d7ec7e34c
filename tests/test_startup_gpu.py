"""Start-up on a GPU: gfxgraph.warmup over a compiled function's buckets, and a second process that loads
the first one's compile cache compiles nothing in inductor (its cache counters) and replays the same results."""

from __future__ import annotations

import textwrap

import pytest
import torch

import gfxgraph
from _cache_child import run_child
from hipgraph_bridge import _torch_compat
from hipgraph_bridge.startup import cache

pytestmark = pytest.mark.gpu

_CHILD = textwrap.dedent("""
    import json, sys, torch
    import gfxgraph
    from hipgraph_bridge.startup import cache
    mode, path = sys.argv[1], sys.argv[2]
    loaded = cache.load(path) if mode == "load" else {}
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).cuda().eval()
    f = torch.compile(mlp, backend="gfxgraph")
    x = torch.randn(3, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        rep = gfxgraph.warmup(f, x, buckets=[1, 2, 4, 8], progress=False)
        y = [f(x[:n]).float().cpu().flatten().tolist() for n in (1, 3)]
        ref = [mlp(x[:n]).float().cpu().flatten().tolist() for n in (1, 3)]
    saved = cache.save(path) if mode == "save" else {}
    print(json.dumps({"hits": cache.hits(), "loaded": loaded, "saved": saved, "graphs": rep.graphs,
                      "buckets": list(rep.buckets), "y": y, "ref": ref, "stats": gfxgraph.backend_stats()["graphs"]}))
""")


def _child(mode: str, path: str, cache_dir: str) -> dict:
    return run_child(_CHILD, mode, path, cache_dir, timeout=400)


@pytest.mark.skipif(not cache.supported(), reason="this torch has no save_cache_artifacts (added in 2.7)")
def test_warm_process_compiles_nothing_and_replays_the_cold_results(tmp_path):
    blob = str(tmp_path / "cache.bin")
    cold = _child("save", blob, str(tmp_path / "cold"))
    assert cold["buckets"] == [8, 4, 2, 1] and cold["graphs"] >= 4, cold
    assert cold["hits"]["fx_graph_miss"] >= 1 and cold["saved"].get("inductor", 0) >= 1, cold
    warm = _child("load", blob, str(tmp_path / "warm"))
    assert warm["hits"]["fx_graph_miss"] == 0 and warm["hits"]["fx_graph_hit"] >= 1, warm["hits"]
    assert warm["graphs"] == cold["graphs"]
    assert warm["y"] == cold["y"]  # the same kernels from the same cache: bit for bit
    for got, want in zip(warm["y"], warm["ref"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_warmup_of_a_pool_captures_every_bucket_largest_first():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).cuda().eval()
    pool = gfxgraph.ShapeBucketPool(lin, [2, 4, 8], progress=False)
    with torch.no_grad():
        rep = gfxgraph.warmup(pool, torch.randn(3, 16, device="cuda"), progress=False)
        assert rep.buckets == (8, 4, 2) and rep.graphs == 3 and rep.pool_bytes > 0
        assert pool.captured_buckets == [2, 4, 8]
        x = torch.randn(5, 16, device="cuda")
        torch.testing.assert_close(pool(x), lin(x), rtol=1e-4, atol=1e-5)


def test_one_frame_warms_every_size_from_one_trace_and_replays_eagers_results(tmp_path, monkeypatch):
    """warmup(one_frame=True) on the GPU: one dynamo frame for sizes 8..1, a graph per size, and each size's
    replay equal to eager (batch 1 included, served by the frame traced at 8)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # no entry traced with 0/1 guards
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).cuda().eval()
    f = torch.compile(mlp, backend="gfxgraph")
    x = torch.randn(3, 32, device="cuda")
    before = gfxgraph.backend_stats()["graphs"]
    with torch.no_grad():
        rep = gfxgraph.warmup(f, x, buckets=[1, 2, 4, 8], progress=False, one_frame=True)
        assert counters["stats"]["unique_graphs"] == 1
        assert rep.graphs >= 4 and gfxgraph.backend_stats()["graphs"] - before >= 4
        for n in (1, 3):
            torch.testing.assert_close(f(x[:n]), mlp(x[:n]), rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


_SAVED_CHILD = textwrap.dedent("""
    import json, sys, torch
    import gfxgraph
    from torch._dynamo.utils import counters

    def step(model, x, shift):  # two batched inputs, as a decode step's ids and positions
        return model(x) + shift

    mode, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).cuda().eval()
    x = torch.randn(3, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        shift = torch.arange(3, device="cuda", dtype=torch.float32).view(3, 1)
        f = (gfxgraph.cache.save_compiled(path, step, mlp, x, shift) if mode == "save"
             else gfxgraph.cache.load_compiled(path))
        rep = gfxgraph.warmup(f, mlp, x, shift, buckets=[1, 2, 4, 8], progress=False)
        y = [f(mlp, x[:n], shift[:n]).float().cpu().flatten().tolist() for n in (1, 3)]
        ref = [step(mlp, x[:n], shift[:n]).float().cpu().flatten().tolist() for n in (1, 3)]
    print(json.dumps({"hits": gfxgraph.cache.hits(), "frames": int(counters["frames"]["total"]), "graphs": rep.graphs,
                      "y": y, "ref": ref, "stats": gfxgraph.backend_stats()["graphed"]}))
""")


@pytest.mark.skipif(not _torch_compat.has_aot_precompile,
                    reason="this torch cannot save a compiled frame (aot_compile, torch >= 2.10)")
def test_a_loaded_frame_traces_nothing_compiles_nothing_and_replays_the_saving_processs_results(tmp_path):
    """save_compiled in one process, load_compiled in a second one (same inductor folder): the second runs no
    dynamo, hits inductor's cache for every graph, captures the same buckets and replays the same numbers."""
    path = str(tmp_path / "mlp.frame")
    cold = run_child(_SAVED_CHILD, "save", path, str(tmp_path / "inductor"), timeout=400)
    # two frames (batch 2 and up, symbolic; batch 1): a graph per bucket between them
    assert cold["graphs"] >= 4 and cold["stats"] == 2 and cold["hits"]["fx_graph_miss"] >= 1, cold
    warm = run_child(_SAVED_CHILD, "load", path, str(tmp_path / "inductor"), timeout=400)
    assert warm["frames"] == 0, "dynamo traced a frame in the process that loaded the saved one"
    assert warm["hits"]["fx_graph_miss"] == 0 and warm["hits"]["fx_graph_hit"] >= 1, warm["hits"]
    assert warm["graphs"] == cold["graphs"] and warm["stats"] == 2
    assert warm["y"] == cold["y"]  # the same kernels, the same graphs: bit for bit
    for got, want in zip(warm["y"], warm["ref"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
