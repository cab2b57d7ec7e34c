"""CPU tests of conditional execution (gap 51): the eager/dispatch logic, every error, the op,
strategy selection, the capability probe, the NVRTC source and the runtime additions.

Tests marked "CPU-only fallback" skip on a GPU machine (there the GPU tests cover the graph
paths); everything else runs everywhere. Nothing here needs cuda-bindings or NVRTC: the tests
that use them skip when they are missing.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import typing
from pathlib import Path

import pytest
import torch

import gfxgraph
import hipgraph_bridge
from conftest import GPU_SKIP_REASON
from gfxgraph import BridgedCUDAGraph
from hipgraph_bridge.conditional import graph as cond_graph, native_nodes, strategies, support as cond_nodes
from hipgraph_bridge.conditional.branches import BranchSet
from hipgraph_bridge.conditional.graph import ConditionalGraph, ConditionalState, resolve_strategy
from hipgraph_bridge.conditional.loop import DeviceWhileLoop, LoopCondition, resolve_loop_strategy
from hipgraph_bridge.errors import GraphRuntimeError
from hipgraph_bridge.conditional.ops import conditional_select
from hipgraph_bridge.fallbacks import Fallback, Reason
from hipgraph_bridge.graph.capturer import Captured, Capturer
from hipgraph_bridge.tree import copy_into
from hipgraph_bridge.platform import Platform
from hipgraph_bridge.runtime import COND_SWITCH, HIP_NO_CONDITIONAL, CaptureInfo, RuntimeCaps

cpu_only = pytest.mark.skipif(GPU_SKIP_REASON is None, reason="CPU-only fallback behaviour")
SYMBOLS_FILE = Path(hipgraph_bridge.__file__).parent / "runtime" / "hip_api_symbols.txt"


def double(x):
    return x * 2


def shift(x):
    return x - 1


def square(x):
    return x * x


def make_graph(*fns, **kwargs) -> ConditionalGraph:
    cg = ConditionalGraph(**kwargs)
    for i, fn in enumerate(fns):
        cg.add_branch(f"b{i}", fn)
    return cg


# ------------------------------------------------------------ building errors
class TestBuildingErrors:
    def test_add_branch_rejects_bad_names_and_non_callables(self):
        cg = ConditionalGraph()
        with pytest.raises(TypeError, match="name: expected a str, got int"):
            cg.add_branch(3, double)
        with pytest.raises(ValueError, match="non-empty"):
            cg.add_branch("", double)
        with pytest.raises(TypeError, match="fn: expected a callable, got int"):
            cg.add_branch("a", 5)
        cg.add_branch("a", double)
        with pytest.raises(ValueError, match="'a' already exists"):
            cg.add_branch("a", shift)
        assert cg.branches == ["a"]

    def test_constructor_validates_options(self):
        with pytest.raises(ValueError, match="strategy: expected one of auto, native, supergraph, dispatch"):
            ConditionalGraph(strategy="fast")
        with pytest.raises(ValueError, match="warmup_iters: expected an int >= 0"):
            ConditionalGraph(warmup_iters=-1)
        with pytest.raises(ValueError, match="capture_error_mode"):
            ConditionalGraph(capture_error_mode="loose")

    def test_capture_needs_branches_and_a_tensor_example(self):
        with pytest.raises(ValueError, match="at least one branch"):
            ConditionalGraph().capture(torch.ones(2))
        cg = make_graph(double)
        with pytest.raises(TypeError, match="example_input: expected a tensor or a pytree of tensors, got list"):
            cg.capture([1, 2])
        with pytest.raises(ValueError, match="selectors: expected 'bool' and/or 'index'"):
            cg.capture(torch.ones(2), selectors=("float",))

    def test_run_before_capture_and_add_after_capture_name_the_state(self):
        cg = make_graph(double)
        with pytest.raises(RuntimeError, match="needs state 'captured'.*call capture"):
            cg.run("b0", torch.ones(2))
        cg.capture(torch.ones(2))
        with pytest.raises(RuntimeError, match="add_branch\\(\\) needs state 'building'.*before capture"):
            cg.add_branch("late", shift)
        with pytest.raises(RuntimeError, match="capture\\(\\) needs state 'building'"):
            cg.capture(torch.ones(2))

    def test_closed_graph_refuses_runs_and_close_is_idempotent(self):
        cg = make_graph(double)
        cg.capture(torch.ones(2))
        cg.close()
        cg.close()
        assert cg.state is ConditionalState.CLOSED
        with pytest.raises(RuntimeError, match="was closed"):
            cg.run("b0")


# ---------------------------------------------------------------- eager runs
@cpu_only
class TestEagerRuns:
    def test_runs_by_name_index_and_selector_match_eager(self):
        x = torch.randn(5)
        cg = make_graph(double, shift, square)
        cg.capture(x)
        assert cg.strategy == "eager" and "CPU-only" in cg.strategy_reason
        y = torch.randn(5)
        torch.testing.assert_close(cg.run("b0", y), double(y))
        torch.testing.assert_close(cg.run(1, y), shift(y))
        for i, fn in enumerate((double, shift, square)):
            torch.testing.assert_close(cg.run(torch.tensor(i), y), fn(y))
            torch.testing.assert_close(cg.run(torch.tensor([i], dtype=torch.int32), y), fn(y))
        torch.testing.assert_close(cg.run("b2"), square(x))  # the static input as it is

    def test_bool_selector_picks_branch_zero_when_true(self):
        x = torch.randn(4)
        cg = make_graph(double, shift)
        cg.capture(x)
        torch.testing.assert_close(cg.run(torch.tensor(True), x), double(x))
        torch.testing.assert_close(cg.run(torch.tensor([False]), x), shift(x))

    def test_out_of_range_index_selector_returns_zeros(self, caplog):
        x = torch.randn(3)
        cg = make_graph(double, shift)
        cg.capture(x)
        with caplog.at_level(logging.WARNING, logger="gfxgraph"):
            out = cg.run(torch.tensor(7), x)
            out_neg = cg.run(torch.tensor(-1), x)
        assert torch.equal(out, torch.zeros(3)) and torch.equal(out_neg, torch.zeros(3))
        assert "outside [0, 2)" in caplog.text

    def test_fallbacks_are_counted_as_no_gpu(self):
        cg = make_graph(double, shift)
        cg.capture(torch.ones(2))
        cg.run("b0")
        cg.run(torch.tensor(1))
        assert gfxgraph.stats()["fallback_reasons"]["no_gpu"] == 2
        assert set(cg.failed_branches) == {"b0", "b1"}

    def test_pytree_inputs_and_outputs(self):
        def split(inp):
            return {"sum": inp["a"] + inp["b"], "n": 2}

        x = {"a": torch.ones(2), "b": torch.full((2,), 3.0)}
        cg = ConditionalGraph()
        cg.add_branch("split", split)
        cg.capture(x)
        out = cg.run("split", {"a": torch.zeros(2), "b": torch.ones(2)})
        assert out["n"] == 2 and torch.equal(out["sum"], torch.ones(2))

    def test_branch_that_raises_on_the_example_raises_when_run(self, caplog):
        def broken(x):
            raise ZeroDivisionError("boom")

        cg = make_graph(double, broken)
        with caplog.at_level(logging.WARNING, logger="gfxgraph"):
            cg.capture(torch.ones(2))
        assert "raised on the example input" in caplog.text
        with pytest.raises(ZeroDivisionError, match="boom"):
            cg.run("b1")
        torch.testing.assert_close(cg.run("b0"), torch.full((2,), 2.0))

    def test_the_eager_strategy_is_a_registered_class(self):
        cg = make_graph(double, shift)
        cg.capture(torch.ones(2))
        assert isinstance(cg._selection, strategies.EagerStrategy) and cg.strategy == cg._selection.name == "eager"
        assert cg._device_graphs == {}

    def test_forced_one_graph_strategy_needs_one_layout_even_without_a_gpu(self):
        cg = make_graph(double, lambda x: x.sum(), strategy="supergraph")
        with pytest.raises(ValueError, match="strategy='supergraph': device-selected graphs write every branch"):
            cg.capture(torch.ones(3))
        assert cg.state is ConditionalState.CLOSED

    def test_out_of_range_with_differing_layouts_is_an_index_error(self):
        cg = make_graph(double, lambda x: x.sum())
        cg.capture(torch.ones(3))
        with pytest.raises(IndexError, match="different layouts"):
            cg.run(torch.tensor(5))


# ---------------------------------------------------------------- run errors
class TestRunErrors:
    @pytest.fixture
    def cg(self):
        cg = make_graph(double, shift, square)
        if GPU_SKIP_REASON is None:
            cg.capture(torch.ones(4, device="cuda"))
        else:
            cg.capture(torch.ones(4))
        return cg

    def test_unknown_names_and_indices(self, cg):
        with pytest.raises(KeyError, match="no branch named 'zz'; expected one of \\['b0', 'b1', 'b2'\\]"):
            cg.run("zz")
        with pytest.raises(IndexError, match="branch index 3 is out of range; expected 0 <= index < 3"):
            cg.run(3)
        with pytest.raises(IndexError):
            cg.run(-1)

    def test_bad_selectors(self, cg):
        with pytest.raises(TypeError, match="pass 0 if pred else 1"):
            cg.run(True)
        with pytest.raises(TypeError, match="branch: expected a branch name"):
            cg.run(1.5)
        with pytest.raises(TypeError, match="expected a bool or integer tensor, got torch.float32"):
            cg.run(torch.tensor(1.0))
        with pytest.raises(ValueError, match="expected a one-element tensor, got shape \\(2,\\)"):
            cg.run(torch.tensor([0, 1]))
        with pytest.raises(ValueError, match="a bool selector needs exactly 2 branches"):
            cg.run(torch.tensor(True))

    def test_inputs_unlike_the_example_are_named(self, cg):
        dev = cg.static_input.device
        with pytest.raises(ValueError, match="input_tensor: expected Tensor\\(shape=\\(4,\\)"):
            cg.run("b0", torch.ones(5, device=dev))
        with pytest.raises(ValueError, match="dtype=torch.float32"):
            cg.run("b0", torch.ones(4, dtype=torch.float64, device=dev))
        with pytest.raises(TypeError, match="input_tensor"):
            cg.run("b0", [torch.ones(4, device=dev)])


# ------------------------------------------------------------ seed's high level
@cpu_only
class TestSession:
    def test_capture_with_branches_then_replay_by_branch(self):
        g = BridgedCUDAGraph()
        x = torch.randn(3)
        with g.capture(conditional_branches={"dbl": double, "neg": torch.neg}, example_input=x) as cap:
            assert cap.mode == "pending"
        assert cap.mode == "eager" and cap.strategy == "eager"
        torch.testing.assert_close(g.replay(branch="neg", input_tensor=x), -x)
        torch.testing.assert_close(g.replay(branch=0, input_tensor=x), 2 * x)
        torch.testing.assert_close(g.replay(branch=torch.tensor(False)), -x)

    def test_session_errors(self):
        g = BridgedCUDAGraph()
        with pytest.raises(TypeError, match="needs example_input="):
            g.capture(conditional_branches={"a": double})
        with pytest.raises(TypeError, match="expected a dict of name -> callable, got list"):
            g.capture(conditional_branches=[double], example_input=torch.ones(1))
        with pytest.raises(ValueError, match="cannot be combined"):
            g.capture(conditional_branches={"a": double}, dynamic_shapes=True, model_fn=double)
        with pytest.raises(TypeError, match="fn: expected a callable"):
            g.capture(conditional_branches={"a": 3}, example_input=torch.ones(1))
        with g.capture(conditional_branches={"a": double}, example_input=torch.ones(1)):
            pass
        with pytest.raises(TypeError, match="needs branch="):
            g.replay(input_tensor=torch.ones(1))
        with pytest.raises(TypeError, match="batch_size=.*dynamic_shapes"):
            g.replay(batch_size=1, branch="a")


# -------------------------------------------------------------------- loops
def counting_body(i, x):
    x.mul_(0.5).add_(1.0)
    i.add_(1)


class TestLoopArguments:
    def test_loop_condition_validation(self):
        with pytest.raises(ValueError, match="index: expected an int >= 0"):
            LoopCondition(-1)
        with pytest.raises(ValueError, match="op: expected one of <, <=, >, >=, ==, !=, nonzero"):
            LoopCondition(0, "=<", 1)
        with pytest.raises(TypeError, match="value: expected an int or float, got bool"):
            LoopCondition(0, "<", True)

    def test_loop_constructor_errors(self):
        i, x = torch.zeros((), dtype=torch.int64), torch.ones(3)
        with pytest.raises(TypeError, match="cond: expected a LoopCondition or a callable"):
            DeviceWhileLoop(3, counting_body, (i, x))
        with pytest.raises(TypeError, match="body_fn: expected a callable"):
            DeviceWhileLoop(LoopCondition(0), None, (i, x))
        with pytest.raises(ValueError, match="max_iters: expected an int in \\[0, 2\\*\\*31\\)"):
            DeviceWhileLoop(LoopCondition(0), counting_body, (i, x), max_iters=-1)
        with pytest.raises(ValueError, match="strategy: expected one of auto, native, host"):
            DeviceWhileLoop(LoopCondition(0), counting_body, (i, x), strategy="device")
        with pytest.raises(TypeError, match="state: expected a tensor or a non-empty tuple/list of tensors"):
            DeviceWhileLoop(LoopCondition(0), counting_body, ())
        with pytest.raises(ValueError, match="LoopCondition.index 2: expected < 2"):
            DeviceWhileLoop(LoopCondition(2), counting_body, (i, x))
        with pytest.raises(ValueError, match="must hold one element, got shape \\(3,\\)"):
            DeviceWhileLoop(LoopCondition(1), counting_body, (i, x))
        with pytest.raises(TypeError, match="expected an integer value, got 2.5"):
            DeviceWhileLoop(LoopCondition(0, "<", 2.5), counting_body, (i, x))
        with pytest.raises(TypeError, match="compute the condition with cond_fn="):
            DeviceWhileLoop(LoopCondition(0), counting_body, (torch.zeros((), dtype=torch.float16),))


@cpu_only
class TestEagerLoops:
    def test_comparison_loop_matches_a_python_loop(self):
        i0, x0 = torch.zeros((), dtype=torch.int64), torch.randn(4)
        loop = DeviceWhileLoop(LoopCondition(0, "<", 7), counting_body, (i0, x0))
        i, x = loop.run()
        ref_i, ref_x = i0.clone(), x0.clone()
        while ref_i < 7:
            counting_body(ref_i, ref_x)
        assert int(i) == 7 and int(loop.iterations) == 7 and loop.strategy == "eager"
        torch.testing.assert_close(x, ref_x)
        assert torch.equal(i0, torch.zeros((), dtype=torch.int64))  # the caller's state is untouched

    def test_cap_stops_the_loop(self):
        loop = DeviceWhileLoop(LoopCondition(0, "<", 100), counting_body,
                               (torch.zeros((), dtype=torch.int64), torch.ones(2)), max_iters=3)
        i, _ = loop.run()
        assert int(i) == 3 and int(loop.iterations) == 3
        i, _ = loop.run(torch.tensor(99), torch.ones(2))
        assert int(i) == 100 and int(loop.iterations) == 1

    def test_cond_fn_and_functional_body(self):
        loop = DeviceWhileLoop(lambda n, s: s.sum() < 50, lambda n, s: (n + 1, s * 2),
                               (torch.zeros((), dtype=torch.int64), torch.ones(3)))
        n, s = loop.run()
        assert int(n) == 5 and torch.equal(s, torch.full((3,), 32.0))
        assert gfxgraph.stats()["fallback_reasons"]["no_gpu"] == 1

    def test_zero_cap_and_false_condition_run_no_iteration(self):
        state = (torch.zeros((), dtype=torch.int64), torch.ones(2))
        assert int(DeviceWhileLoop(LoopCondition(0, "<", 5), counting_body, state, max_iters=0).run()[0]) == 0
        loop = DeviceWhileLoop(LoopCondition(0, ">", 5), counting_body, state)
        assert int(loop.run()[0]) == 0 and int(loop.iterations) == 0

    def test_run_and_body_errors(self):
        loop = DeviceWhileLoop(LoopCondition(0, "<", 2), counting_body,
                               (torch.zeros((), dtype=torch.int64), torch.ones(2)))
        with pytest.raises(ValueError, match="expected 2 state tensors \\(or none\\), got 1"):
            loop.run(torch.tensor(0))
        with pytest.raises(ValueError, match="run\\(\\) state 1: expected Tensor\\(shape=\\(2,\\)"):
            loop.run(torch.tensor(0), torch.ones(3))
        bad = DeviceWhileLoop(LoopCondition(0, "<", 2), lambda i, x: (i + 1,),
                              (torch.zeros((), dtype=torch.int64), torch.ones(2)))
        with pytest.raises(ValueError, match="expected None \\(in place\\) or 2 tensors"):
            bad.run()
        odd = DeviceWhileLoop(lambda i, x: "go", counting_body, (torch.zeros((), dtype=torch.int64), torch.ones(2)))
        with pytest.raises(TypeError, match="cond_fn: expected a one-element tensor, got str"):
            odd.run()


# ------------------------------------------------------------ strategy choice
def _fake_cuda_platform():
    return Platform("cuda", torch.__version__, "13.0", 1, "Fake H200", "sm_90", None)


def _support(ok_while: bool, ok_branches: bool) -> cond_nodes.ConditionalSupport:
    return cond_nodes.ConditionalSupport(ok_while, ok_branches, ok_branches, 13000, 13000,
                                         None if ok_branches else "driver too old")


class TestStrategySelection:
    @pytest.fixture
    def on_cuda(self, monkeypatch):
        monkeypatch.setattr(cond_nodes, "probe", _fake_cuda_platform)  # the shared strategy rule

        def use(ok_while, ok_branches):
            monkeypatch.setattr(cond_nodes, "conditional_support", lambda: _support(ok_while, ok_branches))
        return use

    def test_auto_prefers_native_then_dispatch(self, on_cuda):
        on_cuda(True, True)
        assert resolve_strategy("auto")[0] == "native"
        on_cuda(True, False)
        strategy, why = resolve_strategy("auto")
        assert strategy == "dispatch" and "driver too old" in why

    def test_forced_strategies(self, on_cuda):
        on_cuda(False, False)
        assert resolve_strategy("supergraph")[0] == "supergraph"
        assert resolve_strategy("dispatch")[0] == "dispatch"
        with pytest.raises(RuntimeError, match="strategy='native' needs CUDA conditional nodes: driver too old"):
            resolve_strategy("native")
        with pytest.raises(ValueError, match="strategy: expected one of"):
            resolve_strategy("best")

    def test_loop_strategies(self, on_cuda):
        on_cuda(True, False)
        assert resolve_loop_strategy("auto")[0] == "native"
        assert resolve_loop_strategy("host")[0] == "host"
        on_cuda(False, False)
        assert resolve_loop_strategy("auto")[0] == "host"
        with pytest.raises(RuntimeError, match="strategy='native' needs CUDA WHILE nodes"):
            resolve_loop_strategy("native")

    @cpu_only
    def test_without_a_gpu_everything_is_eager(self):
        assert resolve_strategy("native")[0] == "eager"
        assert resolve_loop_strategy("native")[0] == "eager"


class _FakeBindingRuntime:
    """What the support probe reads from a cuda-bindings runtime."""

    def __init__(self, driver: int, runtime: int, missing: str | None = None) -> None:
        self.capabilities = RuntimeCaps(runtime, driver, True, True, True, False, "")
        self._missing = missing

    def conditional_nodes_reason(self):
        return self._missing

    def binds_switch_nodes(self):
        return True


class TestSupportProbe:
    @pytest.fixture
    def fake(self, monkeypatch):
        monkeypatch.setattr(cond_nodes, "probe", _fake_cuda_platform)
        monkeypatch.setattr(cond_nodes, "nvrtc_unavailable_reason", lambda: None)

        def use(driver, rt_version, missing=None):
            monkeypatch.setattr(cond_nodes, "get_runtime",
                                lambda kind=None: _FakeBindingRuntime(driver, rt_version, missing))
        return use

    def test_versions_decide_what_is_native(self, fake):
        fake(13000, 13030)
        s = cond_nodes._probe_support()
        assert s.while_loop and s.if_else and s.switch and s.branches and s.reason is None
        fake(12060, 13000)
        s = cond_nodes._probe_support()
        assert s.while_loop and not s.branches
        assert "need CUDA >= 12.8" in s.reason and "driver (12.6)" in s.reason
        fake(12020, 12020)
        s = cond_nodes._probe_support()
        assert not s.while_loop and "WHILE needs >= 12.4" in s.reason

    def test_missing_binding_pieces_and_nvrtc_are_reasons(self, fake, monkeypatch):
        fake(13000, 13000, missing="cuda-bindings 12.2 lacks cudaStreamBeginCaptureToGraph")
        assert "lacks cudaStreamBeginCaptureToGraph" in cond_nodes._probe_support().reason
        fake(13000, 13000)
        monkeypatch.setattr(cond_nodes, "nvrtc_unavailable_reason", lambda: "libnvrtc not found")
        s = cond_nodes._probe_support()
        assert not s.while_loop and "need NVRTC: libnvrtc not found" in s.reason

    def test_hip_has_no_conditional_nodes(self, monkeypatch):
        monkeypatch.setattr(cond_nodes, "probe",
                            lambda: Platform("hip", torch.__version__, "6.2", 1, "gfx1030", "gfx1030", None))
        s = cond_nodes._probe_support()
        assert not (s.while_loop or s.branches) and s.reason.startswith("HIP has no conditional graph nodes")
        assert "per-branch dispatch" in s.reason  # the emulation the table names

    @cpu_only
    def test_cpu_only_reason(self):
        s = cond_nodes.conditional_support()
        assert not s.while_loop and "CPU-only" in s.reason


# ------------------------------------------------ strategies as registered classes
class TestStrategyRegistry:
    @pytest.fixture
    def registry(self, monkeypatch):
        """A copy of the registry for the test: classes it registers vanish afterwards."""
        monkeypatch.setattr(strategies, "_REGISTRY", dict(strategies._REGISTRY))

    def test_registered_names_are_the_documented_ones(self):
        assert strategies.strategy_names() == ("native", "supergraph", "dispatch")
        assert strategies.strategy_names(requestable=False) == ("native", "supergraph", "dispatch", "eager")
        assert cond_graph.STRATEGIES == ("auto", "native", "supergraph", "dispatch")
        assert typing.get_args(cond_graph.Strategy) == cond_graph.STRATEGIES
        for name in strategies.strategy_names(requestable=False):
            cls = strategies.strategy_class(name)
            assert issubclass(cls, strategies.BranchStrategy) and cls.name == name and cls.summary
            assert f'``"{name}"``' in strategies.__doc__ and f'``"{name}"``' in cond_graph.__doc__
        assert [n for n in strategies.strategy_names() if strategies.strategy_class(n).shares_outputs] == \
            ["native", "supergraph"]
        assert strategies.strategy_class("native").fallback == strategies.strategy_class("supergraph").fallback \
            == "dispatch"
        with pytest.raises(ValueError, match="expected one of native, supergraph, dispatch, eager, got 'fast'"):
            strategies.strategy_class("fast")

    def test_eager_is_chosen_never_requested(self):
        with pytest.raises(ValueError, match="strategy: expected one of auto, native, supergraph, dispatch, "
                                             "got 'eager'"):
            ConditionalGraph(strategy="eager")

    def test_a_registered_class_is_taken_by_name(self, registry, monkeypatch):
        with pytest.raises(ValueError, match="got 'probe'"):
            ConditionalGraph(strategy="probe")

        @strategies.register_strategy
        class Probe(strategies.BranchStrategy):
            name = "probe"
            summary = "a strategy of the tests"

        assert strategies.strategy_names() == ("native", "supergraph", "dispatch", "probe")
        assert strategies.strategy_class("probe") is Probe
        assert ConditionalGraph(strategy="probe").requested_strategy == "probe"
        monkeypatch.setattr(cond_nodes, "probe", _fake_cuda_platform)
        assert resolve_strategy("probe") == ("probe", "strategy='probe' was requested")

    def test_registration_errors(self, registry):
        class Nameless(strategies.BranchStrategy):
            pass

        class Auto(strategies.BranchStrategy):
            name = "auto"

        class Other(strategies.BranchStrategy):
            name = "dispatch"

        with pytest.raises(TypeError, match="expected a BranchStrategy subclass"):
            strategies.register_strategy(object)
        with pytest.raises(ValueError, match="Nameless.name: expected a non-empty str other than 'auto', got ''"):
            strategies.register_strategy(Nameless)
        with pytest.raises(ValueError, match="got 'auto'"):
            strategies.register_strategy(Auto)
        with pytest.raises(ValueError, match="'dispatch' is taken by DispatchStrategy"):
            strategies.register_strategy(Other)
        assert strategies.register_strategy(strategies.DispatchStrategy) is strategies.DispatchStrategy


# ------------------------------------------------- captures through the Capturer
class SimGraph:
    """A captured graph's stand-in: a replay runs the work again into the captured outputs."""

    def __init__(self, run, outputs):
        self.run, self.outputs, self.resets = run, outputs, 0

    def replay(self):
        new = self.run()
        if self.outputs is not None:
            copy_into(self.outputs, new)

    def reset(self):
        self.resets += 1


class SimCapturer(Capturer):
    """A Capturer that runs on the CPU: warm-ups and the "capture" run eagerly; the graph replays them.
    Its failures are the real one's: a warm-up that raises, or a capture named in ``fail``."""

    def __init__(self, *, fail=(), warmup_iters=1):
        super().__init__(warmup_iters=warmup_iters)
        self.calls: list[tuple[str, int]] = []
        self.fail = set(fail)

    def capture(self, run, what, *, warm=None, keep_warm=False, freeze_gc=True, cap_checked=False):
        runs = [run] * self.warmup_iters if warm is None else list(warm)
        self.calls.append((what, len(runs)))
        result = Captured(stage="warm_up")
        try:
            out = None
            for fn in runs:
                out = fn()
            result.warm = out if keep_warm else None
            result.stage = "capture"
            if what in self.fail:
                raise RuntimeError("capture refused by the test")
            result.outputs = run()
        except Exception as exc:
            reason = Reason.CAPTURE_FAILED if result.stage == "capture" else Reason.WARMUP_FAILED
            result.fallback, result.error = Fallback(reason, f"{what}: {type(exc).__name__}: {exc}"), exc
            return result
        result.graph = SimGraph(run, result.outputs)
        return result


class TestSharedCapturer:
    def test_graph_and_loop_hold_a_capturer_with_their_options(self):
        cg = ConditionalGraph(warmup_iters=3, pool=(0, 7), capture_error_mode="global")
        cap = cg._capturer
        assert type(cap) is Capturer and cg._branches.capturer is cap
        assert cap.warmup_iters == 3 and cap.pool_handle == (0, 7) and cap.capture_error_mode == "global"
        loop = DeviceWhileLoop(LoopCondition(0, "<", 2), counting_body,
                               (torch.zeros((), dtype=torch.int64), torch.ones(2)), warmup_iters=2)
        assert type(loop._capturer) is Capturer and loop._capturer.warmup_iters == 2

    def test_branches_capture_through_the_capturer_and_keep_a_fallback(self):
        cap = SimCapturer(fail={"branch 'b1'"}, warmup_iters=2)
        bs = BranchSet(cap)
        fns = (double, shift, square)
        for i, fn in enumerate(fns):
            bs.add(f"b{i}", fn)
        bs.capture(torch.randn(4), device=0)
        assert cap.calls == [("branch 'b0'", 2), ("branch 'b1'", 2), ("branch 'b2'", 2)]
        failed = bs.items[1]
        assert failed.graph is None and isinstance(failed.fallback, Fallback)
        assert failed.fallback.reason is Reason.CAPTURE_FAILED and "capture refused" in failed.fallback.detail
        assert bs.uniform is not None  # the failed branch's layout came from its warm-up
        y = torch.randn(4)
        for i, fn in enumerate(fns):
            torch.testing.assert_close(bs.run_index(i, y), fn(y))
        assert gfxgraph.stats()["fallback_reasons"] == {"capture_failed": 1}
        bs.close()
        assert bs.items[0].graph is None and bs.static_input is None

    def test_a_branch_whose_warm_up_raises_runs_eagerly(self, caplog):
        def broken(x):
            raise ZeroDivisionError("boom")

        bs = BranchSet(SimCapturer())
        bs.add("ok", double)
        bs.add("broken", broken)
        with caplog.at_level(logging.WARNING, logger="gfxgraph"):
            bs.capture(torch.ones(2), device=0)
        assert "branch 'broken' runs eagerly: warm-up raised boom" in caplog.text
        assert bs.items[1].fallback.reason is Reason.WARMUP_FAILED and bs.uniform is None

    @pytest.mark.parametrize("name", ["dispatch", "probe"])
    def test_strategies_select_and_run_by_index_over_the_branches(self, name, monkeypatch):
        monkeypatch.setattr(strategies, "_REGISTRY", dict(strategies._REGISTRY))

        @strategies.register_strategy
        class Probe(strategies.BranchStrategy):  # the base class's behaviour: per-branch dispatch
            name = "probe"
            summary = "a strategy of the tests"

        bs = BranchSet(SimCapturer())
        fns = (double, shift, square)
        for i, fn in enumerate(fns):
            bs.add(f"b{i}", fn)
        bs.capture(torch.randn(3), device=0)
        chosen = strategies.strategy_class(name)(bs)
        assert chosen.describe().startswith(f"{name}: ") and chosen.graphs == {}
        chosen.build("index")  # nothing to capture: one host read, then the branch's graph
        y = torch.randn(3)
        for i, fn in enumerate(fns):
            torch.testing.assert_close(chosen.select("index", torch.tensor(i), y), fn(y))
            torch.testing.assert_close(chosen.run_index(i, y), fn(y))
        assert torch.equal(chosen.select("index", torch.tensor(5), y), torch.zeros(3))

    def test_host_loop_captures_through_its_capturer(self):
        i0, x0 = torch.zeros((), dtype=torch.int64), torch.randn(4)
        loop = DeviceWhileLoop(LoopCondition(0, "<", 7), counting_body, (i0, x0), warmup_iters=2)
        cap = loop._capturer = SimCapturer(warmup_iters=2)
        loop._strategy = "host"  # what capture() sets, after the GPU checks this machine cannot pass
        loop._capture_as("host")
        assert cap.calls == [("DeviceWhileLoop", 2)]
        assert torch.equal(loop.state[0], i0) and torch.equal(loop.state[1], x0)  # the warm-ups were undone
        i, x = loop.run()
        ref_i, ref_x = i0.clone(), x0.clone()
        while ref_i < 7:
            counting_body(ref_i, ref_x)
        assert int(i) == 7 and int(loop.iterations) == 7 and loop.strategy == "host"
        torch.testing.assert_close(x, ref_x)
        assert gfxgraph.stats()["fallback_reasons"] == {}
        loop.close()  # every graph of the pool is gone: the next capture gets a fresh capturer
        assert loop.strategy == "pending" and type(loop._capturer) is Capturer and loop._capturer is not cap

    @pytest.mark.parametrize("stage", ["capture", "warm-up"])
    def test_loop_whose_capture_fails_holds_the_fallback_and_runs_eagerly(self, stage):
        calls = []

        def body(i, x):
            calls.append(1)
            if stage == "warm-up" and len(calls) == 1:
                raise ZeroDivisionError("first run")
            counting_body(i, x)

        loop = DeviceWhileLoop(LoopCondition(0, "<", 3), body, (torch.zeros((), dtype=torch.int64), torch.ones(2)))
        loop._capturer = SimCapturer(fail={"DeviceWhileLoop"})
        loop._strategy = "host"
        loop._capture_as("host")
        reason = Reason.CAPTURE_FAILED if stage == "capture" else Reason.WARMUP_FAILED
        assert loop.strategy == "eager" and loop.strategy_reason.startswith(f"host {stage} failed: ")
        assert isinstance(loop._fallback, Fallback) and loop._fallback.reason is reason
        i, _ = loop.run()
        assert int(i) == 3 and gfxgraph.stats()["fallback_reasons"] == {reason.value: 1}


# ---------------------------------------------------------------- NVRTC source
def _nvrtc_or_skip():
    from hipgraph_bridge.conditional.kernels import nvrtc_unavailable_reason

    why = nvrtc_unavailable_reason()
    if why:
        pytest.skip(f"NVRTC unavailable: {why[:120]}")


class TestNvrtcKernels:
    def test_dtype_kinds(self):
        from hipgraph_bridge.conditional.kernels import dtype_kind

        assert dtype_kind(torch.bool) == 0 and dtype_kind(torch.int64) == 4 and dtype_kind(torch.float64) == 6
        with pytest.raises(TypeError, match="got torch.bfloat16"):
            dtype_kind(torch.bfloat16)

    def test_setter_source_compiles_to_ptx_and_cubin(self):
        _nvrtc_or_skip()
        from hipgraph_bridge.conditional.kernels import KERNEL_SOURCE, compile_source

        images = dict(compile_source(KERNEL_SOURCE, 90))
        ptx = images["ptx compute_90"]
        assert ptx.endswith(b"\x00")  # the driver needs NUL-terminated PTX
        for name in (b"gfxgraph_set_if", b"gfxgraph_set_switch", b"gfxgraph_loop_step"):
            assert b".entry " + name in ptx
        assert b"cudaGraphSetConditional" in ptx
        assert "cubin sm_90" in images

    def test_unknown_arch_falls_back_to_newest_virtual_arch(self):
        _nvrtc_or_skip()
        from hipgraph_bridge.conditional.kernels import KERNEL_SOURCE, compile_source

        labels = [label for label, _ in compile_source(KERNEL_SOURCE, 999)]
        assert len(labels) == 1 and labels[0].startswith("ptx compute_")

    def test_compile_error_carries_the_log(self):
        _nvrtc_or_skip()
        from hipgraph_bridge.conditional.kernels import compile_source

        with pytest.raises(GraphRuntimeError, match="(?s)nvrtcCompileProgram.*not_declared_here"):
            compile_source('extern "C" __global__ void k() { not_declared_here(); }', 90)


# ------------------------------------------------------------------- the op
class TestConditionalSelectOp:
    def test_selects_without_aliasing(self):
        a, b = torch.randn(2, 3), torch.randn(2, 3)
        out = conditional_select(torch.tensor(True), a, b)
        assert torch.equal(out, a) and out.data_ptr() != a.data_ptr()
        assert torch.equal(torch.ops.gfxgraph.conditional_select(torch.tensor([False]), a, b), b)

    def test_errors_name_what_was_expected(self):
        a = torch.ones(2)
        with pytest.raises(TypeError, match="pred: expected a bool tensor, got torch.int64"):
            conditional_select(torch.tensor(1), a, a)
        with pytest.raises(ValueError, match="pred: expected one element, got shape \\(2,\\)"):
            conditional_select(torch.tensor([True, False]), a, a)
        with pytest.raises(ValueError, match="expected a and b of one shape and dtype"):
            conditional_select(torch.tensor(True), a, torch.ones(3))
        with pytest.raises(ValueError, match="expected a and b of one shape and dtype"):
            conditional_select(torch.tensor(True), a, torch.ones(2, dtype=torch.float64))

    def test_gradient_flows_to_the_selected_input(self):
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        conditional_select(torch.tensor(False), a, b).sum().backward()
        assert torch.equal(a.grad, torch.zeros(3)) and torch.equal(b.grad, torch.ones(3))

    def test_opcheck(self):
        from torch.library import opcheck

        args = (torch.tensor(False), torch.randn(2, 3), torch.randn(2, 3))
        result = opcheck(torch.ops.gfxgraph.conditional_select.default, args)
        assert all(v == "SUCCESS" for v in result.values()), result

    def test_traces_under_torch_compile_fullgraph(self):
        def f(pred, a, b):
            return torch.ops.gfxgraph.conditional_select(pred, a * 2, b + 1).sum()

        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        a, b = torch.ones(4), torch.zeros(4)
        assert float(compiled(torch.tensor(True), a, b)) == 8.0
        assert float(compiled(torch.tensor(False), a, b)) == 4.0

    @pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                        reason="inductor on CPU needs a C++ compiler")
    def test_runs_under_inductor(self):
        torch._dynamo.reset()

        def f(pred, a, b):
            return torch.ops.gfxgraph.conditional_select(pred, a.sin(), b.cos())

        compiled = torch.compile(f, fullgraph=True)
        a, b = torch.randn(8), torch.randn(8)
        torch.testing.assert_close(compiled(torch.tensor(True), a, b), a.sin())
        torch.testing.assert_close(compiled(torch.tensor(False), a, b), b.cos())


# --------------------------------------------------------- runtime additions
class _FakeHipCaptureLib:
    """The HIP entry points the supergraph strategy uses, as real C callbacks."""

    def __init__(self, *, status=1, graph=0x5000, deps=(0x61, 0x62), nodes=(0x71, 0x72, 0x73)):
        from hipgraph_bridge.runtime._ctypes import _CAPTURE_INFO_6, _signatures

        self.enabled: list[tuple[int, int, int]] = []
        self._deps = (ctypes.c_void_p * len(deps))(*deps)
        self._nodes, self._status, self._graph = nodes, status, graph
        self._keep = []
        impls = {"RuntimeGetVersion": self._version, "GraphGetNodes": self._get_nodes,
                 "GraphNodeGetType": self._node_type, "GraphNodeSetEnabled": self._set_enabled}
        table = {**_signatures("hip"), "StreamGetCaptureInfo_v2": (*_CAPTURE_INFO_6, False)}
        for suffix, (restype, argtypes, _required) in table.items():
            cb_restype = ctypes.c_void_p if restype is ctypes.c_char_p else restype
            impl = self._capture_info if suffix == "StreamGetCaptureInfo_v2" else impls.get(suffix)
            fn = ctypes.CFUNCTYPE(cb_restype, *argtypes)(impl or (lambda *args: 0))
            self._keep.append(fn)
            setattr(self, "hip" + suffix, fn)

    def _version(self, out):
        out[0] = 60241
        return 0

    def _capture_info(self, stream, status, cid, graph, deps, count):
        status[0] = self._status
        cid[0] = 42
        graph[0] = self._graph
        deps[0] = ctypes.addressof(self._deps)
        count[0] = len(self._deps)
        return 0

    def _get_nodes(self, graph, nodes, count):
        if nodes:
            for i, n in enumerate(self._nodes[: count[0]]):
                nodes[i] = n
        count[0] = len(self._nodes)
        return 0

    def _node_type(self, node, out):
        out[0] = {0x71: 0, 0x72: 5, 0x73: 1}.get(node, 4)
        return 0

    def _set_enabled(self, exec_, node, enabled):
        self.enabled.append((exec_, node, enabled))
        return 0


class TestRuntimeAdditions:
    def test_hip_capture_info_nodes_types_and_enable(self):
        from hipgraph_bridge.runtime._ctypes import CtypesRuntime

        fake = _FakeHipCaptureLib()
        rt = CtypesRuntime(fake, "hip", path="libamdhip64.so.6")
        info = rt.stream_capture_info(0x10)
        assert info == CaptureInfo(1, 42, 0x5000, (0x61, 0x62))
        assert rt.graph_nodes(0x5000) == [0x71, 0x72, 0x73]
        assert [rt.node_type(n) for n in (0x71, 0x72, 0x73)] == [0, 5, 1]
        rt.exec_node_set_enabled(0x900, 0x71, False)
        assert fake.enabled == [(0x900, 0x71, 0)]

    def test_inactive_capture_reports_no_graph(self):
        from hipgraph_bridge.runtime._ctypes import CtypesRuntime

        rt = CtypesRuntime(_FakeHipCaptureLib(status=0), "hip")
        assert rt.stream_capture_info(0x10) == CaptureInfo(0, 0, 0, ())

    def test_active_capture_without_a_graph_is_a_clear_error(self):
        from hipgraph_bridge.runtime._ctypes import CtypesRuntime

        rt = CtypesRuntime(_FakeHipCaptureLib(graph=0), "hip")
        with pytest.raises(GraphRuntimeError, match="returned no graph"):
            rt.stream_capture_info(0x10)

    def test_hip_has_no_conditional_node_calls(self):
        from hipgraph_bridge.runtime._ctypes import CtypesRuntime

        rt = CtypesRuntime(_FakeHipCaptureLib(), "hip")
        assert rt.conditional_nodes_reason() == HIP_NO_CONDITIONAL
        for call in (lambda: rt.conditional_handle_create(1), lambda: rt.graph_add_conditional(1, [], 2, 0, 1),
                     lambda: rt.stream_set_capture_dependencies(1, [2]),
                     lambda: rt.stream_begin_capture_to_graph(1, 2)):
            with pytest.raises(NotImplementedError, match="HIP has no conditional graph nodes"):
                call()

    def test_capture_info_symbol_choice_by_version(self):
        from hipgraph_bridge.runtime._ctypes import _capture_info_candidates

        assert [n for n, _ in _capture_info_candidates("hip", 60241)] == ["StreamGetCaptureInfo_v2"]
        cuda13 = _capture_info_candidates("cuda", 13000)
        assert [n for n, _ in cuda13] == ["StreamGetCaptureInfo_v3", "StreamGetCaptureInfo"]
        assert all(len(sig[1]) == 7 for _, sig in cuda13)  # never fewer arguments than CUDA 13 takes
        assert [n for n, _ in _capture_info_candidates("cuda", 12040)][-1] == "StreamGetCaptureInfo_v2"

    def test_lazily_bound_hip_symbols_are_documented(self):
        from hipgraph_bridge.runtime._ctypes import bound_symbols, lazily_bound_symbols

        documented = {line.split("#", 1)[0].strip() for line in SYMBOLS_FILE.read_text().splitlines()}
        used = set(lazily_bound_symbols("hip")) | {"hipGraphNodeGetType", "hipGraphNodeSetEnabled"}
        assert used <= documented
        assert {"hipGraphNodeGetType", "hipGraphNodeSetEnabled"} <= set(bound_symbols("hip"))

    @pytest.mark.skipif(GPU_SKIP_REASON is None, reason="NULL handles are only safe without a driver")
    def test_cuda_bindings_marshal_every_new_call(self):
        pytest.importorskip("cuda.bindings")
        from hipgraph_bridge.runtime import get_runtime, reset_runtime_cache

        reset_runtime_cache()
        rt = get_runtime("cuda-bindings")
        assert rt.conditional_nodes_reason() is None
        calls = [lambda: rt.stream_capture_info(0), lambda: rt.graph_nodes(0), lambda: rt.node_type(0),
                 lambda: rt.exec_node_set_enabled(0, 0, True), lambda: rt.conditional_handle_create(0),
                 lambda: rt.graph_add_conditional(0, [0x10], 5, COND_SWITCH, 3),
                 lambda: rt.stream_set_capture_dependencies(0, [0x10]),
                 lambda: rt.stream_begin_capture_to_graph(0, 0)]
        for call in calls:  # no TypeError from the binding: each reaches the runtime, which refuses
            with pytest.raises(GraphRuntimeError, match="cuda[A-Za-z]+: cudaError"):
                call()
        reset_runtime_cache()


def test_scalar_checks_of_native_nodes_name_the_expectation():
    with pytest.raises(TypeError, match="pred: expected a one-element CUDA tensor, got int"):
        native_nodes._check_scalar("pred", 1, (torch.bool,), 0)
    with pytest.raises(ValueError, match="index: expected a one-element torch.int64 tensor on cuda:0, got shape"):
        native_nodes._check_scalar("index", torch.zeros(2, dtype=torch.int64), (torch.int64,), 0)
