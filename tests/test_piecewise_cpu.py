"""Piecewise graphs in the ``gfxgraph`` compile backend, without a GPU.

``simulate_padding=True`` runs the pieces through the same pipeline a GPU would
(static buffers, padding to the token bucket, narrowing before every splitting
op, padding again after it), the compiled piece called where a replay would be.
Most tests use ``compiler="aot_eager"`` (no C++ build).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import gfxgraph
from hipgraph_bridge import compile as cb
from hipgraph_bridge.compile import BackendOptions, PiecewiseSubgraph, SubgraphState, backend_stats, register
from hipgraph_bridge.padding.fx import trace_graph
from hipgraph_bridge.compile.splitting import DEFAULT_SPLITTING_OPS, SplittingOps, parse_splitting_ops
from hipgraph_bridge.errors import ConfigError
from hipgraph_bridge.fallbacks import Fallback, Reason
from hipgraph_bridge.graph.capturer import Captured

from _piecewise_models import BEFORE, SEEN, CachedAttention, TinyLM, frames, fresh_dynamo  # noqa: F401 (autouse)

register()  # also from a checkout that is not installed (no entry points)
PIECEWISE = {"piecewise": True, "compiler": "aot_eager", "simulate_padding": True}
# The depth of the model for the tests of which path a call takes and of the options, none of which depends on
# it: one layer (two pieces) compiles in two thirds of the time; the two-layer model (a middle piece, split on
# both sides) is the one the tests of the pieces' results and statuses use.
SHALLOW = 1
def inputs(n: int, *, batch: int = 1, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(n))
    return ids, torch.arange(n).expand(batch, n)


def run_lengths(model: nn.Module, lengths, *, options=None, batch: int = 1, **kw) -> object:
    c = torch.compile(model, backend="gfxgraph", options={**PIECEWISE, **(options or {})}, **kw)
    with torch.no_grad():
        for n in lengths:
            ids, pos = inputs(n, batch=batch)
            torch.testing.assert_close(c(ids, pos), model(ids, pos), msg=f"{n} tokens")
    return c


# ------------------------------------------------------------------ results
def test_varying_sequence_lengths_equal_eager_through_the_padded_pieces():
    m = TinyLM().eval()
    run_lengths(m, [5, 7, 9, 3, 16, 17, 33, 12, 2, 64, 40])
    (frame,) = frames()
    assert frame.state is SubgraphState.GRAPHED and len(frame.pieces) == 3 and len(frame.splitters) == 2
    assert [p.status() for p in frame.pieces] == ["graphed"] * 3
    used = {b for p in frame.pieces for b in p.buckets_used}
    assert {8, 16, 24, 40, 64} <= used  # padded to the bucket: 5 and 7 ran at 8, 17 at 24, ...
    s = backend_stats()["piecewise"]
    assert s["calls"]["piecewise"] >= 9 and s["piece_eager_runs"] == 0, s
    assert s["staging_bytes"] > 0 and s["pieces"] == 3 and s["splitting_ops"] == 2


def test_the_splitting_op_sees_exactly_the_real_shapes():
    m = TinyLM(attn="custom").eval()
    c = torch.compile(m, backend="gfxgraph", options={**PIECEWISE, "splitting_ops": ["gfxtest::attn"]})
    with torch.no_grad():
        for n in (5, 7, 11, 30):
            ids, pos = inputs(n)
            want = m(ids, pos)
            SEEN.clear()
            torch.testing.assert_close(c(ids, pos), want)
            assert SEEN == [(1, 4, n, 8)] * 2, SEEN  # narrowed from the bucket back to n rows, per layer
    (frame,) = frames()
    assert len(frame.splitters) == 2 and max(p.buckets_used[-1] for p in frame.pieces) == 32


def test_inductor_pieces_equal_eager():
    m = TinyLM().eval()
    run_lengths(m, [5, 7, 13, 2, 31], options={"compiler": "inductor"})
    (frame,) = frames()
    assert frame.compiler in ("inductor", "eager")  # eager: no C++ compiler on this machine
    assert all(p.status() == "graphed" for p in frame.pieces)


def test_identical_layers_are_compiled_once():
    m = TinyLM(layers=4).eval()
    before = backend_stats()["compiles"]
    run_lengths(m, [5, 7])
    (frame,) = frames()
    assert len(frame.pieces) == 5
    # the first piece (embedding), the three identical middle ones, the last (head): three compilations
    assert backend_stats()["compiles"] - before == 3


def test_batch_and_tokens_both_dynamic_pads_the_tokens():
    m = TinyLM().eval()
    c = torch.compile(m, backend="gfxgraph", options=PIECEWISE)
    with torch.no_grad():
        for b, n in [(2, 5), (3, 7), (2, 9), (4, 6), (3, 12)]:
            ids, pos = inputs(n, batch=b)
            torch.testing.assert_close(c(ids, pos), m(ids, pos), msg=f"batch {b}, {n} tokens")
    (frame,) = [f for f in frames() if len(frame_symbols(f)) > 1]
    assert str(frame.token.symbol) == str(frame_symbols(frame)[-1])  # the innermost: the sequence
    assert len(frame._variants) >= 3  # one graph set per batch size: it is not padded
    assert all(p.status() == "graphed" for p in frame.pieces)  # the expanded positions are staged once per row
    assert backend_stats()["piecewise"]["piece_eager_runs"] == 0


def frame_symbols(frame: PiecewiseSubgraph) -> list:
    return sorted(frame._carriers, key=lambda s: frame._carriers[s][1] or 0)


class Flat(nn.Module):
    """vLLM-style attention over (tokens, hidden); ``pre`` runs on the input first."""

    def __init__(self, pre=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)
        self.pre = pre

    def forward(self, x):
        if self.pre is not None:
            x = self.pre(x)
        q, k, v = self.qkv(x).view(1, x.shape[0], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).reshape(x.shape[0], 16))


def test_token_dim_option_and_dim_zero_tokens():
    m = Flat().eval()
    c = torch.compile(m, backend="gfxgraph", options={**PIECEWISE, "token_dim": 0})
    with torch.no_grad():
        for n in (5, 7, 19):
            x = torch.randn(n, 16)
            torch.testing.assert_close(c(x), m(x))
    (frame,) = frames()
    assert frame.token.carrier[1] == 0 and all(p.status() == "graphed" for p in frame.pieces)


# ------------------------------------------------------------------ paths per call
def test_decode_frames_take_the_full_graph():
    m = TinyLM(layers=SHALLOW).eval()
    c = run_lengths(m, [5, 7, 1, 1, 9, 1])
    with torch.no_grad():
        for b in (2, 3, 5, 3):  # decode steps of several rows: (batch, 1), the batch dynamic
            ids, pos = inputs(1, batch=b)
            pos = pos.contiguous()  # the whole-graph path graphs contiguous batched inputs only
            torch.testing.assert_close(c(ids, pos), m(ids, pos))
    full = [s for s in cb.compiled_subgraphs() if s not in BEFORE and getattr(s, "role", "") == "full"]
    assert any(s.plan.static and s.buckets == [1] for s in full), full  # the frame dynamo made for 1 token
    assert any(s.plan.batch_symbol is not None and s.state is SubgraphState.GRAPHED for s in full), full
    assert len(frames()) == 1  # only the prefill frame is piecewise
    assert backend_stats()["piecewise"]["calls"]["full"] >= 7


def test_one_token_call_in_a_piecewise_frame_takes_the_full_graph():
    import torch.fx.experimental._config as fx_config

    m = TinyLM(layers=SHALLOW).eval()
    with fx_config.patch(backed_size_oblivious=True):  # size 1 then stays in the symbolic frame
        run_lengths(m, [5, 7, 1, 9, 1])
    (frame,) = frames()
    assert frame.calls["full"] == 2 and frame._full is not None and frame._full.role == "full"
    assert frame.calls["piecewise"] >= 2


def test_oversize_runs_the_pieces_unpadded():
    m = TinyLM(layers=SHALLOW).eval()
    run_lengths(m, [5, 7, 12, 9], options={"token_buckets": [4, 8]})
    (frame,) = frames()
    assert frame.buckets == [4, 8] and frame.calls["eager"] == 2
    assert gfxgraph.stats()["fallback_reasons"].get("oversize", 0) == 2


def test_without_simulate_padding_a_cpu_frame_runs_unpadded():
    m = TinyLM(layers=SHALLOW).eval()
    run_lengths(m, [5, 7, 9], options={"simulate_padding": False})
    (frame,) = frames()
    assert frame.calls["eager"] == 2 and not any(p.entries for p in frame.pieces)
    assert gfxgraph.stats()["fallback_reasons"].get("no_gpu", 0) >= 2


def test_training_is_not_split():
    m = TinyLM(layers=SHALLOW)
    c = torch.compile(m, backend="gfxgraph", options=PIECEWISE)
    for n in (5, 7):
        ids, pos = inputs(n)
        c(ids, pos).square().mean().backward()
    assert not frames()
    # served whole, on the autograd path (CUDA-graph trees, as reduce-overhead), or unsplit with cpu inputs on a GPU
    assert any(s.state is cb.SubgraphState.TREES or s.reason == "cpu_inputs"
               for s in cb.compiled_subgraphs() if s not in BEFORE)


def test_graphs_off():
    run_lengths(TinyLM(layers=SHALLOW).eval(), [5, 7, 9], options={"graphs": False})
    (frame,) = frames()
    assert frame.reason == "graphs_off" and frame.calls["eager"] == 2


# ------------------------------------------------------------------ padding guards
def test_a_reduction_over_the_sequence_runs_that_piece_unpadded():
    m = TinyLM(extra="seq_mean").eval()
    run_lengths(m, [5, 7, 9, 13])
    (frame,) = frames()
    status = [p.status() for p in frame.pieces]
    assert status[:2] == ["graphed", "graphed"] and status[2] == "unpadded: rows_coupled", status
    assert "aten.mean" in frame.pieces[2].block.detail
    assert gfxgraph.stats()["fallback_reasons"].get("rows_coupled", 0) >= 2


def test_an_op_the_row_analysis_does_not_know_runs_that_piece_unpadded():
    m = TinyLM(extra="rowmix").eval()
    run_lengths(m, [5, 7, 9, 13, 6])
    (frame,) = frames()
    assert frame.pieces[2].status() == "unpadded: unproven" and "gfxtest.rowmix" in frame.pieces[2].block.detail
    assert [p.status() for p in frame.pieces[:2]] == ["graphed", "graphed"]


def test_rows_mixed_where_the_trace_is_misled_are_caught_by_the_padding_check():
    m = TinyLM(extra="rowmix_pointwise").eval()
    run_lengths(m, [5, 7, 9, 13, 6])
    (frame,) = frames()
    assert frame.pieces[2].status() == "unpadded: padding_changes_results"
    assert "NaN" in frame.pieces[2].block.detail  # the poisoned padding reached the real rows
    assert [p.status() for p in frame.pieces[:2]] == ["graphed", "graphed"]
    assert gfxgraph.stats()["fallback_reasons"].get("padding_changes_results", 0) >= 1


def _gm(fn, *shapes):
    """``fn`` traced by dynamo with every size dynamic; returns (graph module, the first input's dim-1 symbol)."""
    got = {}

    def backend(gm, ex):
        got["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    args = [torch.randn(*s) for s in shapes]
    for a in args:
        torch._dynamo.mark_dynamic(a, 1)
    torch.compile(fn, backend=backend)(*args)
    gm = got["gm"]
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta["example_value"], torch.Tensor))
    return gm, ph.meta["example_value"].shape[1].node.expr


@pytest.mark.parametrize("fn,hazard", [
    (lambda x: x.sum(dim=1), True),  # over the sequence
    (lambda x: x.sum(-1), False),  # over the hidden dim
    (lambda x: x.mean(), True),  # over everything
    (lambda x: torch.softmax(x, dim=1), True),
    (lambda x: torch.softmax(x, dim=-1), False),
    (lambda x: x.cumsum(1), False),  # a scan: padding rows come after the real ones, which never read them
    (lambda x: x[:, -1], True),
    (lambda x: x[:, 1:], True),
    (lambda x: x[..., :4] * 2, False),
    (lambda x: torch.cat([x, x], dim=1), True),
    (lambda x: torch.cat([x, x], dim=-1), False),
    (lambda x: x.transpose(1, 2) @ x, True),  # contracts over the sequence
    (lambda x: x @ x.transpose(1, 2), True),  # (S, S): the token dim twice, which the analysis does not follow
    (lambda x: F.layer_norm(x, (8,)), False),
    (lambda x: x.flip(1), True),
    (lambda x: x.view(x.shape[0], x.shape[1] // 2, 16), True),  # pairs of rows
    (lambda x: x.reshape(x.shape[0], -1), False),  # whole rows merged
])
def test_the_row_analysis_finds_ops_along_the_token_dim(fn, hazard):
    gm, s = _gm(fn, (2, 6, 8))
    fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    first = next(i for i, f in enumerate(fakes) if isinstance(f, torch.Tensor))
    verdict = trace_graph(gm, fakes, batched={first: 1}, symbols={s})
    assert (verdict.reason is not None) == hazard, verdict


# ------------------------------------------------------------------ state, validation
def test_a_piece_that_writes_a_static_cache_is_never_padded():
    m, ref = CachedAttention().eval(), CachedAttention().eval()
    c = torch.compile(m, backend="gfxgraph", options={**PIECEWISE, "token_buckets": [4, 8, 16, 64]})
    with torch.no_grad():
        for n in (5, 8, 7, 16, 3, 4):
            x = torch.randn(1, n, 16)
            pos = torch.arange(n)
            torch.testing.assert_close(c(x, pos), ref(x, pos), msg=f"{n} tokens")
            torch.testing.assert_close(m.k_cache, ref.k_cache)
            torch.testing.assert_close(m.v_cache, ref.v_cache)
    (frame,) = frames()
    writer = frame.pieces[0]
    assert writer.stateful and writer.status() == "unpadded: stateful"
    assert {k[0] for k in writer.entries} <= {4, 8, 16}  # graphed only where the count is a bucket
    assert gfxgraph.stats()["fallback_reasons"].get("stateful", 0) >= 2


def test_validate_mode_checks_every_piece_call():
    gfxgraph.enable(validate=True)
    try:
        run_lengths(TinyLM().eval(), [5, 7, 9, 12])
    finally:
        gfxgraph.disable()
    snap = gfxgraph.stats()
    assert snap["validation_checks"] >= 9 and snap["validation_failures"] == 0, snap


def test_outputs_are_copies():
    m = TinyLM(layers=SHALLOW).eval()
    c = torch.compile(m, backend="gfxgraph", options=PIECEWISE, dynamic=True)
    with torch.no_grad():
        a = c(*inputs(5))
        keep = a.clone()
        c(*inputs(7))
        torch.testing.assert_close(a, keep)


def test_reset_releases_and_recaptures():
    m = TinyLM(layers=SHALLOW).eval()
    c = run_lengths(m, [5, 7, 9])
    cb.reset_backend()
    (frame,) = frames()
    assert not any(p.entries for p in frame.pieces)
    with torch.no_grad():
        ids, pos = inputs(10)
        torch.testing.assert_close(c(ids, pos), m(ids, pos))


# ------------------------------------------------------------------ options
def test_splitting_op_names_in_every_form():
    got = parse_splitting_ops(["aten::_scaled_dot_product_flash_attention", "torch.ops.gfxtest.attn",
                               "gfxtest::attn.default", torch.ops.gfxtest.rowmix, torch.ops.aten.add.Tensor,
                               "torch.nn.functional.scaled_dot_product_attention", " aten::mul "])
    assert got == ("aten::_scaled_dot_product_flash_attention", "gfxtest::attn", "gfxtest::attn.default",
                   "gfxtest::rowmix", "aten::add.Tensor", "torch.nn.functional.scaled_dot_product_attention",
                   "aten::mul")
    assert "torch.nn.functional.scaled_dot_product_attention" in DEFAULT_SPLITTING_OPS
    assert any("flash" in n for n in DEFAULT_SPLITTING_OPS) and any("efficient" in n for n in DEFAULT_SPLITTING_OPS)
    ops = SplittingOps(["gfxtest::attn"])
    assert ops.names[:len(DEFAULT_SPLITTING_OPS)] == DEFAULT_SPLITTING_OPS  # the user's ops come on top


@pytest.mark.parametrize("options,msg", [
    ({"piecewise": "yes"}, r"options\['piecewise'\]: expected a bool"),
    ({"piecewise": True, "splitting_ops": "aten::foo"}, r"options\['splitting_ops'\]: expected a list of op names"),
    ({"piecewise": True, "splitting_ops": ["aten::no_such_op"]}, "names no registered torch op"),
    ({"piecewise": True, "splitting_ops": ["attention"]}, "is not an op name; expected torch op names such as"),
    ({"piecewise": True, "splitting_ops": [3]}, "cannot be named"),
    ({"splitting_ops": ["aten::mm"]}, r"expected together with options\['piecewise'\] = True"),
    ({"piecewise": True, "token_dim": -1}, r"options\['token_dim'\]: expected an int >= 0"),
    ({"piecewise": True, "token_buckets": [0, 8]}, r"options\['token_buckets'\]: buckets: expected positive ints"),
    ({"piecewise": True, "max_tokens": 0}, r"options\['max_tokens'\]: expected an int >= 1"),
    ({"piecewise": True, "token_buckets": [8], "max_tokens": 8}, "expected one of them"),
])
def test_bad_piecewise_options_name_what_was_expected(options, msg):
    with pytest.raises(ValueError, match=msg) as info:
        BackendOptions.from_mapping(options)
    assert isinstance(info.value, ConfigError)


def test_piecewise_options_are_known_and_stored():
    o = BackendOptions.from_mapping({"piecewise": True, "splitting_ops": ["torch.ops.gfxtest.attn"],
                                     "token_buckets": [64, 8, 8], "token_dim": 1})
    assert o.piecewise and o.splitting_ops == ("gfxtest::attn",) and o.token_buckets == (8, 64)
    assert o.token_dim == 1 and {"piecewise", "splitting_ops", "token_buckets", "max_tokens"} <= set(o.known())
    assert math.isclose(BackendOptions.from_mapping({}).max_tokens, 512)


# ------------------------------------------------------------------ the GPU path, graphs simulated
class _FakeGraph:
    """A "graph" that replays by running the captured call again into the captured outputs: the
    inputs it reads are the ones captured (static buffers, other pieces' outputs), as a replay's."""

    def __init__(self, run, outputs) -> None:
        self.run, self.outputs = run, outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.run()):
            if isinstance(out, torch.Tensor):
                out.copy_(new)

    def reset(self) -> None:
        self.run = None


class _FakeCapturer:
    seconds, pool_handle = 0.0, "pool"

    def pool_bytes(self) -> int:
        return 0

    def forget_growth(self) -> None:
        pass

    def capture(self, run, what, *, warm=None, keep_warm=False, freeze_gc=True, cap_checked=False):
        c = Captured(stage="warm_up")
        try:
            warm = run()
        except Exception as exc:
            c.error, c.fallback = exc, Fallback(Reason.WARMUP_FAILED, f"{what}: {exc}")
            return c
        c.warm = warm if keep_warm else None
        # a capture runs no kernels: the outputs hold garbage until the first replay
        c.outputs = tuple(o.clone().fill_(float("nan")) if isinstance(o, torch.Tensor) and o.is_floating_point()
                          else o for o in run())
        c.graph = _FakeGraph(run, c.outputs)
        return c


@pytest.fixture
def fake_graphs(monkeypatch):
    """Piecewise frames take their GPU path (capture, replay, graph outputs read in place) on the CPU."""
    from hipgraph_bridge.compile import piecewise, pieces

    init = piecewise.PiecewiseSubgraph.__init__

    def patched(self, *a, **k):
        init(self, *a, **k)
        self._graphs = True
        self.env.capturer = _FakeCapturer()
        self._order.after_previous = lambda: None

    monkeypatch.setattr(piecewise.PiecewiseSubgraph, "__init__", patched)
    monkeypatch.setattr(pieces, "record_on_current_stream", lambda leaves: None)


@pytest.mark.parametrize("extra,status", [("", "graphed"), ("seq_mean", "unpadded: rows_coupled"),
                                          ("rowmix", "unpadded: unproven"),
                                          ("rowmix_pointwise", "unpadded: padding_changes_results")])
def test_the_gpu_path_with_simulated_graphs_equals_eager(fake_graphs, extra, status):
    m = TinyLM(extra=extra).eval()
    run_lengths(m, [5, 7, 9, 3, 16, 17, 33, 12, 2, 64, 40, 7, 9, 17, 33, 16], options={"simulate_padding": False})
    (frame,) = frames()
    assert [p.status() for p in frame.pieces] == ["graphed", "graphed", status]
    assert frame.buckets[-1] in frame.captured_buckets and frame.largest_first_seconds > 0
    report = frame.report()
    assert report["piece_captures"] > 0 and report["piece_replays"] >= 2 * 5, report  # 7, 9, 17, 33, 16 again
    assert gfxgraph.stats()["fallback_reasons"].get("recapture", 0) == 0  # each key's pieces captured together


def test_the_gpu_path_with_a_static_cache_and_decode(fake_graphs):
    m, ref = CachedAttention().eval(), CachedAttention().eval()
    c = torch.compile(m, backend="gfxgraph", options={**PIECEWISE, "simulate_padding": False,
                                                      "token_buckets": [8, 16, 32]})
    with torch.no_grad():
        for prompt in (13, 16, 5, 32, 16, 8):
            for t in (m.k_cache, m.v_cache, ref.k_cache, ref.v_cache):
                t.zero_()
            for step, n in enumerate([prompt, 1, 1]):
                start = 0 if step == 0 else prompt + step - 1
                x, pos = torch.randn(1, n, 16), torch.arange(start, start + n)
                torch.testing.assert_close(c(x, pos), ref(x, pos), msg=f"prompt {prompt}, step {step}")
                torch.testing.assert_close(m.k_cache, ref.k_cache)
    (frame,) = frames()
    writer = frame.pieces[0]
    assert writer.status() == "unpadded: stateful" and writer.captured_buckets == [8, 16, 32]
    assert frame.report()["piece_eager_runs"] == 1  # the 5-token prompt: padding would write the cache


def test_the_gpu_path_with_inductor_pieces(fake_graphs):
    """Inductor checks its inputs' strides: staged, narrowed and splitting-op outputs all pass."""
    m = TinyLM(attn="custom").eval()
    gfxgraph.enable(validate=True)
    try:
        run_lengths(m, [5, 7, 9, 3, 16, 17, 9, 600], options={"compiler": "inductor", "simulate_padding": False,
                                                              "splitting_ops": ["gfxtest::attn"]})
    finally:
        gfxgraph.disable()
    (frame,) = frames()
    assert frame.compiler in ("inductor", "eager") and frame.calls == {"piecewise": 6, "full": 0, "eager": 1}
    assert all(p.status() == "graphed" for p in frame.pieces)
    assert gfxgraph.stats()["validation_failures"] == 0 and gfxgraph.stats()["validation_checks"] >= 18


MIXED = [(2, 9), (3, 40), (2, 100), (4, 17), (3, 64), (2, 9), (4, 200)]


def test_a_mixed_stream_captures_once_per_batch_and_bucket_and_replays_when_both_repeat(fake_graphs):
    """The key of a piece graph is (token bucket, batch size); the stream's first call is a frame of its own.

    Dynamo compiles the first call (2, 9) with static sizes (no token count: served whole), and
    the second (3, 40) as a frame with batch and length dynamic; the second (2, 9) lands in that
    frame, where (bucket 16, batch 2) is new: it captures. No (bucket, batch) repeats in the stream,
    so its first pass replays nothing; the same stream again replays every piece on every call.
    """
    m = TinyLM().eval()
    c = torch.compile(m, backend="gfxgraph", options={**PIECEWISE, "simulate_padding": False})

    def stream() -> None:
        with torch.no_grad():
            for b, n in MIXED:
                ids, pos = inputs(n, batch=b)
                torch.testing.assert_close(c(ids, pos), m(ids, pos), msg=f"batch {b}, {n} tokens")

    stream()
    (frame,) = frames()
    first = frame.report()
    (whole,) = [s for s in cb.compiled_subgraphs() if s not in BEFORE and getattr(s, "role", "") == "full"]
    assert whole.calls == 1 and first["calls"] == {"piecewise": 6, "full": 0, "eager": 0}, first  # (2, 9): static
    keys = [(16, 2), (24, 4), (40, 3), (64, 3), (112, 2), (224, 4), (512, 3)]  # 512: the largest, first
    assert all(sorted(p.entries) == keys for p in frame.pieces), [sorted(p.entries) for p in frame.pieces]
    assert first["piece_replays"] == 0 and first["piece_captures"] == 3 * len(keys), first
    stream()  # every call now meets its key: (2, 9) too, dynamo keeps the frame it used last in front
    again = frame.report()
    assert again["calls"] == {"piecewise": 6 + 7, "full": 0, "eager": 0} and whole.calls == 1, again
    assert again["piece_captures"] == first["piece_captures"] and again["piece_replays"] == 3 * len(MIXED), again
    assert again["piece_eager_runs"] == 0


@pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"), reason="needs nested_compile_region")
def test_a_region_that_reads_the_token_count_from_its_tensor_is_not_padded():
    """x.numel() inside a region (its subgraph) is the token count used as a value: the piece is not padded,
    and every length equals eager."""
    @torch.compiler.nested_compile_region
    def scaled(x):
        return x * x.numel()

    m = Flat(pre=lambda x: scaled(scaled(x))).eval()
    c = torch.compile(m, backend="gfxgraph", options={**PIECEWISE, "token_dim": 0})
    with torch.no_grad():
        for n in (5, 7, 19):
            x = torch.randn(n, 16) / 100
            torch.testing.assert_close(c(x), m(x))
