"""Fault injection during capture, through the four ways users capture.

APIs: ``low-level`` (``capture_begin``/``capture_end`` on ``BridgedCUDAGraph``),
``torch.cuda.graph`` (with ``gfxgraph.enable()``, the drop-in path), ``high-level``
(``BridgedCUDAGraph().capture(model_fn=...)``, eager fallback) and
``ShapeBucketPool``. Each case runs in its own interpreter. Every case checks,
through :class:`rel_tools.Fault`: the process survives (the harness sees the exit
code), the expected error or the eager result comes out, the failure is counted
in ``gfxgraph.stats()``, no stream is left capturing and the next capture on the
same stream works with random numbers.

Where the CUDA runtime's answer is not something to predict with confidence
(host waits on captured events, ``empty_cache`` under capture, an unregistered
generator...), the case asserts the safety properties only (no abort, the next
capture works, the result is correct or an exception came out) and records the
observed outcome in ``observed``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

import gfxgraph
from gfxgraph import BridgedCUDAGraph, GraphCaptureError, GraphState, ShapeBucketPool
from rel_registry import Ctx, Skip, case
from rel_tools import Fault, attempt, capturing, describe_exc, low_level, sigint, unsafe_calls_from_other_thread

Body = Callable[[Fault], None]


def fault(name: str, api: str, kind: str, *, validate: bool = False, timeout: float = 75.0,
          known_issue: str = "") -> Callable[[Body], Body]:
    def deco(body: Body) -> Body:
        def run(ctx: Ctx) -> None:
            if not ctx.gpu:
                raise Skip("needs a GPU")
            f = Fault(ctx, validate=validate)
            body(f)
            f.finish()

        run.__doc__ = body.__doc__
        case(name, "fault", api=api, kind=kind, timeout=timeout, known_issue=known_issue)(run)
        return body

    return deco


def _big() -> int:
    """Bytes no allocation can get: twice the device's memory."""
    return int(torch.cuda.mem_get_info()[1] * 2)


# ====================================================================== low-level API
LL = "low-level"


@fault("ll_exception_in_region", LL, "exception in the region")
def _ll_exception(f: Fault) -> None:
    g = BridgedCUDAGraph()

    def region() -> None:
        with low_level(g, f.s):
            f.x.add_(1)
            raise ValueError("boom in region")

    e = f.expect(ValueError, region)
    assert "boom in region" in str(e)
    assert g.state is GraphState.FAILED, g.state
    f.expect(RuntimeError, g.replay)  # a discarded partial graph never replays


@fault("ll_item_in_region", LL, ".item() in the region")
def _ll_item(f: Fault) -> None:
    g = BridgedCUDAGraph()

    def region() -> None:
        with low_level(g, f.s):
            f.x.sum().item()

    f.expect(RuntimeError, region)
    assert g.state is GraphState.FAILED, g.state


@fault("ll_synchronize_in_region", LL, "torch.cuda.synchronize() in the region")
def _ll_sync(f: Fault) -> None:
    g = BridgedCUDAGraph()

    def region() -> None:
        with low_level(g, f.s):
            f.x.mul_(2)
            torch.cuda.synchronize()

    f.expect(RuntimeError, region)


@fault("ll_nested_capture_begin_same_stream", LL, "nested capture_begin on the capturing stream")
def _ll_nested(f: Fault) -> None:
    outer, inner = BridgedCUDAGraph(), BridgedCUDAGraph()
    with torch.cuda.stream(f.s):
        outer.capture_begin()
        y = f.x * 5
        e = f.expect(GraphCaptureError, inner.capture_begin)
        assert "already capturing" in str(e), e
        y = y + 1
        outer.capture_end()  # the outer capture survived the refused inner one
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(f.x, 6.0)), "the outer capture was damaged by the refused nested one"
    assert inner.state is GraphState.EMPTY
    f.counted = False  # refused before it reached the runtime: nothing failed
    f.record("note", "refused before the runtime call; gfxgraph does not count refusals as capture failures")


@fault("ll_capture_on_default_stream", LL, "capture on the default stream")
def _ll_default_stream(f: Fault) -> None:
    g = BridgedCUDAGraph()
    with torch.cuda.stream(torch.cuda.default_stream()):
        e = f.expect(RuntimeError, g.capture_begin)
    assert "non-default stream" in str(e), e
    assert g.state is GraphState.EMPTY
    with low_level(g, f.s):  # the same object captures fine on a side stream
        y = f.x + 1
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, f.x + 1)
    f.counted = False
    f.record("note", "refused before the runtime call; not a capture failure")


def _second_thread(f: Fault, mode: str) -> None:
    """Another thread makes unsafe calls (device sync, cudaMalloc) while this one captures."""
    g = BridgedCUDAGraph()
    other: dict[str, Any] = {}
    region_error = end_error = None
    with torch.cuda.stream(f.s):
        g.capture_begin(capture_error_mode=mode)
        try:
            y = f.x * 2
            # thread_local/relaxed permit another thread's cudaMalloc; no mode permits a device sync
            other = unsafe_calls_from_other_thread(device_sync=mode == "global")
            y = y + 1  # raises if the other thread's calls invalidated this capture
        except Exception as exc:  # noqa: BLE001
            region_error = exc
        finally:
            try:
                g.capture_end()
            except Exception as exc:  # noqa: BLE001
                end_error = exc
    failed = region_error or end_error
    f.record("other_thread", other)
    f.record("region_error", describe_exc(region_error))
    f.record("capture_end_error", describe_exc(end_error))
    f.counted = failed is not None
    assert not other.get("timeout"), "the other thread hung while this one captured"
    if failed is None:
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, f.x * 2 + 1), "the graph captured beside the other thread's calls is wrong"
    f.record("state", g.state.value)
    if mode != "global":
        assert failed is None, (f"capture_error_mode={mode!r} must let other threads make unsafe calls, "
                                f"but the capture failed: {failed!r}")


@fault("ll_second_thread_global", LL, "unsafe calls from a second thread, capture_error_mode=global")
def _ll_thread_global(f: Fault) -> None:
    _second_thread(f, "global")


@fault("ll_second_thread_thread_local", LL, "unsafe calls from a second thread, capture_error_mode=thread_local")
def _ll_thread_local(f: Fault) -> None:
    _second_thread(f, "thread_local")


@fault("ll_second_thread_relaxed", LL, "unsafe calls from a second thread, capture_error_mode=relaxed")
def _ll_thread_relaxed(f: Fault) -> None:
    _second_thread(f, "relaxed")


@fault("ll_keyboard_interrupt_in_region", LL, "SIGINT (KeyboardInterrupt) in the region")
def _ll_sigint(f: Fault) -> None:
    g = BridgedCUDAGraph()

    def region() -> None:
        with low_level(g, f.s):
            f.x.add_(1)
            sigint()
            f.x.add_(1)

    f.expect(KeyboardInterrupt, region)
    assert g.state is GraphState.FAILED, g.state


@fault("ll_reset_mid_capture", LL, "reset() in the middle of a capture")
def _ll_reset_mid(f: Fault) -> None:
    g = BridgedCUDAGraph()
    with torch.cuda.stream(f.s):
        g.capture_begin()
        f.x.add_(1)
        exc, _ = f.attempt(g.reset)
    assert exc is None, f"reset() during capture raised {exc!r}"
    assert g.state is GraphState.EMPTY, g.state
    assert not capturing(f.s)
    with low_level(g, f.s):  # the same object captures again
        y = f.x * 2
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, f.x * 2)


@fault("ll_graph_deleted_mid_capture", LL, "graph object released in the middle of a capture")
def _ll_deleted_mid(f: Fault) -> None:
    def leak() -> None:
        g = BridgedCUDAGraph()
        with torch.cuda.stream(f.s):
            g.capture_begin()
            f.x.add_(1)
        # g goes out of scope while its stream is still capturing

    leak()
    gc.collect()
    f.record("stream_capturing_after_release", capturing(f.s))


@fault("ll_capture_end_on_wrong_stream", LL, "capture_end() on another stream")
def _ll_wrong_stream(f: Fault) -> None:
    g = BridgedCUDAGraph()
    with torch.cuda.stream(f.s):
        g.capture_begin()
        f.x.add_(1)
    with torch.cuda.stream(torch.cuda.Stream()):
        e = f.expect(RuntimeError, g.capture_end)
    assert "Capture must end on the same stream it began on" in str(e), e  # PyTorch's message, verbatim
    assert "ended and discarded the capture" in str(e), e  # then gfxgraph's


@fault("ll_second_capture_begin_same_graph", LL, "capture_begin() again on a graph that is capturing; the "
       "caller raises out and never ends the first capture")
def _ll_second_begin(f: Fault) -> None:
    """gfxgraph ends and discards the capture in progress at the second begin, so nothing stays capturing
    (the RNG included) although the caller never calls capture_end."""
    g = BridgedCUDAGraph()

    def misuse() -> None:
        with torch.cuda.stream(f.s):
            g.capture_begin()
            _ = f.x * 2 + torch.rand_like(f.x)
            g.capture_begin()  # raises; the caller's code raises out of here

    e = f.expect(RuntimeError, misuse)
    assert "already capturing" in str(e) and "ended and discarded" in str(e), e
    assert not capturing(f.s) and g.state is GraphState.FAILED
    f.record("generator_usable", bool(torch.rand(4, device="cuda").numel()))


@fault("ll_abandoned_capture_then_new_capture", LL,
       "a failed capture never ended by the caller, then a new capture on that stream")
def _ll_abandoned(f: Fault) -> None:
    g1 = BridgedCUDAGraph()
    with torch.cuda.stream(f.s):
        g1.capture_begin()
        exc, _ = attempt(lambda: f.x.sum().item())  # the caller swallows the error, never calls capture_end
    f.record("item_error", describe_exc(exc))
    g2 = BridgedCUDAGraph()
    with torch.cuda.stream(f.s):
        e = f.expect(GraphCaptureError, g2.capture_begin)
    assert "already capturing" in str(e), e
    g1.reset()  # what the message asks for: end the outer capture
    with low_level(g2, f.s):
        y = f.x + 2
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, f.x + 2)


@fault("ll_two_captures_two_streams_one_thread", LL, "two overlapping captures on two streams of one thread")
def _ll_two_streams(f: Fault) -> None:
    s2 = torch.cuda.Stream()
    f.streams.append(s2)
    s2.wait_stream(torch.cuda.current_stream())
    g1, g2 = BridgedCUDAGraph(), BridgedCUDAGraph()
    errors = []
    with torch.cuda.stream(f.s):
        g1.capture_begin()
        y1 = f.x * 2
    with torch.cuda.stream(s2):
        exc, _ = attempt(g2.capture_begin)
        errors.append(("begin2", exc))
        y2 = f.x * 3
    with torch.cuda.stream(f.s):
        exc, _ = attempt(g1.capture_end)
        errors.append(("end1", exc))
    if g2.state is GraphState.CAPTURING:
        with torch.cuda.stream(s2):
            exc, _ = attempt(g2.capture_end)
            errors.append(("end2", exc))
    f.record("steps", {k: describe_exc(e) for k, e in errors})
    f.counted = any(e is not None for _, e in errors)
    for g, y, k in ((g1, y1, 2.0), (g2, y2, 3.0)):
        if g.state is GraphState.READY:
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, f.x * k), "a graph captured beside another capture is wrong"


@fault("ll_capture_on_another_device", LL, "capture on a stream of another device")
def _ll_other_device(f: Fault) -> None:
    if torch.cuda.device_count() < 2:
        raise Skip("needs two GPUs")
    with torch.cuda.device(1):
        s1 = torch.cuda.Stream()
        x1 = torch.ones(16, device="cuda:1")
        g = BridgedCUDAGraph()
        exc, _ = attempt(_capture_cross_device, g, s1, x1, f.x)
    f.record("outcome", describe_exc(exc) or "captured")
    f.record("state", g.state.value)
    f.counted = g.state is not GraphState.READY


def _capture_cross_device(g: Any, s1: torch.cuda.Stream, x1: torch.Tensor, x0: torch.Tensor) -> None:
    with low_level(g, s1):
        x1.add_(x0[:16].to("cuda:1", non_blocking=True))  # a cross-device copy in the region


@fault("ll_nonblocking_copy_to_pageable", LL, "non_blocking copy to pageable host memory in the region")
def _ll_pageable(f: Fault) -> None:
    g = BridgedCUDAGraph()
    host = torch.empty(1024)  # pageable

    def region() -> None:
        with low_level(g, f.s):
            host.copy_(f.x * 2, non_blocking=True)

    exc, _ = f.attempt(region)
    f.counted = exc is not None
    if exc is None:
        host.zero_()
        g.replay()
        torch.cuda.synchronize()
        f.record("replay_wrote_host", bool(torch.equal(host, torch.full((1024,), 2.0))))
        assert torch.equal(host, torch.full((1024,), 2.0)), "the captured copy to pageable memory is wrong"


# ====================================================================== torch.cuda.graph
TG = "torch.cuda.graph"


def _tg(f: Fault, body: Callable[[], Any], **kwargs: Any) -> Callable[[], Any]:
    def region() -> Any:
        g = torch.cuda.CUDAGraph()
        assert isinstance(g, BridgedCUDAGraph)
        with torch.cuda.graph(g, stream=f.s, **kwargs):
            out = body()
        return g, out

    return region


@fault("tg_exception_in_region", TG, "exception in the region")
def _tg_exception(f: Fault) -> None:
    def body() -> None:
        f.x.add_(1)
        raise ValueError("boom")

    f.expect(ValueError, _tg(f, body))


@fault("tg_item_in_region", TG, ".item() in the region")
def _tg_item(f: Fault) -> None:
    f.expect(RuntimeError, _tg(f, lambda: f.x.sum().item()))


@fault("tg_cpu_in_region", TG, ".cpu() in the region")
def _tg_cpu(f: Fault) -> None:
    f.expect(RuntimeError, _tg(f, lambda: (f.x * 2).cpu()))


@fault("tg_print_tensor_in_region", TG, "print(tensor) in the region")
def _tg_print(f: Fault) -> None:
    f.expect(RuntimeError, _tg(f, lambda: print(f.x[:4] * 2)))


@fault("tg_synchronize_in_region", TG, "torch.cuda.synchronize() in the region")
def _tg_sync(f: Fault) -> None:
    def body() -> None:
        f.x.mul_(2)
        torch.cuda.synchronize()

    f.expect(RuntimeError, _tg(f, body))


@fault("tg_oom_in_region", TG, "allocation beyond the device's memory in the region")
def _tg_oom(f: Fault) -> None:
    big = _big()
    f.expect(RuntimeError, _tg(f, lambda: torch.empty(big, dtype=torch.uint8, device="cuda")))


@fault("tg_nested_torch_cuda_graph", TG, "nested torch.cuda.graph (sync in __enter__ under capture)")
def _tg_nested(f: Fault) -> None:
    inner = torch.cuda.CUDAGraph()

    def body() -> None:
        with torch.cuda.graph(inner, stream=f.s):
            f.x.add_(1)

    f.expect(RuntimeError, _tg(f, body))
    assert inner.state is not GraphState.READY


@fault("tg_default_stream", TG, "torch.cuda.graph on the default stream")
def _tg_default(f: Fault) -> None:
    g = torch.cuda.CUDAGraph()

    def region() -> None:
        with torch.cuda.graph(g, stream=torch.cuda.default_stream()):
            f.x.add_(1)

    e = f.expect(RuntimeError, region)
    assert "non-default stream" in str(e), e
    f.counted = False


@fault("tg_keyboard_interrupt_in_region", TG, "SIGINT (KeyboardInterrupt) in the region")
def _tg_sigint(f: Fault) -> None:
    def body() -> None:
        f.x.add_(1)
        sigint()
        f.x.add_(1)

    f.expect(KeyboardInterrupt, _tg(f, body))


def _either_error_or_correct(f: Fault, body: Callable[[], torch.Tensor], expected: Callable[[], torch.Tensor],
                             ) -> None:
    """Safety-only verdict: the capture raised (counted), or it replays to the right result."""
    exc, res = f.attempt(_tg(f, body))
    f.counted = exc is not None
    if exc is None:
        g, out = res
        g.replay()
        torch.cuda.synchronize()
        f.record("outcome", "captured")
        assert torch.equal(out, expected()), "the capture succeeded but its replay is wrong"
    else:
        f.record("outcome", "raised")


@fault("tg_event_synchronize_in_region", TG, "host wait on an event recorded under capture")
def _tg_event_sync(f: Fault) -> None:
    ev = torch.cuda.Event()

    def body() -> torch.Tensor:
        y = f.x + 1
        ev.record()
        ev.synchronize()
        return y

    _either_error_or_correct(f, body, lambda: f.x + 1)


@fault("tg_event_query_in_region", TG, "event.query() on an event recorded under capture")
def _tg_event_query(f: Fault) -> None:
    ev = torch.cuda.Event()

    def body() -> torch.Tensor:
        y = f.x + 1
        ev.record()
        f.record("query_result", ev.query())
        return y

    _either_error_or_correct(f, body, lambda: f.x + 1)


@fault("tg_wait_on_event_from_unrelated_stream", TG, "capture stream waits on an event recorded outside capture")
def _tg_wait_external(f: Fault) -> None:
    other = torch.cuda.Stream()
    ev = torch.cuda.Event()
    with torch.cuda.stream(other):
        z = f.x * 5
        ev.record(other)

    def body() -> torch.Tensor:
        f.s.wait_event(ev)
        return z + 1

    _either_error_or_correct(f, body, lambda: f.x * 5 + 1)


@fault("tg_unjoined_fork", TG, "work forked to a second stream and never joined back")
def _tg_unjoined(f: Fault) -> None:
    s2 = torch.cuda.Stream()
    f.streams.append(s2)

    def body() -> None:
        f.x.add_(1)
        s2.wait_stream(f.s)
        with torch.cuda.stream(s2):
            f.x.mul(2)

    e = f.expect(RuntimeError, _tg(f, body))
    f.record("forked_stream_capturing_after", capturing(s2))
    # PyTorch's own exception passes through, gfxgraph's hint after its message
    assert "ended and discarded the capture" in str(e), f"{type(e).__name__}: {e}"


@fault("tg_unregistered_generator", TG, "a custom torch.Generator used under capture without registration")
def _tg_unregistered(f: Fault) -> None:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    exc, res = f.attempt(_tg(f, lambda: torch.rand(4096, device="cuda", generator=gen)))
    f.counted = exc is not None
    if exc is None:
        g, r = res
        g.replay()
        first = r.clone()
        g.replay()
        torch.cuda.synchronize()
        repeats = torch.equal(first, r)
        f.record("outcome", "captured; replays repeat the same numbers" if repeats else "captured; numbers differ")
        if repeats:
            f.silent_wrong = ("an unregistered generator was captured without an error and every replay returns "
                              "the same random numbers (eager would give new ones)")
    else:
        f.record("outcome", "raised")
    torch.rand(8, device="cuda", generator=gen)  # the custom generator still works eagerly


@fault("tg_empty_cache_in_region", TG, "torch.cuda.empty_cache() in the region")
def _tg_empty_cache(f: Fault) -> None:
    def body() -> torch.Tensor:
        y = f.x + 1
        torch.cuda.empty_cache()
        return y * 2

    _either_error_or_correct(f, body, lambda: (f.x + 1) * 2)


@fault("tg_manual_seed_in_region", TG, "torch.manual_seed() in the region")
def _tg_manual_seed(f: Fault) -> None:
    def body() -> torch.Tensor:
        a = torch.rand(16, device="cuda")
        torch.manual_seed(123)
        return a + torch.rand(16, device="cuda")

    exc, res = f.attempt(_tg(f, body))
    f.counted = exc is not None
    if exc is None:
        g, out = res
        g.replay()
        torch.cuda.synchronize()
        f.record("outcome", "captured")
    else:
        f.record("outcome", "raised")
    torch.manual_seed(0)
    u = torch.rand(8, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(u, torch.rand(8, device="cuda")), "seeding is no longer deterministic after the fault"


@fault("tg_replay_other_graph_in_region", TG, "replay() of another graph inside a capture")
def _tg_replay_inside(f: Fault) -> None:
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, stream=f.s):
        a = f.x * 2

    def body() -> torch.Tensor:
        g1.replay()
        return a + 1

    _either_error_or_correct(f, body, lambda: f.x * 2 + 1)


@fault("tg_pool_of_failed_capture_reused", TG, "capture into the memory pool of a failed capture")
def _tg_dead_pool(f: Fault) -> None:
    pool = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()

    def failing() -> None:
        with torch.cuda.graph(g, pool=pool, stream=f.s):
            (f.x * 2).sum().item()

    f.expect(RuntimeError, failing)
    torch.cuda.set_stream(torch.cuda.default_stream())
    g2 = torch.cuda.CUDAGraph()
    exc, _ = attempt(lambda: _capture_into(g2, pool, f))
    f.record("reuse", describe_exc(exc) or "captured")
    if exc is not None:
        assert isinstance(exc, RuntimeError) and "fresh torch.cuda.graph_pool_handle()" in str(exc), exc
        torch.cuda.set_stream(torch.cuda.default_stream())  # torch.cuda.graph leaves its stream set on refusal


def _capture_into(g: Any, pool: Any, f: Fault) -> None:
    with torch.cuda.graph(g, pool=pool, stream=f.s):
        z = f.x * 3
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, f.x * 3)


# ====================================================================== high-level API
HL = "high-level"


def _hl(f: Fault, model: Callable[[torch.Tensor], Any], **kwargs: Any) -> tuple[BridgedCUDAGraph, Any]:
    g = BridgedCUDAGraph()
    with g.capture(model_fn=model, example_input=torch.randn(8, 64, device="cuda"), **kwargs) as cap:
        pass
    f.record("mode", cap.mode)
    f.record("fallback_reason", cap.fallback_reason[:300])
    return g, cap


def _hl_eager_fallback(f: Fault, model: Callable[[torch.Tensor], Any]) -> None:
    g, cap = _hl(f, model)
    assert cap.mode == "eager", f"expected the eager fallback, the session is in mode {cap.mode!r}"
    assert cap.fallback_reason.startswith("capture_failed"), cap.fallback_reason
    for _ in range(2):
        x2 = torch.randn(8, 64, device="cuda")
        torch.testing.assert_close(g.replay(input_tensor=x2), model(x2), rtol=0, atol=0)


def _cap() -> bool:
    return torch.cuda.is_current_stream_capturing()


@fault("hl_exception_in_model", HL, "exception in the captured model")
def _hl_exception(f: Fault) -> None:
    def model(t: torch.Tensor) -> torch.Tensor:
        if _cap():
            raise ValueError("boom under capture")
        return t * 2

    _hl_eager_fallback(f, model)


@fault("hl_item_in_model", HL, ".item() in the model")
def _hl_item(f: Fault) -> None:
    _hl_eager_fallback(f, lambda t: t * 2 if t.sum().item() < 1e30 else t)


@fault("hl_cpu_in_model", HL, ".cpu() in the model")
def _hl_cpu(f: Fault) -> None:
    _hl_eager_fallback(f, lambda t: (t * 2).cpu().to(t.device))


@fault("hl_print_tensor_in_model", HL, "print(tensor) in the model")
def _hl_print(f: Fault) -> None:
    def model(t: torch.Tensor) -> torch.Tensor:
        print("model sees", t[0, :2])
        return t * 2

    _hl_eager_fallback(f, model)


@fault("hl_synchronize_in_model", HL, "torch.cuda.synchronize() in the model")
def _hl_sync(f: Fault) -> None:
    def model(t: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        return t * 2

    _hl_eager_fallback(f, model)


@fault("hl_oom_in_model", HL, "allocation beyond the device's memory under capture")
def _hl_oom(f: Fault) -> None:
    big = _big()

    def model(t: torch.Tensor) -> torch.Tensor:
        if _cap():
            torch.empty(big, dtype=torch.uint8, device="cuda")
        return t * 2

    _hl_eager_fallback(f, model)


@fault("hl_nested_capture_in_model", HL, "the model captures a graph of its own")
def _hl_nested(f: Fault) -> None:
    def model(t: torch.Tensor) -> torch.Tensor:
        inner = torch.cuda.CUDAGraph()
        with torch.cuda.graph(inner):
            y = t * 2
        inner.replay()
        return y.clone()

    _hl_eager_fallback(f, model)


@fault("hl_keyboard_interrupt_in_model", HL, "SIGINT (KeyboardInterrupt) while the model is captured")
def _hl_sigint(f: Fault) -> None:
    def model(t: torch.Tensor) -> torch.Tensor:
        if _cap():
            sigint()
        return t * 2

    g = BridgedCUDAGraph()
    ex = torch.randn(8, 64, device="cuda")

    def go() -> None:
        with g.capture(model_fn=model, example_input=ex):
            pass

    f.expect(KeyboardInterrupt, go)  # never swallowed
    assert g.state is GraphState.FAILED, g.state
    e, _ = attempt(g.replay, input_tensor=ex)
    f.record("replay_after_interrupt", describe_exc(e))
    assert isinstance(e, RuntimeError) and "capture" in str(e), f"replay after the interrupt: {e!r}"
    with g.capture(model_fn=lambda t: t + 1, example_input=ex) as cap:  # the same object captures again
        pass
    assert cap.mode == "graph", cap.fallback_reason
    x2 = torch.randn(8, 64, device="cuda")
    assert torch.equal(g.replay(input_tensor=x2), x2 + 1)


@fault("hl_keyboard_interrupt_in_warmup", HL, "SIGINT (KeyboardInterrupt) during the warm-up runs")
def _hl_sigint_warmup(f: Fault) -> None:
    calls = {"n": 0}

    def model(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            sigint()
        return t * 2

    g = BridgedCUDAGraph()
    ex = torch.randn(8, 64, device="cuda")

    def go() -> None:
        with g.capture(model_fn=model, example_input=ex):
            pass

    f.expect(KeyboardInterrupt, go)
    f.record("state_after", g.state.value)
    assert torch.cuda.current_stream() == torch.cuda.default_stream(), "the warm-up stream was left current"
    with g.capture(model_fn=model, example_input=ex) as cap:
        pass
    assert cap.mode == "graph", cap.fallback_reason
    assert torch.equal(g.replay(input_tensor=ex), ex * 2)
    f.counted = False  # nothing was captured: the interrupt came before capture_begin


@fault("hl_second_thread_syncs_during_capture", HL, "unsafe calls from a second thread (global mode)")
def _hl_thread(f: Fault) -> None:
    other: list[dict[str, Any]] = []

    def model(t: torch.Tensor) -> torch.Tensor:
        if _cap():
            other.append(unsafe_calls_from_other_thread())
        return t * 2

    g, cap = _hl(f, model)
    f.record("other_thread", other)
    f.counted = cap.mode == "eager"
    for _ in range(2):
        x2 = torch.randn(8, 64, device="cuda")
        assert torch.equal(g.replay(input_tensor=x2), x2 * 2)


@fault("hl_shape_changes_after_warmup", HL, "output shape changes between warm-up and capture, and after",
       validate=True)
def _hl_shape(f: Fault) -> None:
    state = {"calls": 0, "wide": True}

    def model(t: torch.Tensor) -> torch.Tensor:
        state["calls"] += 1
        if state["calls"] <= 2 or not state["wide"]:  # the two warm-up runs see the narrow output
            return t * 2
        return torch.cat([t * 2, t[:, :1]], dim=1)

    g, cap = _hl(f, model)
    x2 = torch.randn(8, 64, device="cuda")
    out = g.replay(input_tensor=x2)
    assert torch.equal(out, torch.cat([x2 * 2, x2[:, :1]], dim=1)), "replay differs from eager"
    state["wide"] = False  # eager now returns another shape than the captured graph
    out2 = g.replay(input_tensor=x2)
    f.record("shape_after_change", list(out2.shape))
    if out2.shape != x2.shape or not torch.equal(out2, x2 * 2):
        f.silent_wrong = "validation mode returned the graph's output of another shape than eager's"
    assert gfxgraph.stats()["validation_failures"] >= 1


@fault("hl_gc_finalizer_syncs_during_capture", HL, "a garbage collection under capture runs a syncing finalizer")
def _hl_gc(f: Fault) -> None:
    log: list[bool] = []

    class Syncs:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the collector frees it

        def __del__(self) -> None:
            log.append(torch.cuda.is_current_stream_capturing())
            torch.cuda.synchronize()

    was = gc.isenabled()
    gc.disable()
    try:
        Syncs()

        def model(t: torch.Tensor) -> torch.Tensor:
            if _cap():
                gc.collect()  # what an allocation-triggered collection would do
            return t * 2

        g, cap = _hl(f, model)
        gc.collect()
    finally:
        if was:
            gc.enable()
    f.record("finalizer_ran_under_capture", any(log))
    assert cap.mode == "graph", f"gc ran a finalizer during capture: {cap.fallback_reason}"
    f.counted = False


@fault("hl_unregistered_generator", HL, "a custom torch.Generator in the model (capture() cannot register it)")
def _hl_unregistered(f: Fault) -> None:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(3)
    g, cap = _hl(f, lambda t: t + torch.rand(t.shape, device=t.device, generator=gen))
    f.counted = cap.mode == "eager"
    z = torch.zeros(8, 64, device="cuda")
    a, b = g.replay(input_tensor=z), g.replay(input_tensor=z)
    if torch.equal(a, b):
        f.silent_wrong = "every replay returned the same random numbers (eager gives new ones)"


# ====================================================================== ShapeBucketPool
SP = "ShapeBucketPool"


def _pool_calls(pool: ShapeBucketPool, model: Callable[[torch.Tensor], torch.Tensor],
                sizes: tuple[int, ...] = (2, 6, 12, 7, 3)) -> None:
    for n in sizes:
        x = torch.randn(n, 5, device="cuda")
        with torch.no_grad():
            assert torch.equal(pool(x), model(x)), f"batch {n}: pool result differs from eager"


@fault("pool_exception_in_one_bucket", SP, "exception while one bucket is captured")
def _pool_exception(f: Fault) -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        if _cap() and x.shape[0] == 8:
            raise ValueError("boom in bucket 8")
        return x * 3

    pool = ShapeBucketPool(model, [4, 8, 16], progress=False)
    _pool_calls(pool, model)
    f.record("failed_buckets", pool.failed_buckets)
    assert pool.captured_buckets == [4, 16] and list(pool.failed_buckets) == [8], pool


@fault("pool_item_in_one_bucket", SP, ".item() while one bucket is captured")
def _pool_item(f: Fault) -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 8:
            x.sum().item()
        return x * 3

    pool = ShapeBucketPool(model, [4, 8, 16], progress=False)
    _pool_calls(pool, model)
    assert pool.captured_buckets == [4, 16] and list(pool.failed_buckets) == [8], pool


@fault("pool_synchronize_in_model", SP, "torch.cuda.synchronize() in the model")
def _pool_sync(f: Fault) -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        return x * 3

    pool = ShapeBucketPool(model, [4, 8, 16], progress=False)
    _pool_calls(pool, model)
    assert pool.captured_buckets == [], pool


@fault("pool_oom_in_one_bucket", SP, "allocation beyond the device's memory while one bucket is captured")
def _pool_oom(f: Fault) -> None:
    big = _big()

    def model(x: torch.Tensor) -> torch.Tensor:
        if _cap() and x.shape[0] == 16:
            torch.empty(big, dtype=torch.uint8, device="cuda")
        return x * 3

    pool = ShapeBucketPool(model, [4, 8, 16], progress=False)
    _pool_calls(pool, model)
    assert list(pool.failed_buckets) == [16], pool


@fault("pool_keyboard_interrupt_in_capture", SP, "SIGINT (KeyboardInterrupt) while one bucket is captured")
def _pool_sigint(f: Fault) -> None:
    armed = {"on": True}

    def model(x: torch.Tensor) -> torch.Tensor:
        if _cap() and x.shape[0] == 8 and armed["on"]:
            armed["on"] = False
            sigint()
        return x * 3

    pool = ShapeBucketPool(model, [4, 8, 16], progress=False)
    f.expect(KeyboardInterrupt, pool, torch.randn(6, 5, device="cuda"))
    _pool_calls(pool, model, (6, 7, 3, 12, 6))
    reasons = gfxgraph.stats()["fallback_reasons"]
    f.record("after", {"captured": pool.captured_buckets, "failed": pool.failed_buckets, "reasons": reasons})
    assert "no_gpu" not in reasons, f"bucket 8 now runs eagerly under a wrong reason: {reasons}"
    assert 8 in pool.captured_buckets or 8 in pool.failed_buckets, "bucket 8 is neither captured nor failed"
    assert {4, 16} <= set(pool.captured_buckets), f"other buckets no longer capture: {pool!r}"


def _pool_second_thread(f: Fault, mode: str) -> None:
    other: list[dict[str, Any]] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        if _cap():
            other.append(unsafe_calls_from_other_thread(device_sync=mode == "global"))
        return torch.relu(x) * 2

    pool = ShapeBucketPool(model, [4, 8], capture_error_mode=mode, progress=False)
    _pool_calls(pool, model, (3, 7, 5, 2))
    f.record("other_thread", other)
    f.record("captured", pool.captured_buckets)
    f.counted = bool(pool.failed_buckets)
    if mode != "global":
        assert pool.captured_buckets == [4, 8], f"mode {mode!r}: {pool.failed_buckets}"


@fault("pool_second_thread_thread_local", SP, "unsafe calls from a second thread, capture_error_mode=thread_local")
def _pool_thread_local(f: Fault) -> None:
    _pool_second_thread(f, "thread_local")


@fault("pool_second_thread_global", SP, "unsafe calls from a second thread, capture_error_mode=global")
def _pool_thread_global(f: Fault) -> None:
    _pool_second_thread(f, "global")


@fault("pool_unregistered_generator", SP, "a custom torch.Generator not passed in generators=")
def _pool_unregistered(f: Fault) -> None:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(5)
    pool = ShapeBucketPool(lambda x: x + torch.rand(x.shape, device=x.device, generator=gen), [4], progress=False)
    z = torch.zeros(3, 8, device="cuda")
    a, b = pool(z), pool(z)
    f.record("captured", pool.captured_buckets)
    f.counted = bool(pool.failed_buckets)
    if torch.equal(a, b):
        f.silent_wrong = "every call returned the same random numbers (eager gives new ones)"


@fault("pool_shape_changes_after_warmup", SP, "output shape changes between the first call's own run and the capture")
def _pool_shape(f: Fault) -> None:
    calls = {"n": 0}

    def model(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:  # the first call's own run (what eager returns for that call)
            return x * 2
        return torch.cat([x * 2, x[:, :1]], dim=1)

    pool = ShapeBucketPool(model, [8], progress=False)
    x = torch.randn(5, 4, device="cuda")
    out = pool(x)  # answered by its own run, the eager result of that call
    f.record("shape", list(out.shape))
    assert out.shape == (5, 4) and torch.equal(out, x * 2), "the first call differs from its eager run"
    again = pool(x)  # the graph, captured from the second run, as eager's later runs
    want = torch.cat([x * 2, x[:, :1]], dim=1)
    assert again.shape == want.shape and torch.equal(again, want), "a later call differs from eager"
    f.counted = False


@fault("pool_gc_finalizer_syncs_during_capture", SP, "a garbage collection under capture runs a syncing finalizer")
def _pool_gc(f: Fault) -> None:
    log: list[bool] = []

    class Syncs:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            log.append(torch.cuda.is_current_stream_capturing())
            torch.cuda.synchronize()

    def model(x: torch.Tensor) -> torch.Tensor:
        if _cap():
            gc.collect()
        return x * 3

    was = gc.isenabled()
    gc.disable()
    try:
        Syncs()
        pool = ShapeBucketPool(model, [4, 8], progress=False)
        _pool_calls(pool, model, (3, 7))
        gc.collect()
    finally:
        if was:
            gc.enable()
    f.record("finalizer_ran_under_capture", any(log))
    assert pool.captured_buckets == [4, 8], f"gc ran a finalizer during capture: {pool.failed_buckets}"
    f.counted = False

