"""Graph memory as the caching allocator reports it, and the VRAM cap.

Nothing here estimates: pool sizes come from the allocator's own segment
table, and the VRAM check reads the driver's free/total counters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["graph_pool_bytes", "graph_pool_ids", "device_memory", "exceeds_vram_cap"]

def _as_pool_key(pool: object) -> tuple[int, int]:
    a, b = pool  # type: ignore[misc]  # _POOL_HANDLE is a (int, int) tuple
    return (int(a), int(b))


def graph_pool_bytes(pools: Iterable[object] | None = None, *, device: int | None = None) -> int:
    """Bytes reserved by graph memory pools, from the allocator's segment table.

    Args:
        pools: pool handles (``graph.pool()``) to count; None counts every
            private (graph) pool.
        device: only segments on this device index; None counts all devices.

    Cost: walks the allocator's segments (milliseconds); not for hot paths.
    Returns 0 when CUDA was never initialised in this process.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    wanted = None if pools is None else {_as_pool_key(p) for p in pools}
    total = 0
    for seg in torch.cuda.memory_snapshot():
        if device is not None and seg.get("device") != device:
            continue
        key = _as_pool_key(seg.get("segment_pool_id", (0, 0)))
        if key == (0, 0):
            continue  # the default (non-graph) pool
        if wanted is None or key in wanted:
            total += int(seg["total_size"])
    return total


def graph_pool_ids(*, device: int | None = None) -> set[tuple[int, int]]:
    """The private pools (graph pools, and ``MemPool`` objects such as a conditional body's) that hold memory
    now, as the ``(int, int)`` keys :func:`graph_pool_bytes` takes (which counts the same pools).

    The difference of two calls names the pools made in between: their bytes are a
    run's own graph memory even when other pools were freed meanwhile.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return set()
    keys = {_as_pool_key(seg.get("segment_pool_id", (0, 0))) for seg in torch.cuda.memory_snapshot()
            if device is None or seg.get("device") == device}
    return keys - {(0, 0)}


def device_memory(device: int | None = None) -> tuple[int, int]:
    """(free, total) bytes on ``device`` as the driver reports them."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)

def exceeds_vram_cap(extra_bytes: int, cap: float, device: int | None = None) -> tuple[bool, str]:
    """Whether using ``extra_bytes`` more would push device use past ``cap`` of total.

    Returns (exceeds, explanation) so the caller can log the figures.
    """
    free, total = device_memory(device)
    used = total - free
    projected = used + max(0, int(extra_bytes))
    limit = cap * total
    msg = (
        f"projected use {projected / 2**20:.0f} MiB (used {used / 2**20:.0f} MiB + "
        f"{extra_bytes / 2**20:.0f} MiB) vs cap {cap:.2f} x {total / 2**20:.0f} MiB"
    )
    return projected > limit, msg
