"""The failure path's bookkeeping, without a GPU: a graph whose RNG registration PyTorch left half done
is registered again or kept alive until exit (never destroyed: that aborts the process), and
``GraphCapture.discard()`` completes whatever its steps raise. The GPU half: test_gpu_memory_fraction.py."""

from __future__ import annotations

import sys

import pytest
import torch

from hipgraph_bridge.graph import capture as capture_mod
from hipgraph_bridge.graph import recovery
from hipgraph_bridge.graph.bridged import SafeCUDAGraph
from hipgraph_bridge.graph.capture import CaptureState, GraphCapture


class _StubGraph(capture_mod.OriginalCUDAGraph):
    """An instance of PyTorch's graph class on a CPU-only build (whose base cannot be built)."""

    def __new__(cls):
        return object.__new__(cls)

    def __init__(self):
        pass


class _Stream:
    cuda_stream = 0x5E


@pytest.fixture
def registration(monkeypatch):
    """PyTorch 2.3 - 2.12's bookkeeping, with a ``register_generator_state`` that records or raises."""
    calls: list[tuple[object, object]] = []
    failure: list[BaseException] = []

    def register(graph, generator):
        calls.append((graph, generator))
        if failure:
            raise failure[0]

    monkeypatch.setattr(recovery, "generator_states_track_graphs", lambda: True)
    monkeypatch.setattr(recovery.OriginalCUDAGraph, "register_generator_state", register, raising=False)
    return calls, failure


# ------------------------------------------------------------------ which torch checks the registration
@pytest.mark.parametrize("version, tracks", [
    ("2.6.0", True), ("2.11.0+cu130", True), ("2.12.1+rocm7.1", True),
    ("2.13.0", False), ("2.13.0a0+git1234", False), ("2.14.0.dev20260901+cu130", False), ("garbage", False),
])
def test_versions_whose_graph_destructor_checks_the_registration(monkeypatch, version, tracks):
    monkeypatch.setattr(recovery.OriginalCUDAGraph, "register_generator_state", lambda g, gen: None, raising=False)
    assert recovery.generator_states_track_graphs(version) is tracks


def test_no_register_generator_state_means_no_check(monkeypatch):
    monkeypatch.delattr(recovery.OriginalCUDAGraph, "register_generator_state", raising=False)
    assert recovery.generator_states_track_graphs("2.11.0") is False


# ------------------------------------------------------------------ pinning
def test_pin_keeps_the_object_past_every_reference_and_is_idempotent():
    class Graph:
        pass

    g = Graph()
    before = len(recovery.pinned_graphs())
    base = sys.getrefcount(g)
    recovery.pin_graph(g, "test")
    once = sys.getrefcount(g)  # (read outside assert statements: pytest's rewriting holds their values)
    recovery.pin_graph(g, "again")
    twice = sys.getrefcount(g)
    pinned = recovery.pinned_graphs()
    assert recovery.is_pinned(g) and not recovery.is_pinned(Graph())
    assert pinned[-1] is g and len(pinned) == before + 1
    assert once == base + 2  # the module's entry, and the one never given back
    assert twice == once


@pytest.mark.parametrize("pin", [False, True])
def test_a_pinned_object_is_never_destroyed_not_even_at_interpreter_exit(warm_py, pin):
    # The last reference dropped and a collection run (the control shows that destroys an unpinned
    # object), then the interpreter finalises (where PyTorch's abort happens): a pinned object's
    # finaliser never runs, so its C++ destructor would not either. (Whether finalisation clears
    # __main__'s globals depends on the environment, so the control does not rely on it.)
    r = warm_py(f"""
        import gc, os
        from hipgraph_bridge.graph.recovery import pin_graph

        class Graph:
            def __del__(self, _write=os.write):
                _write(1, b"DESTROYED\\n")

        g = Graph()
        if {pin}:
            pin_graph(g, "test")
        del g
        gc.collect()
        print("EXITING", flush=True)
    """)
    assert r.returncode == 0, r.stderr
    assert "EXITING" in r.stdout
    assert ("DESTROYED" in r.stdout) is not pin, r.stdout


def test_pinning_logs_why(caplog):
    class Graph:
        pass

    with caplog.at_level("WARNING", logger="gfxgraph"):
        recovery.pin_graph(Graph(), "capture_begin failed: CUDA out of memory")
    assert "kept alive until the process ends" in caplog.text and "CUDA out of memory" in caplog.text


# ------------------------------------------------------------------ securing a registration
def test_a_registration_made_whole_does_not_pin(registration):
    calls, _ = registration
    g, gens = _StubGraph(), ("gen0", "gen1")
    assert recovery.secure_generator_registration(g, gens, why="test") is True
    assert calls == [(g, "gen0"), (g, "gen1")]
    assert not recovery.is_pinned(g)


def test_a_registration_that_fails_again_pins(registration):
    calls, failure = registration
    failure.append(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    g = _StubGraph()
    assert recovery.secure_generator_registration(g, ("gen0",), why="test") is False
    assert recovery.is_pinned(g) and len(calls) == 1


def test_an_interrupt_during_the_repair_pins_then_propagates(registration):
    _, failure = registration
    failure.append(KeyboardInterrupt())
    g = _StubGraph()
    with pytest.raises(KeyboardInterrupt):
        recovery.secure_generator_registration(g, ("gen0",), why="test")
    assert recovery.is_pinned(g)


def test_nothing_to_secure_where_torch_does_not_check(monkeypatch):
    monkeypatch.setattr(recovery, "generator_states_track_graphs", lambda: False)
    g = _StubGraph()
    assert recovery.secure_generator_registration(g, ("not even a generator",), why="test") is True
    assert not recovery.is_pinned(g)


def test_the_default_generator_is_what_capture_begin_registers(registration, monkeypatch):
    calls, _ = registration
    monkeypatch.setattr(torch.cuda, "default_generators", ("dev0", "dev1"))
    g = _StubGraph()
    assert recovery.secure_default_registration(g, 1, why="test") is True
    assert calls == [(g, "dev1")]
    assert recovery.secure_default_registration(g, -1, why="test") is True  # never began on a device
    assert len(calls) == 1


# ------------------------------------------------------------------ discard()
@pytest.fixture
def failing_begin(monkeypatch):
    """A GraphCapture whose capture_begin raised, with every runtime step of the failure path stubbed."""
    steps: list[str] = []
    monkeypatch.setattr(capture_mod, "end_stream_capture", lambda stream, destroy=True: steps.append("end") or True)
    monkeypatch.setattr(capture_mod, "release_capture_pool", lambda device, pool: steps.append("release"))
    monkeypatch.setattr(capture_mod, "synchronize_quietly", lambda owner, stream: steps.append("sync"))
    monkeypatch.setattr(capture_mod, "rearm_generators", lambda owner, gens, device: steps.append("rearm"))

    def reset(graph):
        steps.append("reset")
        raise RuntimeError("reset raised")

    monkeypatch.setattr(capture_mod.OriginalCUDAGraph, "reset", reset)
    monkeypatch.setattr(torch.cuda, "default_generators", ("dev0",))
    graph = _StubGraph()
    cap = GraphCapture(graph)
    cap.state, cap._open, cap._begin_raised = CaptureState.CAPTURING, True, True
    cap.stream, cap.pool, cap._device = _Stream(), (0, 7), 0
    return cap, graph, steps


def test_discard_after_begin_makes_the_registration_whole_then_rearms(failing_begin, registration):
    cap, graph, steps = failing_begin
    calls, _ = registration
    cap.discard("capture_begin failed: CUDA error")  # reset raising is logged, not raised
    assert steps == ["end", "release", "sync", "reset", "rearm"]
    assert calls == [(graph, "dev0")]
    assert cap.state is CaptureState.DISCARDED and not recovery.is_pinned(graph)


def test_discard_after_begin_pins_a_graph_it_cannot_register_and_skips_the_rearm(failing_begin, registration):
    cap, graph, steps = failing_begin
    _, failure = registration
    failure.append(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    cap.discard("capture_begin failed: CUDA out of memory")
    # the registration never completed, so capture_begin never reached capture_prologue: nothing to re-arm
    assert steps == ["end", "release", "sync", "reset"]
    assert recovery.is_pinned(graph)
    assert cap.state is CaptureState.DISCARDED and "out of memory" in cap.failure


def test_a_region_failure_leaves_the_registration_alone(failing_begin, registration):
    cap, graph, steps = failing_begin
    calls, _ = registration
    cap._begin_raised = False  # capture_begin succeeded: its registration is whole
    cap.discard("the captured region raised OutOfMemoryError")
    assert calls == [] and steps[-1] == "rearm" and not recovery.is_pinned(graph)


def test_discard_twice_is_a_no_op(failing_begin, registration):
    cap, _, steps = failing_begin
    cap.discard("first")
    n = len(steps)
    cap.discard("second")
    assert len(steps) == n and cap.failure == "first"


# ------------------------------------------------------------------ a pinned SafeCUDAGraph
def test_a_pinned_graph_refuses_another_capture():
    g = SafeCUDAGraph()
    recovery.pin_graph(g, "test")
    with pytest.raises(RuntimeError, match="kept alive until the process ends.*new graph object"):
        g._require_empty("capture_begin")


def test_replay_parts_are_refused_before_a_capture_succeeded():
    with pytest.raises(RuntimeError, match="expected a ready graph"):
        SafeCUDAGraph().replay_parts()
