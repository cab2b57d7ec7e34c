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

__all__ = ["release_outputs"]

_construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> int:
    # the temporary storage object made here holds one reference itself
    return int(_use_count(t.untyped_storage()._cdata)) - 1  # type: ignore[misc]


def _non_owning(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    weak = _construct(storage.data_ptr(), t.device, storage.nbytes())  # type: ignore[misc]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.size(), t.stride())


def release_outputs(leaves: list[Any]) -> list[Any]:
    """Replace CUDA tensor leaves whose storage only the outputs own by non-owning views.

    Returns the new leaf list; the caller must drop every other reference to the
    original outputs for the memory to return to the pool. Without the PyTorch
    internals this needs, the leaves are returned unchanged (still correct, more memory).
    """
    if _construct is None or _use_count is None:
        return leaves
    groups: dict[int, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda" and leaf.untyped_storage().nbytes():
            groups.setdefault(leaf.untyped_storage().data_ptr(), []).append(i)
    out = list(leaves)
    for idxs in groups.values():
        if _storage_refs(leaves[idxs[0]]) == len(idxs):
            for i in idxs:
                out[i] = _non_owning(leaves[i])
    return out
