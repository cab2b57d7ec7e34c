"""Which outputs carry the batch, and how a bucket's outputs become a call's result.

A tensor with ``b`` rows in ``batch_dim`` may carry the batch or just happen
to have ``b`` rows (4 hidden units with bucket 4), so batchedness is never
read from sizes alone: it is given (``batched_outputs``: one flag per output
leaf, or a function of the outputs returning them) or learnt with one eager
run at another batch size, where batched outputs follow the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from .._torch_compat import pytree
from ..log import logger

__all__ = ["BatchedOutputs", "OutputLayout", "learn_output_layout", "probe_other_size", "probe_sizes", "same_kinds",
           "check_batched_outputs"]

# One flag per output leaf, or a function of the output tree returning them (None: learn them).
BatchedOutputs = Union[Sequence[bool], Callable[[Any], Union[Sequence[bool], None]], None]


def check_batched_outputs(value: object) -> BatchedOutputs:
    if value is None or callable(value):
        return value  # type: ignore[return-value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) \
            or not all(isinstance(v, bool) for v in value):
        raise TypeError("batched_outputs: expected a sequence of bools (one per output leaf), a function "
                        f"of the outputs returning them, or None, got {value!r}")
    return tuple(value)


@dataclass
class OutputLayout:
    """One bucket's outputs: their tree, which leaves carry the batch, sliced views per batch size.

    ``batched`` is None when it could not be learnt (the probe run failed):
    then a padded call cannot be sliced back, and runs eagerly instead.
    """

    size: int  # the bucket
    spec: Any
    batched: tuple[bool, ...] | None
    _views: dict[int, tuple[list[Any], Any]] = field(default_factory=dict)  # batch -> (sliced leaves, tree)

    def __post_init__(self) -> None:
        # A leaf or a flat tuple of leaves (the common outputs) is rebuilt without pytree's walk.
        n = self.spec.num_leaves
        if self.spec == pytree.tree_structure(0):
            self._rebuild: Callable[[list[Any]], Any] = lambda leaves: leaves[0]
        elif self.spec == pytree.tree_structure(tuple(range(n))):
            self._rebuild = tuple
        else:
            self._rebuild = functools.partial(_unflatten, spec=self.spec)
        self._immutable = not isinstance(self._rebuild, functools.partial)  # a cached tree cannot be mutated

    @property
    def known(self) -> bool:
        return self.batched is not None

    def result(self, leaves: list[Any], batch: int, *, batch_dim: int, copy: bool, cache: bool) -> Any:
        """The outputs of a call of ``batch`` rows: batched leaves sliced to ``batch``, copied if asked.

        ``cache`` keeps the sliced views per batch size (for a graph's static
        outputs); uncopied, a leaf or tuple result is then the same object every call.
        """
        cached = self._views.get(batch) if cache else None
        if cached is None:
            if batch < self.size and self.batched is None:
                raise RuntimeError("the outputs' batch dimensions are unknown: a padded result cannot be sliced")
            flags = self.batched or (False,) * len(leaves)
            sliced = [o.narrow(batch_dim, 0, batch) if is_b and batch < self.size else o
                      for o, is_b in zip(leaves, flags)]
            cached = (sliced, self._rebuild(sliced) if self._immutable else None)
            if cache:
                self._views[batch] = cached
        sliced, tree = cached
        if copy:
            return self._rebuild([o.clone() if isinstance(o, torch.Tensor) else o for o in sliced])
        return tree if tree is not None else self._rebuild(sliced)


def _unflatten(leaves: list[Any], *, spec: Any) -> Any:
    return pytree.tree_unflatten(leaves, spec)


def learn_output_layout(outputs: Any, bucket: int, *, batch_dim: int, given: BatchedOutputs,
                        known: tuple[bool, ...] | None,
                        probe: Callable[[], tuple[int, list[Any]] | None] | None) -> OutputLayout:
    """The layout of a bucket's ``outputs``.

    ``known``: flags learnt earlier for the same constant arguments.
    ``probe``: runs the model eagerly at another batch size and returns
    (that size, its output leaves), or None when that failed; ``probe=None``
    means no call will ever be sliced (one bucket of size 1, or a model
    never padded), so the flags are not needed.
    """
    leaves, spec = pytree.tree_flatten(outputs)
    if known is not None:
        return OutputLayout(bucket, spec, known)
    flags = given(outputs) if callable(given) else given
    if flags is not None:
        if len(flags) != len(leaves):
            raise ValueError(f"batched_outputs: expected {len(leaves)} flags (one per output leaf), "
                             f"got {len(flags)}")
        return OutputLayout(bucket, spec, tuple(bool(f) for f in flags))
    bd = batch_dim
    candidates = tuple(isinstance(o, torch.Tensor) and o.dim() > bd and o.shape[bd] == bucket for o in leaves)
    if not any(candidates) or probe is None:
        return OutputLayout(bucket, spec, candidates)
    found = probe()
    if found is None or len(found[1]) != len(leaves):
        logger.warning("gfxgraph: which outputs carry the batch could not be learnt (the model did not run at "
                       "another batch size); calls that need padding run eagerly. Pass batched_outputs= "
                       "(one flag per output leaf) to graph them")
        return OutputLayout(bucket, spec, None)
    size, other = found
    return OutputLayout(bucket, spec, tuple(c and isinstance(p, torch.Tensor) and p.dim() > bd and p.shape[bd] == size
                                            for c, p in zip(candidates, other)))


def probe_sizes(bucket: int, largest: int) -> list[int]:
    """The batch sizes a probe tries for ``bucket``: 1, then ``bucket - 1`` (2 for bucket 1), at most ``largest``."""
    return list(dict.fromkeys(s for s in (1, bucket - 1 if bucket > 1 else 2) if s != bucket and s <= largest))


def probe_other_size(model_fn: Callable[..., Any], inputs: Any, leaves: list[Any], bucket: int,
                     largest: int) -> tuple[int, list[Any]] | None:
    """Run the model eagerly at a batch size other than ``bucket`` (on the static buffers' rows).

    Tries 1, then ``bucket - 1`` (or 2 for bucket 1), never above ``largest``;
    returns (that size, its output leaves), or None when every try failed (a
    model whose state has a fixed batch size, batch norm at batch 1). It runs
    outside any capture, once per constant-argument key.
    """
    for size in probe_sizes(bucket, largest):
        try:
            with torch.no_grad():
                a, k = inputs.bucket_args(size, leaves)
                return size, pytree.tree_leaves(model_fn(*a, **k))
        except Exception as exc:
            logger.debug("gfxgraph: output probe at batch %d failed: %s", size, exc)
    return None


def same_kinds(first: list[Any], static: list[Any]) -> bool:
    """Whether two output leaf lists agree in kind, shape, dtype and device (and in value, for non-tensors)."""
    if len(first) != len(static):
        return False
    for a, b in zip(first, static):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                return False
            continue
        try:
            if a != b:
                return False
        except Exception:  # a value without a plain comparison
            logger.debug("gfxgraph: output values %r and %r cannot be compared", type(a), type(b))
            return False
    return True
