"""Pool calls whose row count lives on the GPU: one host launch, the bucket picked and launched on the device.

A batch size computed by an earlier kernel (finished sequences dropped,
speculative tokens accepted) costs an ordinary pool call a host read (a
device sync) before it can pick a bucket. :meth:`ShapeBucketPool.device_sized
<.pool.ShapeBucketPool.device_sized>` returns a :class:`DeviceSizedCall`
that needs none::

    call = pool.device_sized(example)      # capacity = the largest bucket
    out = call(n, x)                       # n: a 0-dim integer CUDA tensor; x: capacity rows
    # out: the outputs at capacity rows; rows >= n are zero

A call copies the arguments into the pool's static buffers and launches one
host graph: it fills rows ``[n, capacity)`` of every batched buffer with
``pad_value`` and runs a kernel that reads ``n``, picks the smallest bucket
that holds it and tail-launches that bucket's device graph
(:mod:`hipgraph_bridge.runtime.device_launch`). Each bucket's device graph
runs the model on the buffers' first ``bucket`` rows and writes its outputs
into shared output buffers of capacity rows, rows ``>= n`` zero, so the
caller reads one set of outputs whatever bucket ran. An ``n`` outside
``[1, capacity]`` zero-fills the outputs and is recorded: :meth:`~DeviceSizedCall.check`
raises it (a device sync; debug mode checks after every call).

Padding is only used where the pool proved it safe: the key must be padded
(rows proven independent by the trace, see :mod:`.engine`), and each
bucket's device graph passes the padding check (:mod:`~hipgraph_bridge.padding.confirm`:
replays with the padding poisoned, the real rows unchanged) before it serves
a call. Otherwise, and wherever device launch is unavailable (HIP:
ROCm/hip#3160; CUDA < 12; no ``libcudadevrt.a``), the call takes the host
path, with the reason in :attr:`~DeviceSizedCall.reason`: it reads ``n``
(one sync) and makes an ordinary pool call, with the same outputs.

Costs: building it captures one more graph per bucket (in the pool's memory
pool: the model's Python runs once per bucket, as at capture) and replays
each twice or more for the check. A call: one copy per argument, one copy of
``n``, one host graph launch. Calls run on the current stream; order them
with the pool's ordinary calls on other streams yourself.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

from .. import config
from .._torch_compat import pytree
from ..compose.device_launch import DeviceTable, device_launch_unavailable_reason, instantiate_for_device, \
    status_message
from ..errors import GraphRuntimeError
from ..graph.bridged import SafeCUDAGraph
from ..log import logger
from ..padding.confirm import confirm_padding
from ..padding.layout import BATCHED
from ..runtime import Graph, GraphExec, current_runtime
from ..runtime.jit import launch

__all__ = ["DeviceSizedCall"]

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class DeviceSizedCall:
    """Calls of one pool whose row count is a device tensor (see the module docstring). Made by
    ``ShapeBucketPool.device_sized``, whose internals (engine, buffers, lock) it shares; ``pool`` is typed
    loosely because the pool module imports this one.

    Attributes:
        capacity: the rows every argument and output has (the pool's largest bucket).
        mode: ``"device"`` (device launch) or ``"host"`` (a host read of ``n``, then a pool call).
        reason: why the host path is used (None in device mode).
        n: the device scalar the graphs read; :meth:`run` uses what it holds.
        args, kwargs: views of the pool's static buffers at capacity rows, for zero-copy writes.
    """

    def __init__(self, pool: Any, example_args: tuple[Any, ...], example_kwargs: dict[str, Any], *,
                 device_launch: bool = True) -> None:
        self._pool = pool
        pool.capture_all(*example_args, **example_kwargs)
        engine = pool._engine
        inputs = engine.inputs
        assert inputs is not None  # capture_all fixed the layout
        if inputs.layout.has_consts:
            raise ValueError(f"device_sized(): expected tensor arguments only, got the layout "
                             f"{inputs.layout.describe()}; non-tensor arguments need the ordinary call")
        self._inputs = inputs
        self.capacity = cap = pool.max_bucket
        self._bd = pool.batch_dim
        leaves = inputs.views(cap, cap)
        self.args, self.kwargs = inputs.layout.rebuild(leaves)
        device = inputs.buffers[next(i for i, b in enumerate(inputs.buffers) if b is not None)].device
        self._device = device
        self._dev_index = device.index if device.index is not None else torch.cuda.current_device()
        self.n = torch.ones((), dtype=torch.int64, device=device)
        self._rows = torch.arange(cap, device=device)
        self._graphs: list[SafeCUDAGraph] = []
        self._execs: list[GraphExec] = []
        self._dispatch: SafeCUDAGraph | None = None
        self._table: DeviceTable | None = None
        self.bucket = torch.zeros((), dtype=torch.int64, device=device)  # the bucket the last device call ran
        top = engine.entries.get((cap, ()))
        if top is None or top.graph is None or top.outputs is None:
            self._outputs: list[Any] = []
            self._spec: Any = None
        else:
            self._outputs = [torch.zeros_like(o) if isinstance(o, torch.Tensor) else o for o in top.outputs]
            assert top.layout is not None
            self._spec = top.layout.spec
        self._done = torch.cuda.Event()  # recorded after each dispatch: what release waits for
        self._closed = False
        self.reason = self._why_host() if device_launch else "device_launch=False was asked (the HIP path)"
        if self.reason is None:
            try:
                with pool._lock:  # the pool's buffers and memory pool: no ordinary call or capture meanwhile
                    self._build()
            except Exception as exc:  # whatever failed (the runtime, memory, the model): the host path serves
                self._release()
                self.reason = f"device launch failed to build: {type(exc).__name__}: {exc}"
        # the device graphs, the handle table and the tensors the dispatch reads must outlive every queued
        # dispatch (a kernel reads a freed handle otherwise): released after the last one, also when this
        # object is collected without close()
        self._finalizer = weakref.finalize(self, _release_after, self._done,
                                           (self._execs, self._graphs, self._dispatch, self._table, self.n,
                                            self._rows, self.bucket, getattr(self, "_sizes", None)))
        self.mode = "host" if self.reason is not None else "device"
        if self.reason is not None:
            logger.warning("gfxgraph: %s.device_sized(): host path (a host read of n per call): %s",
                           type(pool).__name__, self.reason)
        self._result = pytree.tree_unflatten(self._outputs, self._spec) if self._spec is not None else None
        # positional tensor arguments only: a call checks shape and dtype per argument and copies, no pytree walk
        plain = not example_kwargs and all(isinstance(a, torch.Tensor) for a in example_args) \
            and len(inputs.buffers) == len(example_args)
        self._quick = [(buf, buf.shape, buf.dtype) for buf in inputs.buffers] if plain else None

    # ------------------------------------------------------------------ decisions
    def _why_host(self) -> str | None:
        pool, engine = self._pool, self._pool._engine
        try:
            why = device_launch_unavailable_reason(current_runtime())
        except Exception as exc:  # no runtime binding loads: the host path needs none
            why = f"no graph runtime binding for device launch: {exc}"
        if why is not None:
            return why
        if pool.options.process_group is not None:
            return "the pool agrees on buckets across ranks, which needs the batch size on the host"
        ks = engine.keys.get(())
        if ks is None or not ks.decided:
            return "the pool has not decided yet whether padding is safe for this model"
        if ks.refusal is not None:
            return f"the pool does not pad this model: {ks.refusal}"
        missing = [b for b in pool.buckets if (e := engine.entries.get((b, ()))) is None or e.graph is None]
        if missing:
            return f"buckets {missing} have no graph (they run eagerly): {pool.failed_buckets}"
        if not self._outputs:
            return "the largest bucket has no static outputs"
        for i, o in enumerate(self._outputs):
            if not isinstance(o, torch.Tensor) or o.dim() <= self._bd or o.shape[self._bd] != self.capacity:
                return f"output {i} does not carry the batch in dimension {self._bd}"
        return None

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        pool, engine, inputs, cap, bd = self._pool, self._pool._engine, self._inputs, self.capacity, self._bd
        capturer = engine.capturer
        dev = self._device.index if self._device.index is not None else torch.cuda.current_device()
        self._table = table = DeviceTable(len(pool.buckets) + 1, device=dev)
        leaves = inputs.views(cap, cap)
        stream = capturer.stream
        with torch.cuda.device(dev), torch.no_grad():
            for i, b in enumerate(pool.buckets):
                a, k = inputs.bucket_args(b, leaves)
                g = SafeCUDAGraph(keep_graph=True)
                with g.capturing(pool=capturer.pool_handle, stream=stream, capture_error_mode="thread_local",
                                 freeze_gc=True):
                    flat = pytree.tree_leaves(pool.model_fn(*a, **k))
                    if len(flat) != len(self._outputs):
                        raise GraphRuntimeError("capture", "OUTPUTS_DIFFER", -1,
                                                f"bucket {b} returned {len(flat)} outputs, bucket {cap} "
                                                f"{len(self._outputs)}")
                    keep = self._rows[:b] < self.n
                    for out, buf in zip(flat, self._outputs):
                        mask = keep.view([-1 if d == bd else 1 for d in range(out.dim())])
                        buf.narrow(bd, 0, b).copy_(torch.where(mask, out, torch.zeros((), dtype=out.dtype,
                                                                                      device=out.device)))
                        if b < cap:
                            buf.narrow(bd, b, cap - b).zero_()
                self._graphs.append(g)
                exe = instantiate_for_device(Graph.from_torch(g), stream=stream)
                self._execs.append(exe)
                table.set(i, exe, stream=stream)
                self._confirm(exe, b, stream)
            zero = SafeCUDAGraph(keep_graph=True)
            with zero.capturing(pool=capturer.pool_handle, stream=stream, capture_error_mode="thread_local"):
                for buf in self._outputs:
                    buf.zero_()
            self._graphs.append(zero)
            exe = instantiate_for_device(Graph.from_torch(zero), stream=stream)
            self._execs.append(exe)
            table.set(len(pool.buckets), exe, stream=stream)
            self._sizes = torch.tensor(pool.buckets, dtype=torch.int64, device=self._device)
            dispatch = SafeCUDAGraph()
            pad_value = inputs.pad_value
            with dispatch.capturing(pool=capturer.pool_handle, stream=stream, capture_error_mode="thread_local"):
                padding = self._rows >= self.n
                for buf in inputs.batched_buffers():
                    buf.masked_fill_(padding.view([-1 if d == bd else 1 for d in range(buf.dim())]), pad_value)
                launch(table.kernels.launch_bucket,
                       [(ctypes.c_void_p, self.n.data_ptr()), (ctypes.c_void_p, self._sizes.data_ptr()),
                        (ctypes.c_void_p, table.execs.data_ptr()), (ctypes.c_int, len(pool.buckets)),
                        (ctypes.c_void_p, self.bucket.data_ptr()), (ctypes.c_void_p, table.status.data_ptr())],
                       int(torch.cuda.current_stream().cuda_stream), device=dev)
            self._dispatch = dispatch
            torch.cuda.current_stream().wait_stream(stream)

    def _confirm(self, exe: GraphExec, bucket: int, stream: torch.cuda.Stream) -> None:
        """The padding check of ``bucket``'s device graph at one real row (the most padding), by host launches."""
        if bucket == 1:
            return
        inputs, bd = self._inputs, self._bd
        torch.cuda.current_stream().wait_stream(stream)
        self.n.fill_(1)

        def replay() -> None:
            exe.launch(torch.cuda.current_stream())

        why = confirm_padding(replay, inputs.pad_regions(1, bucket), inputs.pad_value,
                              lambda: [o.narrow(bd, 0, 1) for o in self._outputs])
        torch.cuda.current_stream().synchronize()
        if why:
            raise GraphRuntimeError("padding check", "PADDING_CHANGES_RESULTS", -1, f"bucket {bucket}: {why}")

    # ------------------------------------------------------------------ calls
    def __call__(self, n: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Copy ``n`` (a 0-dim or one-element integer tensor on the pool's GPU) and the arguments (``capacity``
        rows each, laid out as the example) into the buffers, then :meth:`run`.

        Host cost with positional tensor arguments: a shape and dtype check and a copy per argument, a copy
        of ``n`` and one graph launch; no host read."""
        quick = self._quick
        if quick is not None and not kwargs and len(args) == len(quick) and type(n) is torch.Tensor \
                and n.dtype in _INDEX_DTYPES and n.dim() == 0:
            for (buf, shape, dtype), a in zip(quick, args):
                if type(a) is not torch.Tensor or a.shape != shape or a.dtype != dtype:
                    break
            else:
                with self._pool._lock:  # the pool's buffers: an ordinary call in another thread waits
                    for (buf, _, _), a in zip(quick, args):
                        if a.data_ptr() != buf.data_ptr():
                            buf.copy_(a)
                    self.n.copy_(n)
                    return self.run()
        if not isinstance(n, torch.Tensor) or n.numel() != 1 or n.dtype.is_floating_point or n.is_complex():
            raise TypeError(f"n: expected a one-element integer tensor on {self._device}, got "
                            f"{type(n).__name__ if not isinstance(n, torch.Tensor) else f'{n.dtype} {tuple(n.shape)}'}")
        leaves, layout, batch = self._pool._classify(args, kwargs)
        if layout != self._inputs.layout:
            raise ValueError(f"expected arguments laid out as the example ({self._inputs.layout.describe()}), got "
                             f"{layout.describe()}")
        if batch != self.capacity:
            raise ValueError(f"expected {self.capacity} rows (the capacity) in every batched argument, got {batch}; "
                             "the real row count goes in n")
        with self._pool._lock:
            for buf, leaf in zip(self._inputs.buffers, leaves):
                if buf is not None and leaf.data_ptr() != buf.data_ptr():  # a view of the buffer is there already
                    buf.copy_(leaf)
            self.n.copy_(n.reshape(()))
            return self.run()

    def run(self) -> Any:
        """One call on what :attr:`args`/:attr:`kwargs` and :attr:`n` hold now. Returns the outputs (views of
        shared buffers of capacity rows, rows ``>= n`` zero), valid until the next call."""
        if self._closed:
            raise RuntimeError(f"{self!r} is closed; ask pool.device_sized() again")
        dispatch = self._dispatch
        if dispatch is None:
            with self._pool._lock:
                return self._host_run()
        if torch.cuda.current_device() != self._dev_index:  # the graphs live on the buffers' GPU
            with torch.cuda.device(self._dev_index):
                return self.run()
        with self._pool._lock:
            dispatch.replay()
            self._done.record()
            self._inputs.dirty = self.capacity  # every row may now hold real data: ordinary calls refill
        if config.switches.debug:
            self.check()
        return self._result

    def _host_run(self) -> Any:
        rows = int(self.n.item())  # the sync device launch avoids
        cap, bd = self.capacity, self._bd
        if not 1 <= rows <= cap:
            raise ValueError(f"n: expected a row count in [1, {cap}], got {rows}")
        views = [leaf.narrow(bd, 0, rows) if kind == BATCHED else leaf
                 for leaf, kind in zip(self._inputs.views(cap, cap), self._inputs.layout.kinds)]
        a, k = self._inputs.layout.rebuild(views)
        out = self._pool(*a, **k)
        flat, spec = pytree.tree_flatten(out)
        if self._spec is None or spec != self._spec:
            return out
        leaves = []
        for buf, o in zip(self._outputs, flat):
            if (isinstance(o, torch.Tensor) and isinstance(buf, torch.Tensor) and o.dim() > bd
                    and o.shape[bd] == rows and buf.shape[bd] == cap):
                buf.narrow(bd, 0, rows).copy_(o)
                buf.narrow(bd, rows, cap - rows).zero_()
                leaves.append(buf)
            else:  # an output without the batch (a sum, a constant): the pool's own value
                leaves.append(o)
        return pytree.tree_unflatten(leaves, spec)

    def check(self) -> None:
        """Raise if a device call since the last check had ``n`` out of range or failed to launch (a device sync).

        Raises:
            ValueError: ``n`` was outside ``[1, capacity]`` (the outputs were zero-filled).
            GraphRuntimeError: the device's ``cudaGraphLaunch`` returned an error.
        """
        table = self._table
        if table is None:
            return
        code = table.read_status()
        if not code:
            return
        table.clear_status()
        if code < 0:
            raise ValueError(status_message(code, largest=self.capacity))
        raise GraphRuntimeError("cudaGraphLaunch (device)", "DEVICE_LAUNCH_FAILED", code, status_message(code))

    def _release(self) -> None:
        """A failed build's parts (nothing was dispatched yet)."""
        for exe in self._execs:
            exe.close()
        self._execs, self._graphs, self._dispatch, self._table = [], [], None, None

    def close(self) -> None:
        """Release the device graphs (the pool's own stay), after the last call's dispatch finished.
        Later calls raise ``RuntimeError``."""
        self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        return (f"DeviceSizedCall(capacity={self.capacity}, mode={self.mode!r}"
                + (", closed" if getattr(self, "_closed", False) else "")
                + (f", reason={self.reason!r})" if self.reason else ")"))


def _release_after(done: torch.cuda.Event, resources: tuple[Any, ...]) -> None:
    """Wait for the last dispatch (its tail launch included), then destroy the device graphs. Never raises:
    it runs from close() and from the garbage collector."""
    try:
        done.synchronize()
    except Exception as exc:  # a broken device: destroying is still better than keeping
        logger.debug("gfxgraph: waiting for the last device-sized dispatch failed: %s", exc)
    for exe in resources[0]:
        try:
            exe.close()
        except Exception as exc:
            logger.debug("gfxgraph: releasing a device graph failed: %s", exc)
