"""The options of a :class:`~.pool.ShapeBucketPool`, checked once, frozen, and embedded by the compile backend's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch

from ..checks import check_bool, check_cuda_generators, check_int
from ..config import check_vram_cap, read_vram_cap
from ..graph.buckets import default_buckets, validate_buckets
from ..graph.capture import check_capture_mode
from ..ranks.agreement import RankAgreement, as_agreement

__all__ = ["PoolOptions", "BatchedOutputs", "check_batched_outputs"]

# One flag per output leaf, or a function of the output tree returning them (None: read them from the trace).
BatchedOutputs = Union[Sequence[bool], Callable[[Any], Union[Sequence[bool], None]], None]


def check_batched_outputs(value: object) -> BatchedOutputs:
    if value is None or callable(value):
        return value  # type: ignore[return-value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) \
            or not all(isinstance(v, bool) for v in value):
        raise TypeError("batched_outputs: expected a sequence of bools (one per output leaf), a function "
                        f"of the outputs returning them, or None, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class PoolOptions:
    """Every option of a pool (the constructor's keywords; see :class:`~.pool.ShapeBucketPool`).

    Build it with :meth:`create`, which checks each value and raises
    ``TypeError``/``ValueError`` naming the option and what was expected;
    ``dataclasses.replace`` on a checked instance keeps it checked for the
    fields it does not touch.
    """

    buckets: tuple[int, ...] = ()
    batch_dim: int = 0
    static_args: frozenset[int | str] = frozenset()
    pad_value: float | int | bool | None = 0
    copy_outputs: bool = True
    oversize: Literal["eager", "error"] = "eager"
    warmup_iters: int = 1
    vram_cap: float = 0.9
    capture_error_mode: str = "thread_local"
    generators: tuple[torch.Generator, ...] = ()
    progress: bool = True
    batched_outputs: BatchedOutputs = None
    stateful: bool | None = None
    rows_independent: bool | None = None
    simulate_padding: bool = False
    process_group: RankAgreement | None = None

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    @classmethod
    def create(cls, buckets: Iterable[int] | None = None, *, max_batch_size: int | None = None, batch_dim: int = 0,
               static_args: Collection[int | str] = (), pad_value: float | int | bool | None = 0,
               copy_outputs: bool = True, oversize: str = "eager", warmup_iters: int = 1,
               vram_cap: float | None = None, capture_error_mode: str = "thread_local",
               generators: Sequence[torch.Generator] = (), progress: bool = True,
               batched_outputs: BatchedOutputs = None, stateful: bool | None = None,
               rows_independent: bool | None = None, simulate_padding: bool = False,
               process_group: Any = None) -> PoolOptions:
        """Check every option (named in the error) and return them frozen."""
        if buckets is not None and max_batch_size is not None:
            raise ValueError(f"buckets={buckets!r} and max_batch_size={max_batch_size!r}: expected one of them "
                             "(max_batch_size only chooses the default buckets)")
        table = validate_buckets(buckets) if buckets is not None \
            else default_buckets(256 if max_batch_size is None else max_batch_size)
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
        for name, flag in (("copy_outputs", copy_outputs), ("progress", progress),
                           ("simulate_padding", simulate_padding)):
            check_bool(name, flag)
        for name, tri in (("stateful", stateful), ("rows_independent", rows_independent)):
            if tri is not None:
                check_bool(name, tri)
        check_cuda_generators("generators", generators)
        if stateful and warmup_iters > 1:
            raise ValueError(f"warmup_iters={warmup_iters} with stateful=True: expected 0 or 1 (each warm-up run "
                             "writes the model's state; with 1 the warm-up run is the call's own run)")
        agreement = as_agreement(process_group)
        if agreement is not None and agreement.batch == "max" and stateful:
            raise ValueError("process_group with batch='max' and stateful=True: a stateful model is never padded, "
                             "and 'max' grows a rank's batch with padding rows; expected batch='equal' or "
                             "'trusted' for a stateful model")
        return cls(buckets=tuple(table), batch_dim=batch_dim, static_args=frozenset(static_args),
                   pad_value=pad_value, copy_outputs=copy_outputs, oversize=oversize,  # type: ignore[arg-type]
                   warmup_iters=warmup_iters,
                   vram_cap=read_vram_cap() if vram_cap is None else check_vram_cap(vram_cap),
                   capture_error_mode=check_capture_mode(capture_error_mode), generators=tuple(generators),
                   progress=progress, batched_outputs=check_batched_outputs(batched_outputs), stateful=stateful,
                   rows_independent=rows_independent, simulate_padding=simulate_padding, process_group=agreement)

    def replace(self, **changes: Any) -> PoolOptions:
        return dataclasses.replace(self, **changes)
