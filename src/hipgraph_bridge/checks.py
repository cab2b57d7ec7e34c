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


def check_token_ids(name: str, value: object) -> tuple[int, ...]:
    """Token ids as transformers takes an EOS id: an int, a list or tuple of ints, or an integer tensor
    (any shape; its values). Returns them as a tuple of distinct ints >= 0 in their first order; raises
    ``TypeError`` for another type and ``ValueError`` for a negative id or an empty collection."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name}: expected integer token ids, got a tensor of {value.dtype}")
        items: list[object] = [int(v) for v in value.reshape(-1).tolist()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    if not items:
        raise ValueError(f"{name}: expected at least one token id, got {value!r}")
    out: list[int] = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, a list or tuple of ints, or an integer tensor, got {value!r}")
        if v < 0:
            raise ValueError(f"{name}: expected an int >= 0 (or a list, tuple or tensor of them), got {value!r}")
        if v not in out:
            out.append(v)
    return tuple(out)


def check_cuda_generators(name: str, generators: Iterable[object]) -> tuple[torch.Generator, ...]:
    """CUDA ``torch.Generator``\\ s, or an error naming ``name``: PyTorch crashes (SIGSEGV)
    registering a CPU generator with a graph."""
    out = tuple(generators)
    for gen in out:
        if not isinstance(gen, torch.Generator) or gen.device.type != "cuda":
            raise TypeError(f"{name}: expected CUDA torch.Generator objects (torch.Generator(device='cuda')), "
                            f"got {gen!r}")
    return out  # type: ignore[return-value]
