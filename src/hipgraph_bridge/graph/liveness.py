"""Which tensors a capture read without owning them, and whether they still exist at replay.

A graph reads the addresses it captured. If a tensor it read is freed after
the capture and its memory handed to another tensor, a replay silently reads
that other tensor's data. PyTorch 2.13 added ``capture_begin(check_input_liveness=True)``;
on older PyTorch this module does the same job in debug and validate mode:
:class:`InputLiveness` watches every op while the capture runs, remembers the
storages of CUDA inputs the capture did not allocate itself (weakly), and
:meth:`InputLiveness.freed` names those released since.

Cost: every op of the captured region goes through a Python dispatch mode
(capture only), and each replay checks one weak reference per input.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .._torch_compat import TorchDispatchMode, pytree

__all__ = ["InputLiveness"]


class InputLiveness(TorchDispatchMode):
    """Records a capture's external CUDA inputs; :meth:`freed` lists those freed since."""

    def __init__(self) -> None:
        super().__init__()
        self._inputs: dict[int, tuple[weakref.ref[Any], str]] = {}  # storage pointer -> (weak storage, what)
        self._made: set[int] = set()  # storages the capture allocated itself

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.cuda.is_current_stream_capturing():
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.is_cuda and t.untyped_storage().nbytes():
                    self._remember(t)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    self._made.add(t.untyped_storage().data_ptr())
        return out

    def _remember(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._made and ptr not in self._inputs:
            self._inputs[ptr] = (weakref.ref(storage), f"{tuple(t.shape)} {t.dtype} at {ptr:#x}")

    def freed(self) -> list[str]:
        """The inputs whose storage was released (or now lives elsewhere) since the capture."""
        out = []
        for ptr, (ref, what) in self._inputs.items():
            storage = ref()
            if storage is None or storage.data_ptr() != ptr:
                out.append(what)
        return out
