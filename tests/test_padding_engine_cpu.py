"""The pool's GPU path on the CPU: captures and replays stood in by a capturer whose "graph" reruns the captured
function into its outputs, so the first-call flow, the poisoned-replay check and the fast calls run here."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import gfxgraph
from hipgraph_bridge import ShapeBucketPool
from hipgraph_bridge.bucketing import engine as engine_mod
from hipgraph_bridge.graph.capturer import Captured
from hipgraph_bridge.padding import layout as layout_mod


class _Graph:
    def __init__(self, run: Any, outputs: Any) -> None:
        self.run, self.outputs = run, outputs

    def replay(self) -> None:
        new = self.run()
        for o, n in zip(self.outputs if isinstance(self.outputs, tuple) else (self.outputs,),
                        new if isinstance(new, tuple) else (new,)):
            o.copy_(n)

    def reset(self) -> None:
        pass

    def replay_parts(self) -> tuple[Any, ...]:  # SafeCUDAGraph's: launch, tick, sample mask, record
        return type(self).replay, itertools.count().__next__, 255, lambda ns: None


class _Capturer:
    capturing = False  # what torch.cuda.is_current_stream_capturing() would say
    seconds = 0.0
    pool_handle = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def pool_bytes(self) -> int:
        return 0

    def release_pool(self) -> None:
        pass

    def refusal(self) -> None:
        return None

    def run(self, fn: Any, *, tracer: Any = None) -> Any:
        with torch.no_grad():
            if tracer is None:
                return fn()
            with tracer:
                return fn()

    def capture(self, run: Any, what: str, *, warm: Any = None, keep_warm: bool = False, freeze_gc: bool = True,
                cap_checked: bool = False) -> Captured:
        with torch.no_grad():
            for w in warm or ():
                w()
            _Capturer.capturing = True
            try:
                out = run()
            finally:
                _Capturer.capturing = False
        return Captured(graph=_Graph(run, out), outputs=out, stage="capture")  # type: ignore[arg-type]


class _Order:
    raw = None  # CallOrder's handle of the previous call's stream (none on the CPU)

    def after_previous(self, device: int | None = None) -> None:
        pass

    def forget(self) -> None:
        pass


@pytest.fixture
def graphs(monkeypatch):
    """Pools built inside take the GPU path with the stand-in capturer."""
    monkeypatch.setattr(engine_mod, "Capturer", _Capturer)
    monkeypatch.setattr(engine_mod, "release_outputs", lambda leaves: leaves)
    monkeypatch.setattr(engine_mod, "record_on_current_stream", lambda leaves: None)
    monkeypatch.setattr(layout_mod.CallLayout, "check_on", lambda self, device: None)

    def make(model: Any, buckets: list[int], **kw: Any) -> ShapeBucketPool:
        pool = ShapeBucketPool(model, buckets, progress=False, **kw)
        pool._engine.graphs, pool._engine.simulate, pool._engine.order = True, False, _Order()
        return pool

    return make


def test_a_bucket_is_captured_checked_and_then_replayed(graphs):
    runs = []

    def model(x):
        runs.append(x.shape[0])
        return torch.tanh(x) * 2

    pool = graphs(model, [4, 8])
    for n in (3, 3, 8, 5, 6):
        x = torch.randn(n, 4)
        torch.testing.assert_close(pool(x), torch.tanh(x) * 2)
    # first call: its own 3 rows (traced), bucket 4's capture, the check's replays (the stand-in graph reruns
    # the model at 4 rows); later every run is a replay of bucket 4 or 8, but the 8-row call's own run and
    # the 5-row call's: bucket 8's first padded call is checked against the rows it asked for
    assert runs[:2] == [3, 4] and set(runs[2:]) == {4, 5, 8} and runs.count(5) == 1
    engine = pool._engine
    assert all(e.confirmed for e in engine.entries.values() if e.size == 4) and not pool.unpadded
    assert set(engine.fast) >= {3, 8}  # checked sizes take the fast call


def test_the_check_catches_a_coupling_the_trace_believes_away(graphs):
    @torch.library.custom_op("gfxtest_cpu::rowmix_pointwise", mutates_args=(), tags=(torch.Tag.pointwise,))
    def rowmix(x: torch.Tensor) -> torch.Tensor:
        return x + x.sum(dim=0, keepdim=True)

    @rowmix.register_fake
    def _(x):
        return torch.empty_like(x)

    pool = graphs(lambda x: rowmix(x) * 2, [8])
    for n in (5, 5, 3):
        x = torch.randn(n, 4)
        torch.testing.assert_close(pool(x), (x + x.sum(0, keepdim=True)) * 2)
    why = pool.unpadded[()]
    assert why.reason == "padding_changes_results" and "NaN" in why.detail
    assert pool.bucket_for(5) == 5


def test_a_host_read_outside_captures_lets_the_capture_trace_decide(graphs):
    """As transformers' masks: a branch on batch values that a capture skips (it cannot read the host)."""
    def model(x):
        if not _Capturer.capturing and bool((x[:, 0] == 123.0).any()):
            return x * 0  # never taken on this data, but the trace cannot know that
        return x * 3 + 1

    pool = graphs(model, [8])
    for n in (5, 3, 8, 5):
        x = torch.randn(n, 4)
        torch.testing.assert_close(pool(x), x * 3 + 1)
    assert not pool.unpadded and pool.bucket_for(5) == 8  # padded: the captured graph's own trace proved it

    def branchy(x):  # eager takes a row-wise branch, a capture the coupled one
        return x * 3 + 1 if not _Capturer.capturing and bool(x.sum() > -1e9) else x - x.mean(0)

    coupled = graphs(branchy, [8])
    x = torch.randn(5, 4)
    torch.testing.assert_close(coupled(x), x * 3 + 1)  # the first call is its own (eager) run
    assert coupled.unpadded[()].reason == "rows_coupled"  # the capture's trace refused padding


def test_a_pool_closed_and_called_again_captures_anew(graphs):
    pool = graphs(lambda x: x + 1, [4])
    pool(torch.zeros(4, 2))
    pool.close()
    torch.testing.assert_close(pool(torch.zeros(3, 2)), torch.ones(3, 2))
    assert pool.captured_buckets == [4] and gfxgraph.stats()["fallback_count"] == 0


# ----------------------------------------------------------------------------- the fast paths' guards
class _Spy:
    """Counts the pool's checked zero-copy calls (the closure's way out) and the stand-in graph's replays."""

    def __init__(self, pool: ShapeBucketPool, monkeypatch: Any) -> None:
        self.checked = 0
        self.replays = 0
        original = pool._run_io

        def counted(io: Any) -> Any:
            self.checked += 1
            return original(io)

        monkeypatch.setattr(pool, "_run_io", counted)
        spy = self

        def replay(graph: Any) -> None:
            spy.replays += 1
            _Graph.replay(graph)

        monkeypatch.setattr(_Graph, "replay_parts",
                            lambda g: (replay, itertools.count().__next__, 255, lambda ns: None))


def _zero_copy_pool(graphs: Any, monkeypatch: Any, **kw: Any) -> tuple[ShapeBucketPool, Any, _Spy]:
    pool = graphs(lambda x: torch.tanh(x) * 2, [8], copy_outputs=False, **kw)
    spy = _Spy(pool, monkeypatch)
    pool(torch.randn(5, 4))
    io = pool.static_io(5)
    return pool, io, spy


def _run(io: Any, x: torch.Tensor) -> torch.Tensor:
    io.args[0].copy_(x)
    return io.run()


def test_zero_copy_calls_replay_through_the_closure_once_checked(graphs, monkeypatch):
    pool, io, spy = _zero_copy_pool(graphs, monkeypatch)
    for _ in range(2):  # the first takes the checked call (it installs the closure), the second is the fast one
        _run(io, torch.randn(5, 4))
    checked, replays = spy.checked, spy.replays
    for _ in range(5):
        x = torch.randn(5, 4)
        torch.testing.assert_close(_run(io, x), torch.tanh(x) * 2)
    assert "run" in vars(io) and spy.checked == checked and spy.replays == replays + 5


@pytest.mark.parametrize("switch", ["debug", "validate"])
def test_debug_and_validate_take_the_checked_call(graphs, monkeypatch, switch):
    pool, io, spy = _zero_copy_pool(graphs, monkeypatch)
    for _ in range(2):
        _run(io, torch.randn(5, 4))
    before = spy.checked
    gfxgraph.enable(**{switch: True})
    try:
        x = torch.randn(5, 4)
        torch.testing.assert_close(_run(io, x), torch.tanh(x) * 2)
        torch.testing.assert_close(pool(x), torch.tanh(x) * 2)
    finally:
        gfxgraph.disable()
    assert spy.checked == before + 1


def test_a_larger_call_sends_the_next_smaller_one_through_the_fill(graphs, monkeypatch):
    pool, io, spy = _zero_copy_pool(graphs, monkeypatch)
    for _ in range(2):
        _run(io, torch.randn(5, 4))
    pool(torch.randn(8, 4))  # rows 5..7 of the buffer now hold real values
    before = spy.checked
    x = torch.randn(5, 4)
    torch.testing.assert_close(_run(io, x), torch.tanh(x) * 2)
    assert spy.checked == before + 1  # the checked call refilled the padding
    assert torch.equal(pool.static_inputs[0][5:], torch.zeros(3, 4))


def test_padding_filled_once_keeps_the_fast_path_after_a_larger_call(graphs, monkeypatch):
    pool, io, spy = _zero_copy_pool(graphs, monkeypatch, pad_value=None)
    for _ in range(2):
        _run(io, torch.randn(5, 4))
    pool(torch.randn(8, 4))
    before = spy.checked
    for _ in range(3):
        x = torch.randn(5, 4)
        torch.testing.assert_close(_run(io, x), torch.tanh(x) * 2)
    assert spy.checked == before


def test_a_closed_pools_zero_copy_call_raises(graphs, monkeypatch):
    pool, io, spy = _zero_copy_pool(graphs, monkeypatch)
    for _ in range(2):
        _run(io, torch.randn(5, 4))
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        io.run()


def test_a_new_generation_sends_the_closure_to_the_checked_call(graphs, monkeypatch):
    pool, io, spy = _zero_copy_pool(graphs, monkeypatch)
    for _ in range(2):
        _run(io, torch.randn(5, 4))
    pool._engine._next_generation()  # what a recapture, a refusal or a close does
    before = spy.checked
    x = torch.randn(5, 4)
    torch.testing.assert_close(_run(io, x), torch.tanh(x) * 2)
    assert spy.checked == before + 1


def test_the_fast_call_copies_every_argument_in_with_one_dispatch(graphs, monkeypatch):
    def model(ids, pos, scale):
        return ids.float() * scale + pos

    pool = graphs(model, [4], static_args=[2], copy_outputs=True)
    spy = _Spy(pool, monkeypatch)
    calls = []
    real = engine_mod.copy_all
    monkeypatch.setattr(engine_mod, "copy_all", lambda d, s: (calls.append(len(d)), real(d, s)))
    for i in range(4):
        ids, pos = torch.randint(0, 9, (4, 2)), torch.randn(4, 2)
        scale = torch.tensor(float(i + 1))
        torch.testing.assert_close(pool(ids, pos, scale), ids.float() * scale + pos)
    # the first call captures; the next three take the fast call, each with one copy of all three tensors
    assert calls == [3, 3, 3] and spy.replays >= 3


def test_a_static_io_of_a_checked_size_replays_from_its_first_run(graphs, monkeypatch):
    pool, _, spy = _zero_copy_pool(graphs, monkeypatch)
    _run(pool.static_io(5), torch.randn(5, 4))  # installs the fast call of 5 rows
    before = spy.checked
    io = pool.static_io(5)
    x = torch.randn(5, 4)
    torch.testing.assert_close(_run(io, x), torch.tanh(x) * 2)
    assert spy.checked == before


def test_a_run_taken_before_the_first_call_forwards_to_the_fast_one(graphs, monkeypatch):
    pool = graphs(lambda x: torch.tanh(x) * 2, [8], copy_outputs=False)
    spy = _Spy(pool, monkeypatch)
    pool(torch.randn(8, 4))
    io = pool.static_io(3)  # no call of 3 rows yet: the checked call comes first
    run = io.run
    for _ in range(4):
        x = torch.randn(3, 4)
        io.args[0].copy_(x)
        torch.testing.assert_close(run(), torch.tanh(x) * 2)
    assert spy.checked == 1  # the first; the others forward to the closure it installed
