"""Counts the fill kernels a call launches (the pool's padding fill is the only one in these tests' models)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountFills(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.fills = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.fill_:
            self.fills += 1
        return func(*args, **(kwargs or {}))
