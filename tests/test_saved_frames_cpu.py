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
    import hipgraph_bridge.compile.subgraph as sg
    from torch._dynamo.utils import counters

    analyses = []  # row analyses run in this process
    traced = sg.trace_graph
    sg.trace_graph = lambda *a, **k: analyses.append(1) or traced(*a, **k)

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
        f(model, x[:1])  # batch 1's second call: its frame (every shape fixed) compiles now
        ref = {n: step(model, x[:n]).flatten().tolist() for n in (6, 1, 3)}
    print(json.dumps({"hits": gfxgraph.cache.hits(), "frames": int(counters["frames"]["total"]), "y": y, "ref": ref,
                      "subgraphs": gfxgraph.backend_stats()["subgraphs"], "analyses": len(analyses),
                      "verdicts": sorted(repr(s.verdict) for s in sg.live_subgraphs())}))
""")


def test_a_loaded_frame_traces_nothing_hits_inductors_cache_and_gives_the_saved_processs_results(tmp_path):
    path = str(tmp_path / "step.frame")
    folder = str(tmp_path / "inductor")  # kept between the two processes: the second one's cache hits
    cold = run_child(_CHILD, "save", path, folder, timeout=300)
    assert cold["hits"]["fx_graph_miss"] >= 1 and cold["subgraphs"] == 2, cold  # a frame from 2 rows, one for 1
    warm = run_child(_CHILD, "load", path, folder, timeout=300)
    assert warm["frames"] == 0, "dynamo traced a frame in the process that loaded the saved one"
    assert warm["hits"]["fx_graph_miss"] == 0 and warm["hits"]["fx_graph_hit"] >= 1, warm["hits"]
    assert warm["subgraphs"] == 2
    # the row analysis made when saving travels in the file: the same verdicts, none made again
    # cold: one per frame, when saving (batch 1's ahead of its compile, which takes it)
    assert cold["analyses"] == 2 and warm["analyses"] == 0 and warm["verdicts"] == cold["verdicts"], (cold, warm)
    assert "RowVerdict(reason=None" in " ".join(warm["verdicts"])  # the symbolic frame's rows: proven independent
    assert warm["y"] == cold["y"]  # batch 1 included: one frame serves every size
    for n, want in warm["ref"].items():
        torch.testing.assert_close(torch.tensor(warm["y"][n]), torch.tensor(want))


def _step(model, x):
    return torch.relu(model(x)) + 1


def _new_subgraphs(before: set[int]) -> list:
    return [s for s in live_subgraphs() if id(s) not in before]


def test_batch_1_gets_a_frame_of_its_own_unless_one_frame_admits_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    x = torch.randn(5, 8)
    before = {id(s) for s in live_subgraphs()}
    with torch.no_grad():
        g = gfxgraph.cache.save_compiled(tmp_path / "b", _step, model, x, options={"compiler": "eager"})
        assert g.frames == 2  # dynamo's 0/1 specialisation kept: batch 1 traced as a frame of its own
        torch.testing.assert_close(g(model, x), _step(model, x))  # the example itself: saving left no mark on it
        rep = gfxgraph.warmup(g, model, x, buckets=[1, 2, 4, 8], progress=False)  # no mark on a saved frame either
        assert rep.buckets == (8, 4, 2, 1)
        for n in (3, 1, 2, 7):
            xs = x[:n] if n <= 5 else torch.randn(n, 8)
            torch.testing.assert_close(g(model, xs), _step(model, xs))
        assert gfxgraph.cache.load_compiled(tmp_path / "b").frames == 2
        with pytest.raises(RuntimeError, match="(?s)GuardManager check failed.*gfxgraph: this call matches none"):
            g(model, x[:2].double())  # another dtype: no frame admits it
        f = gfxgraph.cache.save_compiled(tmp_path / "a", _step, model, x, options={"compiler": "eager"},
                                         one_frame=True)
        assert f.frames == 1  # torch 2.13: the frame traced without the 0/1 specialisation admits batch 1
        again = gfxgraph.cache.load_compiled(tmp_path / "a")  # the file, read back in this process
        for n in (1, 2):
            torch.testing.assert_close(again(model, x[:n]), _step(model, x[:n]))
        h = gfxgraph.cache.save_compiled(tmp_path / "c", _step, model, x[:1], options={"compiler": "eager"},
                                         one_frame=True)
        torch.testing.assert_close(h(model, x[:4]), _step(model, x[:4]))  # traced at batch 1: every size
    buckets = sorted(s.buckets for s in _new_subgraphs(before))
    # g: a symbolic frame from 2 (0/1 specialised) and a batch-1 frame; f (compiled when saved, never called),
    # `again` (f's file read back: compiled at its first call) and h: every size
    assert buckets[0] == [1] and [b[0] for b in buckets[1:]] == [1, 1, 1, 2], buckets
    assert all(b[-1] == 256 for b in buckets[1:]), buckets


def _branchy(model, x):
    if x.shape[0] == 1:  # the code itself specialises batch 1: no trace can keep it symbolic
        return model(x) * 0
    return model(x)


def test_a_frame_whose_guards_refuse_batch_1_despite_one_frame_gets_a_batch_1_frame(tmp_path):
    model, x = torch.nn.Linear(4, 4), torch.randn(3, 4)
    with torch.no_grad():
        f = gfxgraph.cache.save_compiled(tmp_path / "f", _branchy, model, x, options={"compiler": "eager"},
                                         one_frame=True)
        assert f.frames == 2
        for n in (1, 2, 3):
            torch.testing.assert_close(f(model, x[:n]), _branchy(model, x[:n]))


def _scaled(model, x, scale, relu):
    y = model(x) * scale
    return torch.relu(y) if relu else y


def test_python_values_and_the_modules_mode_are_checked_at_every_call(tmp_path):
    model, x = torch.nn.Linear(4, 4).eval(), torch.randn(3, 4)
    with torch.no_grad():
        f = gfxgraph.cache.save_compiled(tmp_path / "f", _scaled, model, x, 2.0, True, options={"compiler": "eager"})
        g = gfxgraph.cache.load_compiled(tmp_path / "f")
        torch.testing.assert_close(g(model, x, 2.0, True), _scaled(model, x, 2.0, True))
        for scale, relu in ((3.0, True), (2.0, False)):  # another value: refused, never the code traced for 2.0
            with pytest.raises(RuntimeError, match="gfxgraph: this call matches none"):
                g(model, x, scale, relu)
        model.train()
        with pytest.raises(RuntimeError, match="traced with the module argument 0 in eval mode; it is in training"):
            f(model, x, 2.0, True)


def test_a_strided_example_keeps_its_strides_and_views_inside_the_graph_are_saved(tmp_path):
    def step(model, x):
        y = model(x).view(-1, 2, 2)  # a view inside the graph: its traced fake value is a view
        return y.sum(1)

    model = torch.nn.Linear(8, 4)
    base = torch.randn(5, 16)
    x = base[:, 4:12]  # not contiguous: row stride 16
    with torch.no_grad():
        f = gfxgraph.cache.save_compiled(tmp_path / "f", step, model, x, options={"compiler": "eager"})
        torch.testing.assert_close(f(model, x), step(model, x))  # the example itself still matches the guards
        torch.testing.assert_close(f(model, x[:1]), step(model, x[:1]))


def test_a_symbolic_slice_in_the_graph_is_saved_and_read_back(tmp_path):
    def step(model, x):  # slice(None, s0 - 1): a node inside a slice, which the pickler must find
        return model(x)[: x.shape[0] - 1] * 2

    model, x = torch.nn.Linear(4, 4), torch.randn(5, 4)
    with torch.no_grad():
        gfxgraph.cache.save_compiled(tmp_path / "f", step, model, x, options={"compiler": "eager"})
        f = gfxgraph.cache.load_compiled(tmp_path / "f")
        for n in (5, 3):
            torch.testing.assert_close(f(model, x[:n]), step(model, x[:n]))
    assert slice not in _torch_compat.pytree.SUPPORTED_NODES  # registered for the pickling only


def test_a_compile_that_fails_is_not_repeated_at_every_call(tmp_path, monkeypatch):
    import hipgraph_bridge.startup.frames as frames

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor could not compile this")

    monkeypatch.setattr(frames, "serve", failing)
    model, x = torch.nn.Linear(4, 4), torch.randn(3, 4)
    with torch.no_grad():
        f = gfxgraph.cache.save_compiled(tmp_path / "f", _step, model, x, options={"compiler": "eager"})
        assert len(calls) == f.frames  # each frame compiled once, when it was saved
        for _ in range(3):
            with pytest.raises(RuntimeError, match="inductor could not compile this"):
                f(model, x)
    assert len(calls) == f.frames


def test_grad_mode_with_parameters_that_require_grad_is_refused(tmp_path):
    with pytest.raises(NotImplementedError, match="inference steps.*torch.no_grad"):
        gfxgraph.cache.save_compiled(tmp_path / "f", _step, torch.nn.Linear(4, 4), torch.randn(2, 4))
    assert not (tmp_path / "f").exists()


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

    with torch.no_grad(), pytest.raises(RuntimeError, match="(?s)Failed to serialize.*gfxgraph: a module the step"):
        gfxgraph.cache.save_compiled(tmp_path / "f", held, x, options={"compiler": "eager"})

    def breaks(model, x):
        y = model(x)
        print("a graph break")
        return y

    with torch.no_grad(), pytest.raises(Exception, match="(?i)graph break|print|fullgraph"):
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


def test_a_row_analysis_travels_with_its_frame_only_to_the_same_gfxgraph_code(monkeypatch):
    import hipgraph_bridge.startup.frames as frames
    from hipgraph_bridge.compile.subgraph import Analysis
    from hipgraph_bridge.fallbacks import Reason
    from hipgraph_bridge.padding.rows import RowVerdict

    made = Analysis(((3, 0),), RowVerdict(Reason.ROWS_COUPLED, "sum over the batch", ()))
    data = SavedFrame.serialize_compile_artifacts(SavedFrame(b"graph", {}, False, made))
    assert SavedFrame.deserialize_compile_artifacts(data)._analysis == made
    monkeypatch.setattr(frames, "_code_version", lambda: "another gfxgraph")  # changed code may analyse otherwise
    assert SavedFrame.deserialize_compile_artifacts(data)._analysis is None
    # a file saved before frames held an analysis and static marks still reads
    old = {k: v for k, v in pickle.loads(data).items() if k not in ("analysis", "gfxgraph", "statics")}
    frame = SavedFrame.deserialize_compile_artifacts(pickle.dumps(old))
    assert frame._analysis is None and frame._statics == {}


def test_warmup_compiles_a_saved_batch_1_frame_that_waited_since_it_was_saved(tmp_path, monkeypatch):
    import sys

    from hipgraph_bridge.compile.subgraph import SubgraphState

    warmup_module = sys.modules["hipgraph_bridge.startup.warmup"]  # the package's `warmup` is the function

    # save_compiled compiles its frames when saving: the batch-1 frame (every shape fixed) then waits, LAZY,
    # for its static_compile_after-th call, before warmup's first call to it
    torch.manual_seed(0)
    model, x = torch.nn.Linear(8, 4), torch.randn(5, 8)
    before = {id(s) for s in live_subgraphs()}
    with torch.no_grad():
        g = gfxgraph.cache.save_compiled(tmp_path / "b", _step, model, x, options={"compiler": "eager"})
        assert [s.state for s in _new_subgraphs(before)].count(SubgraphState.LAZY) == 1
        monkeypatch.setattr(warmup_module.torch.cuda, "is_available", lambda: True)  # warmup's retries are GPU-only
        gfxgraph.warmup(g, model, x, buckets=[1, 2, 4, 8], progress=False)
    assert all(s.state is not SubgraphState.LAZY for s in _new_subgraphs(before)), \
        [(s.state, s.lazy_calls) for s in _new_subgraphs(before)]


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_loading_process_reads_the_buffers_in_place_as_the_saving_one_and_reuses_its_row_analysis(
        tmp_path, monkeypatch):
    import hipgraph_bridge.compile.subgraph as sg

    torch.manual_seed(0)
    model, x = _Scaled(), torch.randn(5, 8)
    with torch.no_grad():
        gfxgraph.cache.save_compiled(tmp_path / "s", _step, model, x, options={"compiler": "eager"})
    assert _torch_compat.static_address_type(model.scale) is not None  # dynamo marked the buffer while tracing
    # as a new process: the buffer unmarked (no dynamo runs there); load_compiled takes no compile of save_compiled's
    _torch_compat.unmark_static_address(model.scale)
    analyses = []
    traced = sg.trace_graph
    monkeypatch.setattr(sg, "trace_graph", lambda *a, **k: analyses.append(1) or traced(*a, **k))
    before = {id(s) for s in live_subgraphs()}
    with torch.no_grad():
        g = gfxgraph.cache.load_compiled(tmp_path / "s")
        torch.testing.assert_close(g(model, x), _step(model, x))
    (sub,) = _new_subgraphs(before)
    assert [s.name for s in sub.plan.slots if s.kind == "ref"] == [
        s.name for s in sub.plan.slots if "scale" in s.name or "lin" in s.name]  # the buffer is read in place
    assert analyses == []  # the saved analysis was made for the same inputs: not made again


def test_an_analysis_made_for_other_inputs_is_made_again(monkeypatch):
    import hipgraph_bridge.compile.subgraph as sg
    from hipgraph_bridge.compile.options import BackendOptions
    from hipgraph_bridge.fallbacks import Reason
    from hipgraph_bridge.padding.rows import RowVerdict

    analyses = []
    traced = sg.trace_graph
    monkeypatch.setattr(sg, "trace_graph", lambda *a, **k: analyses.append(1) or traced(*a, **k))
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    opts = BackendOptions.from_mapping({"compiler": "eager", "static_compile_after": 1})
    x = torch.randn(4, 3)
    stale = sg.Analysis(("made for other inputs",), RowVerdict(Reason.ROWS_COUPLED, "not this graph's", ()))
    sub = sg.CompiledSubgraph(gm, [x], opts, analysis=stale)
    assert analyses == [1] and sub.verdict is not None and sub.verdict.reason is None  # made again: rows independent
    again = sg.CompiledSubgraph(gm, [x], opts, analysis=sub.analysis)  # the same inputs: taken as it is
    assert analyses == [1] and again.verdict == sub.verdict


def test_saving_keeps_nothing_of_the_model_alive_once_the_returned_function_is_gone(tmp_path):
    import gc
    import weakref

    model, x = _Scaled(), torch.randn(5, 8)
    with torch.no_grad():
        f = gfxgraph.cache.save_compiled(tmp_path / "s", _step, model, x, options={"compiler": "eager"})
        f(model, x)
    weight = weakref.ref(model.lin.weight)
    del f, model
    gc.collect()
    assert weight() is None
