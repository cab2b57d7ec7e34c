"""CPU tests of Tier 2's logic on a fake runtime: lifetime, DAG, compositor, exec update.

The fake records every runtime call, so these tests check what would be
asked of CUDA/HIP (which nodes, which dependencies, which fallbacks) without a GPU.
"""

from __future__ import annotations

import gc
import itertools
import logging
import weakref

import pytest

from hipgraph_bridge.compose.compositor import CompositorState, GraphCompositor, validate_dag
from hipgraph_bridge.errors import GraphRuntimeError
from hipgraph_bridge.compose.exec_update import UpdatableGraph, apply_update
from hipgraph_bridge.compose.pipeline import LaunchPipeline
from hipgraph_bridge.runtime import (
    ExecUpdateOutcome,
    Graph,
    GraphExec,
    Runtime,
    _lifetime,
    deferred_count,
    drain_deferred,
    stream_handle,
)


class FakeRuntime(Runtime):
    """A runtime that hands out fake handles and records calls."""

    name = "cuda"
    kind = "fake"
    prefix = "cuda"
    binding = "fake"

    def __init__(self, *, update_ok=True, set_child_error=None, exec_update=True,
                 child_graph_update=True):
        self._ids = itertools.count(0x1000, 0x10)
        self.calls: list[tuple] = []
        self.destroyed: list[tuple[str, int]] = []
        self.update_ok = update_ok
        self.set_child_error = set_child_error
        self._caps = {"GraphExecUpdate": exec_update,
                      "GraphExecChildGraphNodeSetParams": child_graph_update,
                      "GraphUpload": True}
        self.children: dict[int, list[tuple[int, tuple[int, ...], int]]] = {}

    def _new(self, what, *args):
        h = next(self._ids)
        self.calls.append((what, h, *args))
        return h

    def _error_name(self, code):
        return f"cudaErrorFake{code}"

    def _error_string(self, code):
        return f"fake error {code}"

    def _clear_last_error(self):
        pass

    def _has(self, suffix):
        return self._caps[suffix]

    def runtime_version(self):
        return 13000

    def driver_version(self):
        return 13000

    def graph_create(self):
        h = self._new("graph_create")
        self.children[h] = []
        return h

    def graph_destroy(self, graph):
        self.destroyed.append(("graph", graph))

    def graph_clone(self, graph):
        return self._new("graph_clone", graph)

    def graph_node_count(self, graph):
        return len(self.children.get(graph, []))

    def graph_add_child(self, graph, deps, child):
        node = self._new("add_child", graph, tuple(deps), child)
        self.children[graph].append((node, tuple(deps), child))
        return node

    def graph_instantiate(self, graph, flags=0):
        return self._new("instantiate", graph)

    def exec_destroy(self, exec_):
        self.destroyed.append(("exec", exec_))

    def exec_launch(self, exec_, stream):
        self.calls.append(("launch", exec_, stream))

    def exec_upload(self, exec_, stream):
        self.calls.append(("upload", exec_, stream))

    def exec_set_child(self, exec_, node, child):
        self.calls.append(("set_child", exec_, node, child))
        if self.set_child_error:
            self._check("GraphExecChildGraphNodeSetParams", self.set_child_error)

    def exec_update(self, exec_, graph):
        self.calls.append(("exec_update", exec_, graph))
        if self.update_ok:
            return ExecUpdateOutcome(True, "cudaGraphExecUpdateSuccess")
        return ExecUpdateOutcome(False, "cudaGraphExecUpdateErrorTopologyChanged",
                                 "cudaErrorGraphExecUpdateFailure", "update refused")

    def stream_capture_status(self, stream):
        return 0

    def stream_end_capture(self, stream):
        return 0

    def event_create(self):
        return self._new("event_create")

    def event_destroy(self, event):
        self.destroyed.append(("event", event))

    def event_record(self, event, stream):
        self.calls.append(("record", event, stream))

    def event_query(self, event):
        return True

    def event_synchronize(self, event):
        self.calls.append(("event_sync", event))

    def stream_wait_event(self, stream, event):
        self.calls.append(("wait", stream, event))

    def names(self, what):
        return [c for c in self.calls if c[0] == what]


@pytest.fixture
def rt():
    return FakeRuntime()


# ------------------------------------------------------------------- lifetime
class TestLifetime:
    def test_close_is_idempotent(self, rt):
        g = Graph.create(runtime=rt)
        h = g.handle
        g.close()
        g.close()
        assert rt.destroyed == [("graph", h)]
        assert g.closed
        with pytest.raises(RuntimeError, match="Graph is closed"):
            g.handle  # noqa: B018

    def test_collected_owner_releases_without_being_kept_alive(self, rt):
        g = Graph.create(runtime=rt)
        h = g.handle
        ref = weakref.ref(g)
        del g
        gc.collect()
        assert ref() is None  # the finalizer holds no reference to its owner
        assert rt.destroyed == [("graph", h)]

    def test_borrowed_graph_is_never_destroyed(self, rt):
        keep = object()
        g = Graph.borrow(0x42, runtime=rt, keepalive=keep)
        assert not g.owned and g.keepalive is keep
        g.close()
        assert rt.destroyed == []

    def test_release_during_capture_is_deferred(self, rt, monkeypatch):
        g = Graph.create(runtime=rt)
        h = g.handle
        monkeypatch.setattr(_lifetime, "capture_active", lambda: True)
        g.close()
        assert rt.destroyed == [] and deferred_count() == 1
        assert drain_deferred() == 0  # still capturing: nothing released
        monkeypatch.setattr(_lifetime, "capture_active", lambda: False)
        assert drain_deferred() == 1
        assert rt.destroyed == [("graph", h)] and deferred_count() == 0

    def test_release_never_raises(self, rt, monkeypatch):
        def boom(kind, handle):
            raise GraphRuntimeError("cudaGraphDestroy", "cudaErrorInvalidValue", 1, "bad")

        monkeypatch.setattr(rt, "destroy", boom)
        g = Graph.create(runtime=rt)
        g.close()  # logged at debug, not raised
        del g
        gc.collect()

    def test_exec_close_releases_its_event_too(self, rt):
        e = Graph.create(runtime=rt).instantiate(track_completion=True)
        e.close()
        # the exec held the only reference to its source graph: released with it
        assert [k for k, _ in rt.destroyed] == ["exec", "graph", "event"]

    def test_null_handle_is_rejected(self, rt):
        with pytest.raises(ValueError, match="non-NULL graph handle"):
            Graph.adopt(0, runtime=rt)


class TestStreamHandle:
    def test_accepts_ints_and_stream_like_objects(self):
        class S:
            cuda_stream = 0xABC

        assert stream_handle(7) == 7
        assert stream_handle(S()) == 0xABC

    def test_rejects_other_types_naming_what_is_expected(self):
        with pytest.raises(TypeError, match="expected a torch.cuda.Stream.*got str"):
            stream_handle("s0")
        with pytest.raises(TypeError, match="got bool"):
            stream_handle(True)
        with pytest.raises(ValueError, match="non-negative"):
            stream_handle(-1)


class TestGraphObjects:
    def test_add_child_passes_deduplicated_dependencies(self, rt):
        parent, child = Graph.create(runtime=rt), Graph.create(runtime=rt)
        a = parent.add_child(child)
        b = parent.add_child(child, after=[a, a])
        assert rt.names("add_child")[-1][3] == (a.handle,)
        assert b.graph is parent and parent.node_count() == 2

    def test_add_child_rejects_foreign_nodes(self, rt):
        p1, p2, child = (Graph.create(runtime=rt) for _ in range(3))
        n = p1.add_child(child)
        with pytest.raises(ValueError, match="belong to this graph"):
            p2.add_child(child, after=[n])
        with pytest.raises(TypeError, match="expected a Graph"):
            p1.add_child("child")

    def test_tracked_launch_records_an_event(self, rt):
        e = Graph.create(runtime=rt).instantiate(track_completion=True)
        e.launch(5)
        assert rt.calls[-2][0] == "launch" and rt.calls[-1][0] == "record"
        assert rt.calls[-1][2] == 5

    def test_from_torch_rejects_non_graphs_and_unkept_graphs(self, rt):
        with pytest.raises(TypeError, match="keep_graph=True"):
            Graph.from_torch(object(), runtime=rt)

        class Unkept:
            def raw_cuda_graph(self):
                raise RuntimeError("You cannot access the raw cudaGraph_t instance unless "
                                   "CUDAGraph was initialized with keep_graph=true")

        with pytest.raises(ValueError, match="keep_graph=True.*refused"):
            Graph.from_torch(Unkept(), runtime=rt)

        class Kept:
            def raw_cuda_graph(self):
                return 0x777

        g = Graph.from_torch(Kept(), runtime=rt)
        assert g.handle == 0x777 and not g.owned and isinstance(g.keepalive, Kept)


# ------------------------------------------------------------------------ DAG
class TestValidateDag:
    def test_diamond_order(self):
        order = validate_dag({"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c")})
        assert order[0] == "a" and order[-1] == "d" and set(order[1:3]) == {"b", "c"}

    def test_unknown_dependency_is_named(self):
        with pytest.raises(ValueError, match="'b' runs after 'x', which is not a child"):
            validate_dag({"a": (), "b": ("x",)})

    def test_cycle_is_named(self):
        with pytest.raises(ValueError, match="cycle") as info:
            validate_dag({"a": (), "b": ("a", "d"), "c": ("b",), "d": ("c",)})
        msg = str(info.value)
        assert "'b'" in msg and "'c'" in msg and "'d'" in msg and "'a' ->" not in msg


# ----------------------------------------------------------------- compositor
def _composed(rt, **kw):
    comp = GraphCompositor(runtime=rt, **kw)
    g = {n: Graph.create(runtime=rt) for n in "abcd"}
    comp.add("d", g["d"], after=["b", "c"])  # forward references are fine
    comp.add("a", g["a"])
    comp.add("b", g["b"], after=["a"])
    comp.add("c", g["c"], after=["a"])
    comp.instantiate(stream=3)
    return comp, g


class TestCompositor:
    def test_parent_built_in_topological_order_with_edges(self, rt):
        comp, g = _composed(rt)
        adds = rt.names("add_child")
        by_child = {c[4]: (c[1], c[3]) for c in adds}  # child handle -> (node, deps)
        node = {n: by_child[g[n].handle][0] for n in "abcd"}
        assert by_child[g["a"].handle][1] == ()
        assert by_child[g["b"].handle][1] == (node["a"],)
        assert set(by_child[g["d"].handle][1]) == {node["b"], node["c"]}
        assert comp.order[0] == "a" and comp.order[-1] == "d"
        assert comp.state is CompositorState.READY
        assert rt.names("upload")[-1][2] == 3

    def test_launch_is_one_graph_launch(self, rt):
        comp, _ = _composed(rt)
        n = len(rt.names("launch"))
        comp.launch(9)
        assert len(rt.names("launch")) == n + 1 and rt.names("launch")[-1][2] == 9

    def test_replace_updates_in_place(self, rt):
        comp, _ = _composed(rt)
        new = Graph.create(runtime=rt)
        result = comp.replace("b", new, stream=3)
        assert result.method == "set_params" and result.reason is None
        assert rt.names("set_child")[-1][3] == new.handle
        assert len(rt.names("instantiate")) == 1

    def test_refused_swap_reinstantiates_and_logs_reason(self, caplog):
        rt = FakeRuntime(set_child_error=1)
        comp, g = _composed(rt)
        old_exec = comp.exec.handle
        with caplog.at_level(logging.INFO, logger="gfxgraph"):
            result = comp.replace("c", Graph.create(runtime=rt), stream=3)
        assert result.method == "reinstantiate"
        assert "cudaGraphExecChildGraphNodeSetParams" in result.reason
        assert "cudaErrorFake1" in result.reason
        assert "re-instantiated" in caplog.text
        assert ("exec", old_exec) in rt.destroyed
        assert len(rt.names("instantiate")) == 2

    def test_forced_reinstantiate(self, rt):
        comp, _ = _composed(rt, swap="reinstantiate")
        result = comp.replace("a", Graph.create(runtime=rt), stream=3)
        assert result.method == "reinstantiate" and "requested" in result.reason
        assert rt.names("set_child") == []

    def test_runtime_without_child_update_reinstantiates(self):
        rt = FakeRuntime(child_graph_update=False)
        comp, _ = _composed(rt)
        result = comp.replace("a", Graph.create(runtime=rt), stream=3)
        assert result.method == "reinstantiate" and "not available" in result.reason

    def test_state_errors_name_the_state_and_fix(self, rt):
        comp = GraphCompositor(runtime=rt)
        with pytest.raises(RuntimeError, match="'building'.*instantiate\\(\\) first"):
            comp.launch(0)
        with pytest.raises(ValueError, match="nothing to compose"):
            comp.instantiate()
        comp2, _ = _composed(rt)
        with pytest.raises(RuntimeError, match="children can only be added before instantiate"):
            comp2.add("e", Graph.create(runtime=rt))
        comp2.close()
        comp2.close()
        assert comp2.state is CompositorState.CLOSED
        with pytest.raises(RuntimeError, match="create a new GraphCompositor"):
            comp2.launch(0)

    def test_bad_arguments(self, rt):
        comp = GraphCompositor(runtime=rt)
        comp.add("a", Graph.create(runtime=rt))
        with pytest.raises(ValueError, match="already exists"):
            comp.add("a", Graph.create(runtime=rt))
        with pytest.raises(ValueError, match="cannot run after itself"):
            comp.add("b", Graph.create(runtime=rt), after=["b"])
        with pytest.raises(TypeError, match=r"write after=\['a'\]"):
            comp.add("b", Graph.create(runtime=rt), after="a")
        with pytest.raises(TypeError, match="name: expected a str"):
            comp.add(1, Graph.create(runtime=rt))
        with pytest.raises(ValueError, match="swap: expected one of"):
            GraphCompositor(runtime=rt, swap="fast")

    def test_unknown_and_cyclic_dependencies_fail_at_instantiate(self, rt):
        comp = GraphCompositor(runtime=rt)
        comp.add("a", Graph.create(runtime=rt), after=["ghost"])
        with pytest.raises(ValueError, match="'ghost'"):
            comp.instantiate(stream=0)
        comp = GraphCompositor(runtime=rt)
        comp.add("a", Graph.create(runtime=rt), after=["b"])
        comp.add("b", Graph.create(runtime=rt), after=["a"])
        with pytest.raises(ValueError, match="cycle"):
            comp.instantiate(stream=0)

    def test_replace_unknown_child(self, rt):
        comp, _ = _composed(rt)
        with pytest.raises(KeyError, match="no child named 'z'"):
            comp.replace("z", Graph.create(runtime=rt))

    def test_stage_pool_sharing_rule(self, rt):
        comp = GraphCompositor(runtime=rt)
        comp._after.update({"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c")})
        p0, p1 = ("pool", 0), ("pool", 1)
        comp._pools = [(p0, {"a", "b"}), (p1, {"c"})]
        assert comp._shared_pool(("b", "c"))[0] == p0  # d runs after a, b (and c): shares
        assert comp._shared_pool(("a",)) is None  # c may run beside b: a new pool
        assert comp._shared_pool(()) is None  # a second root: a new pool


# ---------------------------------------------------------------- exec update
class TestExecUpdate:
    def test_in_place(self, rt):
        e = Graph.create(runtime=rt).instantiate(track_completion=True)
        g2 = Graph.create(runtime=rt)
        e2, res = apply_update(e, g2)
        assert e2 is e and res.method == "exec_update"
        assert res.result == "cudaGraphExecUpdateSuccess" and e.source is g2

    def test_refused_update_reinstantiates_with_reason(self):
        rt = FakeRuntime(update_ok=False)
        e = Graph.create(runtime=rt).instantiate(track_completion=True)
        e2, res = apply_update(e, Graph.create(runtime=rt))
        assert e2 is not e and e.closed and e2.tracks_completion
        assert res.method == "reinstantiate"
        assert res.result == "cudaGraphExecUpdateErrorTopologyChanged"
        assert "cudaErrorGraphExecUpdateFailure" in res.reason

    def test_forced_and_unavailable(self):
        rt = FakeRuntime(exec_update=False)
        e = Graph.create(runtime=rt).instantiate()
        e, res = apply_update(e, Graph.create(runtime=rt))
        assert res.method == "reinstantiate" and "not available" in res.reason
        e, res = apply_update(e, Graph.create(runtime=rt), strategy="reinstantiate")
        assert "requested" in res.reason
        with pytest.raises(ValueError, match="strategy: expected one of"):
            apply_update(e, Graph.create(runtime=rt), strategy="never")

    def test_updatable_graph_counts(self, rt):
        ug = UpdatableGraph(Graph.create(runtime=rt), runtime=rt, upload=False)
        ug.launch(2)
        assert ug.update(Graph.create(runtime=rt)).method == "exec_update"
        assert (ug.updates, ug.reinstantiations) == (1, 0)
        ug.close()
        ug.close()
        with pytest.raises(RuntimeError, match="closed"):
            ug.launch(2)


class TestLaunchPipelineArguments:
    def test_device_launch_must_be_a_bool(self, rt):
        with pytest.raises(TypeError, match="device_launch: expected a bool, got str"):
            LaunchPipeline(Graph.create(runtime=rt), runtime=rt, device_launch="yes")

    def test_instances_must_be_positive(self, rt):
        with pytest.raises(ValueError, match="instances: expected an int >= 1, got 0"):
            LaunchPipeline(Graph.create(runtime=rt), runtime=rt, instances=0)


def test_graph_exec_is_exported_type(rt):
    assert isinstance(Graph.create(runtime=rt).instantiate(), GraphExec)
