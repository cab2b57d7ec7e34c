"""Launch pipeline: upload ahead, double-buffered executable instances, for CUDA and HIP alike.

* **Upload ahead.** Each executable instance is uploaded to the device on a
  staging stream when it is created or updated, so no launch pays for it.
* **Double buffering.** ``instances`` (default 2) executables of the same
  graph are launched in turn. A parameter update (:meth:`LaunchPipeline.update`)
  is applied at once to the *idle* instance, the one launched longest ago,
  and to each other instance just before its own next launch, never to an
  instance in flight. That matters on HIP, which does not document updates
  of an executable in flight as safe; with one instance every update would
  wait for the launch in progress.
* **Launches stay ordered.** All instances run the same graph on the same
  buffers, so their launches must not overlap: they go to one launch stream
  in order, and results equal plain replays. The second stream is the
  staging stream for uploads, which overlap with the launch in flight.
  Alternating launches between two streams would buy no overlap here (the
  buffers are shared) and cost two event operations per launch.

* **Device launch** (``device_launch=True``, CUDA 12+): the instances are
  instantiated for device launch and uploaded, and :meth:`LaunchPipeline.launch`
  launches a one-kernel host graph whose kernel tail-launches the instance
  (:mod:`.device_launch`). The host pays one launch of a one-node graph
  whatever the instance holds; the instance runs before anything queued
  later on the stream. Where device launch is unavailable (HIP: ROCm/hip#3160;
  no ``libcudadevrt.a``; CUDA < 12) the host path runs instead and
  ``device_launch_reason`` says why (logged once at WARNING).

What it will not do: run graphs that hold memory-allocation nodes (the
``cudaMallocAsync`` allocator; the runtime allows one executable per such
graph), or advance PyTorch's RNG offsets between launches.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Any

import torch

from ..checks import check_int
from ..errors import GraphRuntimeError
from ..log import log_once
from ..platform import require_gpu
from ..runtime import Event, Graph, GraphExec, Runtime, as_graph, resolve_runtime, stream_handle
from ..runtime.device_launch import DEVICE_LAUNCH_FLAG
from .device_launch import DeviceTable, device_launch_unavailable_reason, instantiate_for_device, kernel_graph, \
    status_message
from .exec_update import UpdateResult, UpdateStrategy, apply_update, check_update_strategy

__all__ = ["LaunchPipeline"]


class LaunchPipeline:
    """Upload-ahead, double-buffered launches of one captured graph.

    Args:
        graph: a ``torch.cuda.CUDAGraph(keep_graph=True)`` (captured), a
            ``SafeCUDAGraph(keep_graph=True)`` or a runtime :class:`Graph`.
        stream: the launch stream (torch stream or raw int); default: the
            current stream when the pipeline is created.
        instances: executable instances launched in turn (>= 1; 2 is double buffering).
        runtime: a :class:`Runtime`, a kind name, or None for the current runtime.
        strategy: ``"auto"`` updates instances in place when the runtime
            allows; ``"reinstantiate"`` forces new instantiations.
        upload: upload instances ahead on the staging stream.
        device_launch: launch each instance from the device (see the module
            docstring); the host path where that is unavailable, with the reason.

    Raises:
        ValueError/TypeError: bad arguments.
        GraphRuntimeError: ``device_launch=True`` and the runtime refused to instantiate
            the graph for device launch (the runtime's message, then what a device graph may hold).
    """

    def __init__(self, graph: Any, *, stream: Any = None, instances: int = 2,
                 runtime: Runtime | str | None = None, strategy: UpdateStrategy = "auto",
                 upload: bool = True, device_launch: bool = False) -> None:
        check_int("instances", instances, minimum=1)
        if not isinstance(device_launch, bool):
            raise TypeError(f"device_launch: expected a bool, got {type(device_launch).__name__}")
        require_gpu("LaunchPipeline")
        self._rt = resolve_runtime(runtime)
        self._strategy = check_update_strategy(strategy)
        self.device_launch_reason = device_launch_unavailable_reason(self._rt) if device_launch else None
        if self.device_launch_reason is not None:
            log_once(f"pipeline-device-launch:{self.device_launch_reason}", logging.WARNING,
                     "gfxgraph: LaunchPipeline(device_launch=True): %s", self.device_launch_reason)
        self.device_launch = device_launch and self.device_launch_reason is None
        self._flags = DEVICE_LAUNCH_FLAG if self.device_launch else 0
        # a device launch needs the executable uploaded; the host path uploads ahead only to save time
        self._upload = self.device_launch or (bool(upload) and self._rt.capabilities.upload)
        self._stream = stream_handle(stream)
        self._staging_stream = torch.cuda.Stream()  # kept alive: its handle is used below
        self._staging = int(self._staging_stream.cuda_stream)
        self._n = instances
        self._next = 0
        g = as_graph(graph, self._rt)
        self._execs: list[GraphExec] = []
        self._upload_events: list[Event] = []
        self._upload_wait: list[Event | None] = [None] * instances
        self._pending: list[Graph | None] = [None] * instances
        self._table: DeviceTable | None = None
        self._launchers: list[GraphExec] = []
        self._finalizer: weakref.finalize | None = None
        try:
            if self.device_launch:
                self._table = DeviceTable(instances, device=torch.cuda.current_device())
                # handle-table writes go to the staging stream, before the upload event a launch waits for
                self._staging_stream.wait_stream(torch.cuda.current_stream())
            for i in range(instances):
                if self.device_launch:
                    self._execs.append(instantiate_for_device(g, stream=None))  # uploaded just below
                    assert self._table is not None
                    self._table.set(i, self._execs[i], stream=self._staging)
                else:
                    self._execs.append(g.instantiate(track_completion=True))
                self._upload_events.append(Event.create(runtime=self._rt))
                self._upload_ahead(i)
            if self._table is not None:
                table = self._table
                for i in range(instances):
                    self._launchers.append(kernel_graph(
                        table.kernels.launch_one,
                        [(ctypes.c_void_p, table.execs.data_ptr()), (ctypes.c_int, i),
                         (ctypes.c_void_p, table.status.data_ptr())],
                        device=table.device, runtime=self._rt))
        except BaseException:
            self.close()
            raise
        if self._table is not None:
            # collected without close(): a queued launcher kernel must not read a destroyed handle
            self._finalizer = weakref.finalize(self, _release_device_parts, self._execs, self._launchers)
        self.last_result: UpdateResult | None = None
        self.launches = 0
        self.updates = 0
        self.stalls = 0  # updates that had to wait for an instance still in flight

    # ------------------------------------------------------------------ state
    @property
    def runtime(self) -> Runtime:
        return self._rt

    @property
    def instances(self) -> int:
        return self._n

    @property
    def next_instance(self) -> int:
        """Index of the instance the next :meth:`launch` uses (the idle one)."""
        return self._next

    @property
    def stream(self) -> int:
        """The raw handle of the launch stream."""
        return self._stream

    def instance(self, i: int) -> GraphExec:
        return self._execs[i]

    # ------------------------------------------------------------------ launch
    def launch(self, stream: Any = None) -> None:
        """Launch the next instance on the launch stream (or ``stream``) and advance.

        Hot path: one graph launch and one event record (plus, once after an
        update, the staged update of this instance and a wait on its upload).
        No lock, no logging.
        """
        execs = self._execs
        if not execs:
            raise RuntimeError("LaunchPipeline.launch(): the pipeline is closed; create a new one")
        i = self._next
        if self._pending[i] is not None:
            self._apply(i)
        s = self._stream if stream is None else (stream if type(stream) is int
                                                 else stream_handle(stream))
        wait = self._upload_wait[i]
        if wait is not None:
            self._rt.stream_wait_event(s, wait.handle)
            self._upload_wait[i] = None
        if self._launchers:
            self._launchers[i].launch(s)  # its kernel tail-launches execs[i]
            execs[i].mark_launched(s)
        else:
            execs[i].launch(s)
        self._next = i + 1 if i + 1 < self._n else 0
        self.launches += 1

    def synchronize(self) -> None:
        """Block until every instance's last launch finished; with device launch, then :meth:`check`."""
        self.check()

    def check(self) -> None:
        """Wait for every instance's last launch, then raise if a device launch failed since the last check
        (the launcher kernels' status word). A no-op check on the host path.

        Raises:
            GraphRuntimeError: the launcher kernel's ``cudaGraphLaunch`` returned an error.
        """
        for exec_ in self._execs:
            exec_.wait_idle()
        table = self._table
        if table is None:
            return
        code = table.read_status()
        if code:
            table.clear_status()
            raise GraphRuntimeError("cudaGraphLaunch (device)", "DEVICE_LAUNCH_FAILED", code, status_message(code))

    # ------------------------------------------------------------------ update
    def update(self, graph: Any) -> UpdateResult:
        """Stage ``graph`` (same topology, new parameters) for every instance.

        Applied at once to the idle instance (waiting only for that instance's
        previous launch, normally finished) and uploaded ahead; each other
        instance takes it just before its next launch. Every launch after this
        call runs ``graph``. Returns how the idle instance was updated.
        """
        if not self._execs:
            raise RuntimeError("LaunchPipeline.update(): the pipeline is closed; create a new one")
        g = as_graph(graph, self._rt)
        for j in range(self._n):
            self._pending[j] = g
        result = self._apply(self._next)
        self.updates += 1
        return result

    def _apply(self, i: int) -> UpdateResult:
        graph = self._pending[i]
        assert graph is not None  # callers check
        exec_ = self._execs[i]
        if not exec_.is_idle():
            self.stalls += 1
        self._execs[i], result = apply_update(exec_, graph, strategy=self._strategy, flags=self._flags)
        self._pending[i] = None
        if self._table is not None and self._execs[i] is not exec_:
            # re-instantiated: a new handle, written on the staging stream before the upload event that
            # this instance's next launch waits for, on whatever stream it launches
            self._table.set(i, self._execs[i], stream=self._staging)
        self._upload_ahead(i)
        self.last_result = result
        return result

    def _upload_ahead(self, i: int) -> None:
        if not self._upload:
            return
        self._execs[i].upload(self._staging)
        ev = self._upload_events[i]
        ev.record(self._staging)
        # The launch stream waits for the upload before this instance's next launch.
        self._upload_wait[i] = ev

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Wait for the last launches, release every instance (idempotent)."""
        for exec_ in self._execs:
            try:
                exec_.wait_idle()
            except Exception:  # a broken device must not make close() raise
                pass
            exec_.close()
        for ev in self._upload_events:
            ev.close()
        for launcher in getattr(self, "_launchers", ()):
            launcher.close()
        self._launchers = []
        self._execs = []
        self._upload_events = []
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()  # released above
        self._pending = [None] * self._n
        self._upload_wait = [None] * self._n

    def __enter__(self) -> LaunchPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LaunchPipeline(instances={self._n}, launches={getattr(self, 'launches', 0)}, "
                f"runtime={self._rt.kind}, device_launch={getattr(self, 'device_launch', False)})")


def _release_device_parts(execs: list[GraphExec], launchers: list[GraphExec]) -> None:
    """A device-launch pipeline collected without close(): wait for each instance's last launch (its launcher
    kernel read the handle before that), then destroy. Never raises."""
    for exec_ in execs:
        try:
            exec_.wait_idle()
        except Exception:  # a broken device: destroying is still better than keeping
            pass
    for g in (*launchers, *execs):
        try:
            g.close()
        except Exception:
            pass
