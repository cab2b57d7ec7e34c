"""Argument checks shared by every constructor: each names the argument and says what was expected."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["check_int", "check_bool", "check_cuda_generators"]


def check_int(name: str, value: object, *, minimum: int = 0, error: type[Exception] = ValueError) -> int:
    """``value`` as an int >= ``minimum`` (bools refused), or ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: object, *, error: type[Exception] = TypeError) -> bool:
    """``value`` if it is a bool, else ``error`` naming ``name``."""
    if not isinstance(value, bool):
        raise error(f"{name}: expected a bool, got {value!r}")
    return value


def check_cuda_generators(name: str, generators: Iterable[object]) -> tuple[torch.Generator, ...]:
    """CUDA ``torch.Generator``\\ s, or an error naming ``name``: PyTorch crashes (SIGSEGV)
    registering a CPU generator with a graph."""
    out = tuple(generators)
    for gen in out:
        if not isinstance(gen, torch.Generator) or gen.device.type != "cuda":
            raise TypeError(f"{name}: expected CUDA torch.Generator objects (torch.Generator(device='cuda')), "
                            f"got {gen!r}")
    return out  # type: ignore[return-value]
