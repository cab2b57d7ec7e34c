"""How the Triton kernels of :mod:`._philox_triton` address a ``(batch, vocab)`` logits tensor (host side only:
no triton import, so a CPU test checks it)."""

from __future__ import annotations

import torch

_I32 = 2**31


def copies(logits: torch.Tensor) -> bool:
    """Whether the kernels read a contiguous copy of ``logits`` instead: where the last stride is not 1, or
    where the last row starts 2**31 elements or more past the first (a prefill's ``logits[:, -1, :]`` of long
    prompts). The draw kernels index rows in int32, and triton compiles an integer argument of 2**31 or more
    as int64: a kernel variant that a capture would have to load."""
    b, vocab = logits.shape
    return (logits.stride(-1) != 1 and vocab > 1) or (b > 1 and logits.stride(0) * (b - 1) + vocab >= _I32)


def kernel_rows(logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The logits the kernels read (``logits`` or, where :func:`copies`, a contiguous copy) and their row
    stride (one row: the vocabulary, as the stride is then never read)."""
    b, vocab = logits.shape
    if b * vocab >= _I32:
        raise ValueError(f"expected fewer than 2**31 logits, got shape {tuple(logits.shape)}")
    if copies(logits):
        logits = logits.contiguous()
    return logits, (logits.stride(0) if b > 1 else vocab)
