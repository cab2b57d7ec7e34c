"""Start-up helpers on the CPU: the warm-up's bookkeeping (sizes, rows, arguments, errors) and the compile
cache's round trip through PyTorch's portable artifacts, in fresh processes with empty cache folders."""

from __future__ import annotations

import gc
import importlib.metadata
import sys
import textwrap

import pytest
import torch

import gfxgraph
from hipgraph_bridge import _torch_compat
from _cache_child import run_child
from hipgraph_bridge.startup import WarmupReport, cache, resized, warmup
from gfxgraph.suites import startup


class Recorder:
    """Stands in for a compiled function: records each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.gc_enabled: list[bool] = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        self.gc_enabled.append(gc.isenabled())
        return args[0]


def test_a_compiled_function_is_called_once_per_bucket_largest_first_on_repeated_rows():
    f = Recorder()
    x = torch.arange(6.0).view(3, 2)
    table = torch.ones(3, 5)  # 3 rows, but static: it must not grow
    rep = warmup(f, x, table, buckets=[4, 1, 8, 4], static_args=[1], progress=False, scale=torch.full((3,), 7.0))
    assert [a[0].shape[0] for a, _ in f.calls] == [8, 4, 1]
    assert all(a[1] is table for a, _ in f.calls)
    assert [k["scale"].shape[0] for _, k in f.calls] == [8, 4, 1]
    big = f.calls[0][0][0]
    assert torch.equal(big, x[torch.arange(8) % 3])  # the example's rows, repeated cyclically
    assert f.gc_enabled == [False, False, False] and gc.isenabled()  # collector frozen only meanwhile
    assert isinstance(rep, WarmupReport) and rep.buckets == (8, 4, 1) and rep.graphs == 0 and rep.seconds >= 0
    assert "3 batch sizes" in str(rep)


def test_the_default_sizes_are_the_backends_default_buckets():
    f = Recorder()
    warmup(f, torch.zeros(2, 3), progress=False)
    assert [a[0].shape[0] for a, _ in f.calls] == sorted(gfxgraph.default_buckets(), reverse=True)


def test_batch_dim_other_than_zero_and_nested_arguments():
    f = Recorder()
    x = torch.randn(4, 2)  # batch in dim 1
    warmup(f, x, {"m": torch.randn(5, 2)}, buckets=[3], batch_dim=1, progress=False)
    (a, _), = f.calls
    assert a[0].shape == (4, 3) and a[1]["m"].shape == (5, 3)
    assert torch.equal(a[0], x[:, [0, 1, 0]])


def test_an_error_in_the_function_propagates_and_the_collector_is_back_on():
    def boom(x):
        raise RuntimeError("model failed")

    with pytest.raises(RuntimeError, match="model failed"):
        warmup(boom, torch.zeros(2, 2), buckets=[2], progress=False)
    assert gc.isenabled()


@pytest.mark.parametrize("kwargs, error", [
    ({"buckets": [0, 2]}, gfxgraph.ConfigError),
    ({"buckets": "8"}, gfxgraph.ConfigError),
    ({"batch_dim": "0"}, gfxgraph.ConfigError),
])
def test_bad_options_are_config_errors(kwargs, error):
    with pytest.raises(error):
        warmup(Recorder(), torch.zeros(2, 2), progress=False, **kwargs)


def test_an_example_without_a_batched_tensor_is_refused_naming_what_was_expected():
    with pytest.raises(TypeError, match="at least one tensor with a batch dimension"):
        warmup(Recorder(), 3, "x", buckets=[2], progress=False)
    with pytest.raises(TypeError, match="expected a ShapeBucketPool or a compiled function"):
        warmup(42, torch.zeros(2, 2), buckets=[2], progress=False)


def test_a_pool_warms_its_own_buckets():
    pool = gfxgraph.ShapeBucketPool(lambda x: x * 2, [2, 4], progress=False)
    with pytest.raises(gfxgraph.ConfigError, match="warms its own buckets"):
        warmup(pool, torch.zeros(3, 2), buckets=[8], progress=False)
    rep = warmup(pool, torch.zeros(3, 2), progress=False)
    assert rep.what == "ShapeBucketPool" and rep.buckets == (4, 2)
    assert rep.graphs == (2 if torch.cuda.is_available() else 0)  # no GPU: nothing to capture


def test_resized_leaves_other_sizes_and_non_tensors_alone():
    a, k = resized((torch.zeros(3, 1), torch.zeros(2, 1), 5), {"s": "x"}, 6, rows=3)
    assert a[0].shape == (6, 1) and a[1].shape == (2, 1) and a[2] == 5 and k == {"s": "x"}


# ----------------------------------------------------------------------------- compile cache
_CHILD = textwrap.dedent("""
    import json, sys, torch
    from hipgraph_bridge.startup import cache
    mode, path = sys.argv[1], sys.argv[2]
    refused = ""
    if mode == "save":  # before any compile there is nothing to save
        try:
            cache.save(path)
        except RuntimeError as exc:
            refused = str(exc)
    loaded = cache.load(path) if mode == "load" else {}
    # a matmul only: inductor calls an extern kernel and generates no C++, so no compiler runs (seconds)
    f = torch.compile(lambda x: x @ x.t(), backend="inductor")
    y = f(torch.linspace(-2, 2, 32).view(4, 8))
    saved = cache.save(path) if mode == "save" else {}
    print(json.dumps({"hits": cache.hits(), "loaded": loaded, "saved": saved, "y": y.flatten().tolist(),
                      "refused": refused}))
""")


def _child(mode: str, path: str, cache_dir: str) -> dict:
    return run_child(_CHILD, mode, path, cache_dir, timeout=300)


@pytest.mark.skipif(not cache.supported(), reason="this torch has no save_cache_artifacts (added in 2.7)")
def test_a_saved_cache_makes_a_fresh_process_skip_inductors_compile(tmp_path):
    blob = str(tmp_path / "compile-cache.bin")
    cold = _child("save", blob, str(tmp_path / "cold"))
    assert "compiled nothing" in cold["refused"]  # saving before the first compile is refused, naming why
    assert cold["hits"]["fx_graph_miss"] >= 1 and cold["saved"].get("inductor", 0) >= 1
    warm = _child("load", blob, str(tmp_path / "warm"))  # an empty cache folder: only the file can hit
    assert warm["loaded"].get("inductor", 0) >= 1
    assert warm["hits"]["fx_graph_miss"] == 0 and warm["hits"]["fx_graph_hit"] >= 1
    assert warm["y"] == cold["y"]


def test_a_torch_without_cache_artifacts_raises_not_implemented(monkeypatch, tmp_path):
    monkeypatch.setattr(_torch_compat, "has_cache_artifacts", False)
    with pytest.raises(NotImplementedError, match="added in 2.7"):
        _torch_compat.save_cache_artifacts()
    (tmp_path / "b").write_bytes(b"x")
    with pytest.raises(NotImplementedError, match="added in 2.7"):
        cache.load(tmp_path / "b")
    with pytest.raises(FileNotFoundError):
        cache.load(tmp_path / "missing")


def test_a_static_subgraph_compiled_on_a_later_call_is_cached_by_inductor(tmp_path, monkeypatch):
    """The backend compiles a static subgraph on a later call, with real tensors; inductor's FX graph cache
    and the AOTAutograd cache must key it (not bypass it: "No shape env"), so a warm process skips it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    import torch._dynamo

    from hipgraph_bridge._torch_compat import compile_cache_counters, maybe_mark_dynamic
    from hipgraph_bridge.compile.backend import register

    register()
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()

    def step(x):
        return lin(x).softmax(-1)

    f = torch.compile(step, backend="gfxgraph")
    before = compile_cache_counters()
    with torch.no_grad():
        x = torch.randn(16, 16)
        maybe_mark_dynamic(x, 0)
        f(x)
        for _ in range(4):  # batch 1 specialises: a static frame, compiled on a later call
            y = torch.randn(1, 16)
            torch.testing.assert_close(f(y), step(y))
    after = compile_cache_counters()
    assert after["fx_graph_bypass"] == before["fx_graph_bypass"]
    assert after["aot_autograd_bypass"] == before["aot_autograd_bypass"]
    assert after["fx_graph_miss"] - before["fx_graph_miss"] == 2  # the dynamic frame and the static one
    torch._dynamo.reset()


def _frames_for(one_frame: bool, cache_dir, monkeypatch) -> tuple[int, list]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    from hipgraph_bridge.compile.backend import register

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))  # no entry compiled the other way
    register()
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()

    def step(x):
        return lin(x).softmax(-1) * x.shape[0]

    f = torch.compile(step, backend="gfxgraph")
    with torch.no_grad():
        warmup(f, torch.randn(3, 16), buckets=[1, 2, 8], progress=False, one_frame=one_frame)
        got = [(f(x), step(x)) for x in (torch.randn(1, 16), torch.randn(5, 16))]
    frames = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return frames, got


def test_one_frame_serves_batch_1_from_the_largest_sizes_trace(tmp_path, monkeypatch):
    """Without it, dynamo traces batch 1 apart (0/1 specialisation); with it, one trace serves every size, and
    each size's result is eager's."""
    frames, got = _frames_for(False, tmp_path / "two", monkeypatch)
    assert frames == 2
    frames, got = _frames_for(True, tmp_path / "one", monkeypatch)
    assert frames == 1
    for compiled, eager in got:
        torch.testing.assert_close(compiled, eager)


def test_one_frame_is_checked_and_refused_where_it_cannot_apply(monkeypatch):
    with pytest.raises(gfxgraph.ConfigError, match="one_frame: expected a bool"):
        warmup(Recorder(), torch.zeros(2, 2), buckets=[2], progress=False, one_frame=1)
    pool = gfxgraph.ShapeBucketPool(lambda x: x * 2, [2, 4], progress=False)
    with pytest.raises(gfxgraph.ConfigError, match="runs no dynamo"):
        warmup(pool, torch.zeros(3, 2), progress=False, one_frame=True)
    import torch.fx.experimental._config as fx_config

    monkeypatch.delitem(fx_config._config, "backed_size_oblivious")
    f = Recorder()
    with pytest.raises(NotImplementedError, match="backed_size_oblivious"):
        warmup(f, torch.zeros(2, 2), buckets=[2], progress=False, one_frame=True)
    assert f.calls == []  # refused before any call


def test_compile_profile_reports_dynamos_timers_and_counters():
    """The start-up suite's children report where compile time went: dynamo's largest timers (seconds and
    calls) and its frame counters, read through the one module that holds private torch access."""
    from hipgraph_bridge._torch_compat import compile_profile

    torch._dynamo.reset()
    f = torch.compile(lambda x: x.sin() + 1, backend="eager")
    f(torch.ones(3))
    prof = compile_profile(top=3)
    assert len(prof["timers_s"]) <= 3 and all(v["s"] >= 0 and v["calls"] >= 1 for v in prof["timers_s"].values())
    assert prof["frames"].get("ok", 0) >= 1 and prof["graph_breaks"] >= 0 and prof["recompiles"] >= 0


def _suite_started(*args, **kwargs):
    raise RuntimeError("the suite started its runs")


@pytest.mark.parametrize("contenders, refused", [("pool,backend-regions", True), ("backend", True),
                                                  ("pool,backend-saved,reduce-overhead", False)])
def test_the_startup_suite_refuses_backend_contenders_without_the_entry_point_before_any_run(
        monkeypatch, contenders, refused):
    # its backend children compile with the name "gfxgraph": without the entry point each would fail minutes in
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    monkeypatch.setattr(startup, "_bytecode", _suite_started)  # a GPU machine must not start the real suite
    monkeypatch.setattr(sys, "argv", ["startup", "--contenders", contenders, "--out", "unused"])
    with pytest.raises((SystemExit, RuntimeError)) as got:
        startup.main()
    said = str(got.value)
    if refused:
        assert isinstance(got.value, SystemExit)
        assert 'call torch.compile(backend="gfxgraph")' in said and "entry point" in said
        named = sorted(set(contenders.split(",")) & {"backend", "backend-regions"})
        assert said.startswith("startup: " + ", ".join(named))
    else:  # the contenders that do not name the backend go on (to the GPU check here, or to the runs)
        assert "entry point" not in said
