"""Saved compiled frames on the CPU: ``gfxgraph.cache.save_compiled`` / ``load_compiled`` round trip in fresh
processes (the loading one runs no dynamo and hits inductor's cache), one frame for every batch size, and
the errors: options checked when saving, torch's own refusals passed through, a file from another torch."""

from __future__ import annotations

import pickle
import textwrap

import pytest
import torch

import gfxgraph
from _cache_child import run_child
from hipgraph_bridge import _torch_compat
from hipgraph_bridge.compile.subgraph import live_subgraphs
from hipgraph_bridge.errors import ConfigError
from hipgraph_bridge.startup.frames import SavedFrame

pytestmark = pytest.mark.skipif(not _torch_compat.has_aot_precompile,
                                reason="this torch cannot save a compiled frame (aot_compile, torch >= 2.10)")

_CHILD = textwrap.dedent("""
    import json, sys, torch
    import gfxgraph
    from torch._dynamo.utils import counters

    def step(model, x):
        return model(x) * 2

    mode, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    # a matmul only: inductor calls an extern kernel and generates no C++, so no compiler runs (seconds)
    model = torch.nn.Linear(8, 4, bias=False)
    x = torch.linspace(-2, 2, 48).view(6, 8)
    with torch.no_grad():
        if mode == "save":
            f = gfxgraph.cache.save_compiled(path, step, model, x, options={"buckets": [1, 2, 4, 8]})
        else:
            f = gfxgraph.cache.load_compiled(path)
        y = {n: f(model, x[:n]).flatten().tolist() for n in (6, 1, 3)}
        ref = {n: step(model, x[:n]).flatten().tolist() for n in (6, 1, 3)}
    print(json.dumps({"hits": gfxgraph.cache.hits(), "frames": int(counters["frames"]["total"]), "y": y, "ref": ref,
                      "subgraphs": gfxgraph.backend_stats()["subgraphs"]}))
""")


def test_a_loaded_frame_traces_nothing_hits_inductors_cache_and_gives_the_saved_processs_results(tmp_path):
    path = str(tmp_path / "step.frame")
    folder = str(tmp_path / "inductor")  # kept between the two processes: the second one's cache hits
    cold = run_child(_CHILD, "save", path, folder, timeout=300)
    assert cold["hits"]["fx_graph_miss"] >= 1 and cold["subgraphs"] == 1, cold
    warm = run_child(_CHILD, "load", path, folder, timeout=300)
    assert warm["frames"] == 0, "dynamo traced a frame in the process that loaded the saved one"
    assert warm["hits"]["fx_graph_miss"] == 0 and warm["hits"]["fx_graph_hit"] >= 1, warm["hits"]
    assert warm["subgraphs"] == 1
    assert warm["y"] == cold["y"]  # batch 1 included: one frame serves every size
    for n, want in warm["ref"].items():
        torch.testing.assert_close(torch.tensor(warm["y"][n]), torch.tensor(want))


def _step(model, x):
    return torch.relu(model(x)) + 1


def test_one_frame_serves_every_batch_size_and_without_it_batch_1_gets_a_second_frame(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    x = torch.randn(5, 8)
    with torch.no_grad():
        f = gfxgraph.cache.save_compiled(tmp_path / "a", _step, model, x, options={"compiler": "eager"})
        torch.testing.assert_close(f(model, x), _step(model, x))  # the example itself: saving left no mark on it
        rep = gfxgraph.warmup(f, model, x, buckets=[1, 2, 4, 8], progress=False)  # no mark on a saved frame either
        assert rep.buckets == (8, 4, 2, 1)
        for n in (5, 1, 2, 7):
            assert f(model, x[:n] if n <= 5 else torch.randn(n, 8)).shape == (n, 4)
        torch.testing.assert_close(f(model, x[:1]), _step(model, x[:1]))
        assert f.frames == 1  # torch 2.13: the frame traced without the 0/1 specialisation admits batch 1
        g = gfxgraph.cache.save_compiled(tmp_path / "b", _step, model, x, options={"compiler": "eager"},
                                         one_frame=False)
        assert g.frames == 2  # dynamo's 0/1 specialisation kept: batch 1 traced as a frame of its own
        for n in (3, 1, 2):
            torch.testing.assert_close(g(model, x[:n]), _step(model, x[:n]))
        assert gfxgraph.cache.load_compiled(tmp_path / "b").frames == 2
        with pytest.raises(RuntimeError, match="(?s)GuardManager check failed.*gfxgraph: this call matches none"):
            g(model, x[:2].double())  # another dtype: no frame admits it
        again = gfxgraph.cache.load_compiled(tmp_path / "a")  # the file, read back in this process
        torch.testing.assert_close(again(model, x[:2]), _step(model, x[:2]))
        h = gfxgraph.cache.save_compiled(tmp_path / "c", _step, model, x[:1], options={"compiler": "eager"})
        torch.testing.assert_close(h(model, x[:4]), _step(model, x[:4]))  # traced at batch 1: every size
    buckets = [s.buckets for s in live_subgraphs() if s.opts.compiler == "eager"]
    # the default buckets, all of them, for f, again and h; g's symbolic frame (0/1 specialised) starts at 2
    # and its batch-1 frame serves exactly 1
    assert [1] in buckets, buckets
    assert sorted(b[0] for b in buckets if b != [1]) == [1, 1, 1, 2], buckets
    assert all(b[-1] == 256 for b in buckets if b != [1]), buckets


def test_options_are_checked_when_saving_and_a_process_group_cannot_be_saved(tmp_path):
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with pytest.raises(ConfigError, match="buckets"):
        gfxgraph.cache.save_compiled(tmp_path / "f", _step, model, x, options={"buckets": "many"})
    with pytest.raises(ConfigError, match="one_frame"):
        gfxgraph.cache.save_compiled(tmp_path / "f", _step, model, x, one_frame=1)
    with pytest.raises(TypeError, match="batch dimension"):
        gfxgraph.cache.save_compiled(tmp_path / "f", _step, model, 3.0)
    assert not (tmp_path / "f").exists()


def test_torchs_own_refusals_pass_through_and_leave_no_file(tmp_path):
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)

    def held(x):  # the module in a closure: torch will not pickle it into the file
        return model(x)

    with pytest.raises(RuntimeError, match="Failed to serialize"):
        gfxgraph.cache.save_compiled(tmp_path / "f", held, x, options={"compiler": "eager"})

    def breaks(model, x):
        y = model(x)
        print("a graph break")
        return y

    with pytest.raises(Exception, match="(?i)graph break|print|fullgraph"):
        gfxgraph.cache.save_compiled(tmp_path / "f", breaks, model, x, options={"compiler": "eager"})
    assert list(tmp_path.iterdir()) == []  # neither left a file nor a temporary one


def test_a_file_saved_by_another_torch_or_not_by_gfxgraph_is_refused_naming_what_was_expected(tmp_path):
    old = tmp_path / "old.frame"
    old.write_bytes(pickle.dumps({"gfxgraph_frames": 2, "torch": "1.0.0", "frames": []}))
    with pytest.raises(RuntimeError, match=r"saved by PyTorch 1\.0\.0; this is PyTorch"):
        gfxgraph.cache.load_compiled(old)
    other = tmp_path / "other.frame"
    other.write_bytes(b"not a pickle")
    with pytest.raises(RuntimeError, match="not a file gfxgraph.cache.save_compiled wrote"):
        gfxgraph.cache.load_compiled(other)
    data = pickle.dumps({"format": 2, "torch": "1.0.0", "graph": b"", "options": {}, "one_frame": True})
    with pytest.raises(RuntimeError, match=r"saved by PyTorch 1\.0\.0.*this is PyTorch"):
        SavedFrame.deserialize_compile_artifacts(data)  # the backend's part checks it too


def test_load_of_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        gfxgraph.cache.load_compiled(tmp_path / "missing.frame")


def test_a_torch_without_saved_frames_raises_not_implemented(monkeypatch, tmp_path):
    monkeypatch.setattr(_torch_compat, "has_aot_precompile", False)
    monkeypatch.setattr("hipgraph_bridge.startup.frames.has_aot_precompile", False)
    with pytest.raises(NotImplementedError, match="torch >= 2.10"):
        gfxgraph.cache.save_compiled(tmp_path / "f", _step, torch.nn.Linear(2, 2), torch.randn(2, 2))
    with pytest.raises(NotImplementedError, match="torch >= 2.10"):
        _torch_compat.load_compiled_frame(b"", None)
