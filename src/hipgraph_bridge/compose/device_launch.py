"""Device-side launch, composed: executables a kernel launches, and the host graphs whose kernel launches them.

:mod:`hipgraph_bridge.runtime.device_launch` compiles the launcher kernels;
this module puts them to work for :class:`~.pipeline.LaunchPipeline` and for
the pool's device-sized calls: an executable instantiated for device launch
and uploaded, a table of executable handles in device memory (so a kernel can
pick one, and a re-instantiated executable only rewrites its slot), a status
word the kernels record their first error in, and a small host graph holding
one launcher kernel. Launching that host graph costs one host launch; the
executable it picks runs after it, before anything queued later on the
stream (a tail launch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import GraphRuntimeError
from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import side_stream
from ..runtime import Graph, GraphExec, Runtime
from ..runtime.device_launch import DEVICE_LAUNCH_FLAG, OUT_OF_RANGE, device_launch_unavailable_reason, \
    launcher_kernels
from ..runtime.jit import launch

__all__ = ["DeviceTable", "instantiate_for_device", "kernel_graph", "device_launch_unavailable_reason",
           "status_message"]

_NODE_HINT = ("a graph launched from the device may hold only kernels, copies and memsets between device memory, "
              "and child graphs (CUDA C++ Programming Guide, 'Device Graph Requirements'): a host callback, an "
              "event node, a memory-allocation node or a copy from pageable host memory keeps it on the host path")


def instantiate_for_device(graph: Graph, *, stream: Any, track_completion: bool = True) -> GraphExec:
    """``graph`` instantiated for device launch, and uploaded on ``stream`` (a device launch needs the upload;
    None: the caller uploads it).

    Raises:
        GraphRuntimeError: the runtime refused; its message first, then what a device graph may hold.
    """
    try:
        return graph.instantiate(flags=DEVICE_LAUNCH_FLAG, upload_stream=stream, track_completion=track_completion)
    except GraphRuntimeError as exc:
        exc.add_note(_NODE_HINT)
        raise


def kernel_graph(fn: Any, args: Sequence[tuple[Any, Any]], *, device: int, runtime: Runtime) -> GraphExec:
    """A host executable of one launch of ``fn`` (one thread) with ``args`` ((ctypes type, value) pairs)."""
    g = SafeCUDAGraph(keep_graph=True)
    with torch.cuda.device(device), g.capturing(stream=side_stream(None), capture_error_mode="thread_local"):
        launch(fn, args, int(torch.cuda.current_stream().cuda_stream), device=device)
    return Graph.from_torch(g, runtime=runtime).instantiate()


class DeviceTable:
    """Executable handles and sizes in device memory, and the status word the launcher kernels write.

    ``execs[i]`` is read by a kernel when it runs, so :meth:`set` (a write queued
    on ``stream``) changes what later launches on that stream start, never one
    already queued.
    """

    def __init__(self, count: int, *, device: int) -> None:
        self.device = device
        self.execs = torch.zeros(count, dtype=torch.int64, device=f"cuda:{device}")
        self.status = torch.zeros(1, dtype=torch.int32, device=f"cuda:{device}")
        self.kernels = launcher_kernels(device)
        # the zero fill above ran on the current stream; writes may come on another
        torch.cuda.current_stream(device).synchronize()

    def set(self, i: int, exec_: GraphExec, *, stream: Any = None) -> None:
        """Point slot ``i`` at ``exec_`` (queued on ``stream``, default the current one)."""
        s = torch.cuda.current_stream(self.device) if stream is None else stream
        if isinstance(s, int):
            s = torch.cuda.ExternalStream(s, device=f"cuda:{self.device}")
        with torch.cuda.stream(s):
            self.execs[i].fill_(int(exec_.handle))

    def read_status(self) -> int:
        """The first error a launcher kernel recorded (0: none); synchronizes with the device."""
        return int(self.status.item())

    def clear_status(self) -> None:
        self.status.zero_()


def status_message(code: int, *, largest: int | None = None) -> str:
    """What a launcher status code means."""
    if code == OUT_OF_RANGE:
        return (f"a device-sized call's row count was outside [1, {largest}]: the outputs were zero-filled"
                if largest is not None else "a row count was outside the buckets")
    return f"cudaGraphLaunch on the device returned cudaError_t {code}"
