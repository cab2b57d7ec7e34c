"""The constructor checks of :class:`~.pool.ShapeBucketPool`: each names the option and what was expected."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..checks import check_bool, check_cuda_generators, check_int

__all__ = ["check_pool_options"]


def check_pool_options(model_fn: Any, buckets: Any, max_batch_size: Any, batch_dim: Any, oversize: Any,
                       warmup_iters: Any, pad_value: Any, static_args: Any, generators: Sequence[Any],
                       **flags: Any) -> None:
    if not callable(model_fn):
        raise TypeError(f"model_fn: expected a callable, got {type(model_fn).__name__}")
    check_int("batch_dim", batch_dim)
    if oversize not in ("eager", "error"):
        raise ValueError(f"oversize: expected 'eager' or 'error', got {oversize!r}")
    check_int("warmup_iters", warmup_iters)
    if pad_value is not None and not isinstance(pad_value, (int, float, bool)):
        raise TypeError(f"pad_value: expected a number or None, got {type(pad_value).__name__}")
    if isinstance(static_args, (str, bytes)) or not isinstance(static_args, Iterable):
        raise TypeError(f"static_args: expected a collection of argument positions (int) or names (str), "
                        f"got {static_args!r}")
    for s in static_args:
        if isinstance(s, bool) or not isinstance(s, (int, str)):
            raise TypeError(f"static_args: expected argument positions (int) or names (str), got {s!r}")
    for name, flag in flags.items():
        check_bool(name, flag)
    check_cuda_generators("generators", generators)
    if flags.get("stateful") and warmup_iters > 1:
        raise ValueError(f"warmup_iters={warmup_iters} with stateful=True: expected 0 or 1 (each warm-up run "
                         "writes the model's state; with 1 the warm-up run is the call's own run)")
    if buckets is not None and max_batch_size is not None:
        raise ValueError(f"buckets={buckets!r} and max_batch_size={max_batch_size!r}: expected one of them "
                         "(max_batch_size only chooses the default buckets)")
