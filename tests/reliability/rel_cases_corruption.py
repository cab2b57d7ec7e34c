"""Silent corruption: cases where a replay would return wrong data without an error.

Each must be caught (validation mode returns the eager result and counts the
mismatch), refused (an exception), or made impossible by the API (inputs are
copied in). A case where the library does none of these reports
``silent_wrong``. Behaviour that is documented for the raw low-level API (a
graph reads the addresses it captured) is recorded in ``observed`` as a
control, not counted against the library.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

import gfxgraph
from gfxgraph import BridgedCUDAGraph, ShapeBucketPool
from rel_registry import Ctx, SilentWrong, Skip, case
from rel_tools import attempt, describe_exc, liveness_supported


def corruption(name: str, kind: str, *, api: str, known_issue: str = "",
               timeout: float = 75.0) -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    def deco(body: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        def run(ctx: Ctx) -> None:
            if not ctx.gpu:
                raise Skip("needs a GPU")
            body(ctx)

        run.__doc__ = body.__doc__
        case(name, "corruption", api=api, kind=kind, timeout=timeout, known_issue=known_issue)(run)
        return body

    return deco


def _side_stream() -> torch.cuda.Stream:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    return s


def _hl_graph(model: Callable[[torch.Tensor], Any], example: torch.Tensor) -> BridgedCUDAGraph:
    g = BridgedCUDAGraph()
    with g.capture(model_fn=model, example_input=example) as cap:
        pass
    assert cap.mode == "graph", cap.fallback_reason
    return g


@corruption("corr_rebind_input_instead_of_copy", "caller rebinds the input tensor instead of copying into it",
            api="low-level (control), high-level, ShapeBucketPool")
def _rebind(ctx: Ctx) -> None:
    """The low-level graph keeps reading the captured tensor (documented); the copying APIs are immune."""
    gfxgraph.enable()

    def model(t: torch.Tensor) -> torch.Tensor:
        return t * 2 + 1

    x = torch.ones(8, 64, device="cuda")
    g = BridgedCUDAGraph()
    with torch.cuda.graph(g, stream=_side_stream()):
        y = model(x)
    x = torch.full((8, 64), 5.0, device="cuda")  # rebinding: the graph still reads the old tensor
    g.replay()
    torch.cuda.synchronize()
    ctx.observed["low_level_replay_used_the_old_tensor"] = bool(torch.equal(y, torch.full_like(y, 3.0)))

    example = torch.ones(8, 64, device="cuda")
    hg = _hl_graph(model, example)
    example.fill_(100.0)  # mutating the example after capture must not matter either
    for v in (5.0, -2.0):
        xi = torch.full((8, 64), v, device="cuda")
        if not torch.equal(hg.replay(input_tensor=xi), model(xi)):
            raise SilentWrong(f"high-level replay(input_tensor=x) did not use the new tensor (value {v})")
    pool = ShapeBucketPool(model, [4, 8], progress=False)
    for n, v in ((3, 1.0), (3, 7.0), (8, -4.0), (5, 2.5)):
        xi = torch.full((n, 64), v, device="cuda")
        if not torch.equal(pool(xi), model(xi)):
            raise SilentWrong(f"ShapeBucketPool returned data of an earlier input (batch {n}, value {v})")


@corruption("corr_stale_graph_caught_by_validation", "a captured graph went stale (the model now reads another "
            "tensor); validation mode must catch it", api="high-level")
def _stale(ctx: Ctx) -> None:
    holder = {"w": torch.full((64,), 2.0, device="cuda")}

    def model(t: torch.Tensor) -> torch.Tensor:
        return t * holder["w"]

    x = torch.randn(8, 64, device="cuda")
    gfxgraph.enable()
    g = _hl_graph(model, x)
    keep = holder["w"]
    holder["w"] = torch.full((64,), 3.0, device="cuda")
    ctx.observed["without_validation_stale"] = bool(torch.equal(g.replay(input_tensor=x), x * 2))
    holder["w"] = keep

    gfxgraph.enable(validate=True)
    gfxgraph.reset_stats()
    g2 = _hl_graph(model, x)
    assert torch.equal(g2.replay(input_tensor=x), x * 2)
    holder["w"] = torch.full((64,), 3.0, device="cuda")
    out = g2.replay(input_tensor=x)
    snap = gfxgraph.stats()
    ctx.observed["validation"] = {"checks": snap["validation_checks"], "failures": snap["validation_failures"]}
    if not torch.equal(out, x * 3):
        raise SilentWrong("validation mode returned the stale graph result")
    assert snap["validation_failures"] >= 1, snap


@corruption("corr_freed_buffer_low_level", "a tensor the graph reads is freed and its memory reused; "
            "replay in validation mode", api="low-level / torch.cuda.graph")
def _freed_low_level(ctx: Ctx) -> None:
    gfxgraph.enable(validate=True)
    s = _side_stream()
    x = torch.ones(4096, device="cuda")
    supported = liveness_supported()
    ctx.observed["torch_has_check_input_liveness"] = supported
    if supported:  # the user's own opt-in must pass through the drop-in unchanged
        w0 = torch.full((4096,), 2.0, device="cuda")
        g0 = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            g0.capture_begin(check_input_liveness=True)
            y0 = x * w0
            g0.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        del w0
        gc.collect()
        exc0, _ = attempt(g0.replay)
        ctx.observed["opt_in_check_input_liveness_refused"] = describe_exc(exc0)
        del g0, y0

    w = torch.full((4096,), 2.0, device="cuda")
    ptr = w.data_ptr()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = x * w
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 2.0))
    del w  # the captured buffer is freed...
    junk = torch.full((4096,), 1e6, device="cuda")  # ...and its memory handed to another tensor
    ctx.observed["memory_reused"] = junk.data_ptr() == ptr
    exc, _ = attempt(g.replay)
    ctx.observed["replay"] = describe_exc(exc) or "ran"
    if exc is not None:
        return  # refused: the use-after-free was caught
    torch.cuda.synchronize()
    ctx.observed["replay_read_junk"] = bool(torch.equal(y, torch.full_like(y, 1e6)))
    raise SilentWrong("replay after the captured input was freed ran without an error "
                      f"(read the reused memory: {ctx.observed['replay_read_junk']}); validation mode neither "
                      "caught nor refused it")


@corruption("corr_freed_buffer_high_level", "a tensor the model reads is freed and its memory reused; "
            "validation mode must catch it", api="high-level")
def _freed_high_level(ctx: Ctx) -> None:
    gfxgraph.enable(validate=True)
    holder = {"w": torch.full((64,), 2.0, device="cuda")}

    def model(t: torch.Tensor) -> torch.Tensor:
        return t * holder["w"]

    x = torch.randn(8, 64, device="cuda")
    g = _hl_graph(model, x)
    assert torch.equal(g.replay(input_tensor=x), x * 2)
    ptr = holder["w"].data_ptr()
    holder["w"] = torch.full((64,), 3.0, device="cuda")  # the captured tensor is freed...
    junk = torch.full((64,), 1e6, device="cuda")  # ...and its memory reused
    ctx.observed["memory_reused"] = junk.data_ptr() == ptr
    out = g.replay(input_tensor=x)
    if not torch.equal(out, x * 3):
        raise SilentWrong("validation mode returned the graph's result computed from freed memory")
    assert gfxgraph.stats()["validation_failures"] >= 1


@corruption("corr_pool_freed_buffer_validation", "ShapeBucketPool: a tensor the model reads is freed and reused; "
            "validation mode must catch it", api="ShapeBucketPool")
def _pool_freed(ctx: Ctx) -> None:
    gfxgraph.enable(validate=True)
    holder = {"w": torch.full((64,), 2.0, device="cuda")}

    def model(t: torch.Tensor) -> torch.Tensor:
        return t * holder["w"]

    pool = ShapeBucketPool(model, [4, 8], progress=False)
    x = torch.randn(6, 64, device="cuda")
    assert torch.equal(pool(x), x * 2)
    ptr = holder["w"].data_ptr()
    holder["w"] = torch.full((64,), 3.0, device="cuda")
    junk = torch.full((64,), 1e6, device="cuda")
    ctx.observed["memory_reused"] = junk.data_ptr() == ptr
    out = pool(x)
    ctx.observed["validation_checks"] = gfxgraph.stats()["validation_checks"]
    if not torch.equal(out, x * 3):
        raise SilentWrong("ShapeBucketPool in validation mode returned a replay computed from freed memory "
                          f"(read the reused memory: {bool(torch.equal(out, x * 1e6))})")


@corruption("corr_pool_cross_batch_reduction", "ShapeBucketPool: a non-batched output reduced over the batch "
            "sees the padding rows; the pool must catch it, with and without validation mode", api="ShapeBucketPool")
def _pool_mean(ctx: Ctx) -> None:
    def model(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t * 2, t.mean(0)

    x = torch.randn(5, 16, device="cuda") + 3.0
    gfxgraph.enable()
    plain = ShapeBucketPool(model, [8], progress=False)
    _, m0 = plain(x)
    if not torch.allclose(m0, x.mean(0)):
        raise SilentWrong("the batch-mean output includes the padding rows (differs from eager)")
    ctx.observed["caught_without_validation"] = list(plain.row_coupled.values())
    gfxgraph.enable(validate=True)
    pool = ShapeBucketPool(model, [8], progress=False)
    y, m = pool(x)
    assert torch.equal(y, x * 2)
    if not torch.allclose(m, x.mean(0)):
        raise SilentWrong("the batch-mean output includes the padding rows (differs from eager) and "
                          "validation mode did not catch it")


@corruption("corr_held_outputs_survive_next_replay", "outputs the caller holds are not overwritten by later "
            "replays (copy_outputs default)", api="high-level, ShapeBucketPool")
def _held(ctx: Ctx) -> None:
    gfxgraph.enable()

    def model(t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(t) * 3

    xs = [torch.randn(8, 32, device="cuda") for _ in range(4)]
    g = _hl_graph(model, xs[0])
    outs = [g.replay(input_tensor=x) for x in xs]
    for x, o in zip(xs, outs):
        if not torch.equal(o, model(x)):
            raise SilentWrong("a held high-level output was overwritten by a later replay")
    pool = ShapeBucketPool(model, [2, 4, 8], progress=False)
    inputs = [torch.randn(n, 32, device="cuda") for n in (3, 8, 1, 4, 6, 2)]
    held = [pool(x) for x in inputs]
    for x, o in zip(inputs, held):
        if not torch.equal(o, model(x)):
            raise SilentWrong("a held ShapeBucketPool output was overwritten by a later call")
    fast = ShapeBucketPool(model, [8], copy_outputs=False, progress=False)
    a = fast(inputs[0])
    b = fast(inputs[4])
    ctx.observed["copy_outputs_false_overwrites_as_documented"] = a.data_ptr() == b.data_ptr()


@corruption("corr_failed_capture_never_replays_partial_work", "a capture whose region raised after some work "
            "must never replay that half", api="low-level, torch.cuda.graph")
def _partial(ctx: Ctx) -> None:
    gfxgraph.enable()
    s = _side_stream()
    acc = torch.zeros(16, device="cuda")
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=s):
            acc.add_(1)
            raise ValueError("region failed after some work")
    except ValueError:
        pass
    exc, _ = attempt(g.replay)
    torch.cuda.synchronize()
    ctx.observed["replay"] = describe_exc(exc)
    if exc is None:
        raise SilentWrong(f"the partial graph replayed (acc = {acc[0].item()})")
    assert torch.equal(acc, torch.zeros_like(acc))
