"""Hand a captured graph's output memory back to its pool, keeping non-owning views.

After capture, a graph's outputs are ordinary tensors allocated in its private
pool; holding them keeps that memory out of reach of every later capture into
the same pool, so N bucket graphs cost the sum of their outputs. But outputs
of graphs in one pool only need to live from one replay until they are read:
serving stacks (vLLM's weak-ref outputs, inductor's cudagraph trees) drop the
owning reference and read through a pointer instead. This does the same with
PyTorch's own storage-from-pointer constructor.

Safety rule: an output is released only when the graph's outputs are the sole
owners of its storage (the pool allocated it during capture and nothing else
holds it). Outputs that alias parameters, inputs or anything kept elsewhere
stay owned. The pool's memory itself stays reserved while the graph lives, so
the pointer remains valid device memory; its contents are whatever the last
replay of any graph in the pool wrote there.
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch_compat import non_owning_view, storage_use_count, weak_view_supported

__all__ = ["release_outputs"]


def release_outputs(leaves: list[Any]) -> list[Any]:
    """Replace CUDA tensor leaves whose storage only the outputs own by non-owning views.

    Returns the new leaf list; the caller must drop every other reference to the
    original outputs for the memory to return to the pool. Without the PyTorch
    internals this needs, the leaves are returned unchanged (still correct, more memory).
    """
    if not weak_view_supported:
        return leaves
    groups: dict[int, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda" and leaf.untyped_storage().nbytes():
            groups.setdefault(leaf.untyped_storage().data_ptr(), []).append(i)
    out = list(leaves)
    for idxs in groups.values():
        if storage_use_count(leaves[idxs[0]]) == len(idxs):
            for i in idxs:
                out[i] = non_owning_view(leaves[i])
    return out
