"""Native CUDA conditional nodes inside a PyTorch stream capture.

PyTorch captures kernels into a graph but offers no public way to make part
of that graph conditional. :class:`NativeConditional` adds one while a capture
is running on the current stream:

1. a conditional handle is created for the capturing graph;
2. a one-thread setter kernel (see :mod:`.kernels`) is captured; at
   replay it reads a device tensor and sets the handle's value;
3. the conditional node (IF, IF/ELSE, SWITCH or WHILE) is added after the
   stream's current dependencies, and the stream is made to depend on it;
4. each body graph is filled by capturing a Python callable on a side stream
   with ``cudaStreamBeginCaptureToGraph`` (thread-local mode).

Replays then choose or repeat work on the device: no host read, no sync.

Memory: allocations made while a body is captured do not come from the outer
graph's private pool (the allocator routes by capture id, and a body is its
own capture sequence). :class:`BodyPool` routes them into a pool of their own
that lives as long as the graph; without PyTorch's pool-routing API it
refuses bodies that allocate, with an error that says so.

What it will not do: nest a conditional inside a body captured by the same
:class:`NativeConditional` (its side stream is busy; use another instance),
capture random-number ops inside a body (PyTorch's generator offsets are not
advanced per iteration, so a loop would draw the same numbers every time), or
run on HIP (no conditional nodes: see :mod:`.strategies` for the emulations).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import GraphCaptureError, GraphRuntimeError
from ..graph.capture import capture_on_stream, warm_up
from ..log import logger
from ..runtime import CAPTURE_MODE_THREAD_LOCAL, COND_IF, COND_SWITCH, COND_WHILE, Runtime, get_runtime
from .kernels import DECODE_STEP_MAX_BATCH, MAX_EOS_IDS, launch, setter_kernels

__all__ = ["BodyPool", "NativeConditional", "side_stream", "on_stream"]


def side_stream(device: int, *, avoid: Sequence[torch.cuda.Stream] = ()) -> torch.cuda.Stream:
    """A PyTorch stream on ``device`` distinct from every stream in ``avoid``.

    ``torch.cuda.Stream()`` hands out streams round-robin from a small pool,
    so two of them can be the same stream; a body must not be captured on the
    stream whose capture it belongs to.
    """
    taken = {s.cuda_stream for s in avoid}
    for _ in range(128):
        s = torch.cuda.Stream(device=device)
        if s.cuda_stream not in taken:
            return s
    raise RuntimeError(f"could not get a CUDA stream on device {device} distinct from {sorted(taken)}")


def on_stream(fn: Callable[[], Any], stream: torch.cuda.Stream) -> Callable[[], Any]:
    """A warm-up run of ``fn`` moved to ``stream``.

    A capturer warms up on its own stream; bodies are captured on a body
    stream, and cuBLAS and friends keep per-stream state, so a body's ops are
    warmed up there too: pass these runs as the capture's warm-ups.
    """
    return functools.partial(warm_up, fn, stream, 1)


class BodyPool:
    """Where the allocations of conditional bodies go; keep it as long as the graph.

    With ``torch.cuda.MemPool`` (PyTorch >= 2.5), :meth:`route` sends this
    thread's allocations into a private pool: body tensors keep their memory
    for the graph's lifetime and nothing else is handed those blocks.
    Without it, :meth:`route` lets the body run and raises
    :class:`GraphCaptureError` if it allocated anything (bodies must then be
    in place, writing only tensors allocated before the capture).
    """

    def __init__(self, device: int) -> None:
        self.device = int(device)
        mem_pool = getattr(torch.cuda, "MemPool", None)
        self._use = getattr(torch.cuda, "use_mem_pool", None)
        self._pool: Any = mem_pool() if mem_pool is not None and self._use is not None else None

    @property
    def pool_id(self) -> Any:
        """The id of the memory pool bodies allocate from (None when not routed)."""
        return None if self._pool is None else self._pool.id

    @property
    def routes(self) -> bool:
        """Whether allocations are routed (False: bodies that allocate are refused)."""
        return self._pool is not None

    @contextlib.contextmanager
    def route(self) -> Iterator[None]:
        if self._pool is not None:
            with self._use(self._pool, self.device):  # type: ignore[misc]
                yield
            return
        before = _allocations(self.device)
        yield
        made = _allocations(self.device) - before
        if made:
            raise GraphCaptureError(
                f"a conditional body allocated {made} tensor(s), and this PyTorch "
                f"({torch.__version__}) has no torch.cuda.MemPool to keep such memory for the graph; "
                "write the body in place (into tensors allocated before the capture) or upgrade PyTorch")

    def close(self) -> None:
        """Drop the pool (after the graphs using it were released)."""
        self._pool = None


def _allocations(device: int) -> int:
    return int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0))


class NativeConditional:
    """Adds CUDA conditional nodes to the capture running on the current stream.

    Args:
        device: the CUDA device index of the capture.
        body_stream: the side stream bodies are captured on (see :func:`side_stream`);
            warm the bodies' ops up on it before the capture (cuBLAS keeps a workspace per stream).
        pool: where body allocations go (:class:`BodyPool`).
        runtime: a cuda-bindings :class:`~hipgraph_bridge.runtime.Runtime` (default: that binding).

    Every method needs an active capture on the current stream; errors are
    raised after the body capture was ended, and the caller ends (discards)
    the outer capture. Costs per replay: one one-thread setter kernel plus the
    conditional node; the body's kernels run only when selected.
    """

    def __init__(self, *, device: int, body_stream: torch.cuda.Stream, pool: BodyPool,
                 runtime: Runtime | None = None) -> None:
        self.device = int(device)
        self._rt = runtime if runtime is not None else get_runtime("cuda-bindings")
        why = self._rt.conditional_nodes_reason()
        if why:
            raise RuntimeError(f"native conditional nodes are unavailable: {why}")
        self._kernels = setter_kernels(self.device)
        # The binding's runtime initialises itself on its first stream call; make that happen
        # here, not inside a global-mode capture where an initialisation call could invalidate it.
        self._rt.stream_capture_status(body_stream.cuda_stream)
        self._body_stream = body_stream
        self._pool = pool
        self._busy = False

    # ------------------------------------------------------------- node kinds
    def if_else(self, pred: torch.Tensor, bodies: Sequence[Callable[[], None]]) -> None:
        """IF (one body) or IF/ELSE (two): ``bodies[0]`` runs when ``pred`` is non-zero.

        ``pred``: a one-element ``torch.bool``/``torch.uint8`` CUDA tensor,
        read at every replay (write it before replaying).
        """
        _check_scalar("pred", pred, (torch.bool, torch.uint8), self.device)
        if len(bodies) not in (1, 2):
            raise ValueError(f"bodies: expected 1 (IF) or 2 (IF/ELSE) callables, got {len(bodies)}")
        ptr = pred.data_ptr()
        fn = self._kernels.set_if

        def set_value(handle: int) -> None:
            self._launch(fn, [(ctypes.c_ulonglong, handle), (ctypes.c_void_p, ptr)])

        self._add(COND_IF, len(bodies), set_value, [_ignore_handle(b) for b in bodies])

    def switch(self, index: torch.Tensor, bodies: Sequence[Callable[[], None]],
               default: Callable[[], None] | None = None) -> None:
        """SWITCH: ``bodies[i]`` runs when ``index`` holds ``i``; any other value runs
        ``default`` (or nothing). ``index``: a one-element ``torch.int64`` CUDA tensor."""
        _check_scalar("index", index, (torch.int64,), self.device)
        if not bodies:
            raise ValueError("bodies: expected at least one callable, got none")
        ptr, n, fn = index.data_ptr(), len(bodies), self._kernels.set_switch

        def set_value(handle: int) -> None:
            self._launch(fn, [(ctypes.c_ulonglong, handle), (ctypes.c_void_p, ptr), (ctypes.c_uint, n)])

        all_bodies = [*bodies, *([default] if default is not None else [])]
        self._add(COND_SWITCH, len(all_bodies), set_value, [_ignore_handle(b) for b in all_bodies])

    def while_loop(self, step: Callable[[int, bool], None], body: Callable[[], None]) -> None:
        """WHILE: ``step(handle, True)`` is captured before the node, and ``body`` then
        ``step(handle, False)`` form the loop body. ``step`` must launch
        :func:`~hipgraph_bridge.conditional.kernels.launch` of the loop-step kernel
        (see :meth:`launch_loop_step`); the loop runs while it sets a non-zero value."""

        def loop_body(handle: int) -> None:
            body()
            step(handle, False)

        self._add(COND_WHILE, 1, lambda handle: step(handle, True), [loop_body])

    def launch_loop_step(self, handle: int, value: torch.Tensor, *, kind: int, op: int, rhs_i: int,
                         rhs_f: float, counter: torch.Tensor, max_iters: int, first: bool) -> None:
        """Capture one loop-step kernel on the current stream (see :mod:`.kernels`)."""
        self._launch(self._kernels.loop_step, [
            (ctypes.c_ulonglong, handle), (ctypes.c_void_p, value.data_ptr()), (ctypes.c_int, kind),
            (ctypes.c_int, op), (ctypes.c_longlong, rhs_i), (ctypes.c_double, rhs_f),
            (ctypes.c_void_p, counter.data_ptr()), (ctypes.c_int, max_iters), (ctypes.c_int, 1 if first else 0),
        ])

    def launch_set_if(self, handle: int, pred: torch.Tensor) -> None:
        """Capture a kernel that sets the handle to ``pred[0] != 0`` (a one-byte bool/uint8 tensor)."""
        _check_scalar("pred", pred, (torch.bool, torch.uint8), self.device)
        self._launch(self._kernels.set_if, [(ctypes.c_ulonglong, handle), (ctypes.c_void_p, pred.data_ptr())])

    def launch_decode_step(self, handle: int, *, nxt: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor,
                           control: torch.Tensor, position: torch.Tensor, unfinished: torch.Tensor,
                           eos_pad: torch.Tensor) -> None:
        """Capture the decode loop's WHILE step (see :mod:`.kernels`): one block, a thread per sequence.

        ``nxt``/``tokens``: ``(batch,)`` int64; ``out``: ``(batch, chunk)`` int64; ``control``: 3 int64;
        ``position``: one int64; ``unfinished``: ``(batch,)`` bool; ``eos_pad``: ``MAX_EOS_IDS`` EOS ids (-1 for an
        unused slot) then the pad id, int64; all contiguous.
        """
        batch = nxt.numel()
        if not 1 <= batch <= DECODE_STEP_MAX_BATCH:
            raise ValueError(f"decode step: expected 1..{DECODE_STEP_MAX_BATCH} sequences, got {batch}")
        shapes = {"nxt": (batch,), "tokens": (batch,), "out": (batch, out.shape[-1]), "control": (3,),
                  "position": (), "unfinished": (batch,), "eos_pad": (MAX_EOS_IDS + 1,)}
        for name, t in (("nxt", nxt), ("tokens", tokens), ("out", out), ("control", control),
                        ("position", position), ("unfinished", unfinished), ("eos_pad", eos_pad)):
            dtype = torch.bool if name == "unfinished" else torch.int64
            if (not t.is_contiguous() or t.device != torch.device("cuda", self.device) or t.dtype != dtype
                    or tuple(t.shape) != shapes[name]):
                raise ValueError(f"decode step: {name}: expected a contiguous {dtype} tensor of shape "
                                 f"{shapes[name]} on cuda:{self.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        self._launch(self._kernels.decode_step, [
            (ctypes.c_ulonglong, handle), (ctypes.c_void_p, nxt.data_ptr()), (ctypes.c_void_p, tokens.data_ptr()),
            (ctypes.c_void_p, out.data_ptr()), (ctypes.c_void_p, control.data_ptr()),
            (ctypes.c_void_p, position.data_ptr()), (ctypes.c_void_p, unfinished.data_ptr()),
            (ctypes.c_void_p, eos_pad.data_ptr()), (ctypes.c_int, batch), (ctypes.c_int, out.shape[1]),
        ], threads=(batch + 31) // 32 * 32)

    # -------------------------------------------------------------- mechanics
    def _launch(self, fn: Any, args: list[tuple[Any, Any]], threads: int = 1) -> None:
        launch(fn, args, torch.cuda.current_stream(self.device).cuda_stream, device=self.device, threads=threads)

    def _add(self, cond_type: int, size: int, set_value: Callable[[int], None],
             bodies: Sequence[Callable[[int], None]]) -> None:
        if self._busy:
            raise RuntimeError("a conditional node inside a body of the same NativeConditional is not "
                               "supported (its side stream is capturing); use a second NativeConditional "
                               "with another body stream")
        rt = self._rt
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if stream == self._body_stream.cuda_stream:
            raise RuntimeError("the body stream must differ from the capturing stream")
        info = rt.stream_capture_info(stream)
        if info.status != 1:
            raise RuntimeError(f"conditional nodes are added to a running capture, but stream {stream:#x} "
                               f"is {'invalidated' if info.status == 2 else 'not capturing'}; call this "
                               "between capture_begin() and capture_end()")
        handle = rt.conditional_handle_create(info.graph, default_value=0, assign_default=True)
        set_value(handle)  # the setter becomes a dependency of the node below
        info = rt.stream_capture_info(stream)
        node, graphs = rt.graph_add_conditional(info.graph, info.dependencies, handle, cond_type, size)
        rt.stream_set_capture_dependencies(stream, [node])
        for body, graph in zip(bodies, graphs):
            self._capture_body(graph, functools.partial(body, handle), stream)

    def _capture_body(self, graph: int, fn: Callable[[], None], outer_stream: int) -> None:
        rt, s = self._rt, self._body_stream
        rt.stream_begin_capture_to_graph(s.cuda_stream, graph, CAPTURE_MODE_THREAD_LOCAL)
        self._busy = True
        try:
            with torch.cuda.stream(s), self._pool.route():
                fn()
        except BaseException:
            self._end_body_quietly()
            _mark_outer_unsafe(outer_stream)
            raise
        finally:
            self._busy = False
        try:
            ended = rt.stream_end_capture(s.cuda_stream)
        except GraphRuntimeError as exc:
            _mark_outer_unsafe(outer_stream)
            raise GraphCaptureError(f"ending the capture of a conditional body failed: {exc}") from exc
        if not ended:
            _mark_outer_unsafe(outer_stream)
            raise GraphCaptureError(
                "the capture of a conditional body was invalidated; a common cause is a call that "
                "synchronises with the host inside the body (.item(), .cpu(), print(tensor))")
        # The body graph belongs to the conditional node: it is not destroyed here.

    def _end_body_quietly(self) -> None:
        s = self._body_stream
        try:
            if self._rt.stream_capture_status(s.cuda_stream) != 0:
                self._rt.stream_end_capture(s.cuda_stream)
        except Exception as exc:  # the body's own exception is the one to report
            logger.log(logging.DEBUG, "gfxgraph: ending a failed body capture raised: %s", exc)


def _mark_outer_unsafe(outer_stream: int) -> None:
    """The outer graph now holds a node whose body capture failed: it must be leaked, not freed."""
    capture = capture_on_stream(outer_stream)
    if capture is not None:
        capture.mark_partial_graph_unsafe()
    else:
        logger.warning("gfxgraph: a conditional body capture failed inside a capture gfxgraph does not own; "
                       "end that capture without instantiating or destroying its graph")


def _ignore_handle(fn: Callable[[], None]) -> Callable[[int], None]:
    def body(handle: int) -> None:
        fn()
    return body


def _check_scalar(name: str, t: object, dtypes: tuple[torch.dtype, ...], device: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a one-element CUDA tensor, got {type(t).__name__}")
    if t.numel() != 1 or t.dtype not in dtypes or t.device.type != "cuda" or t.device.index != device:
        want = "/".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected a one-element {want} tensor on cuda:{device}, got "
                         f"shape {tuple(t.shape)}, {t.dtype} on {t.device}")
