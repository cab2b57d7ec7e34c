"""Which sizes get a graph, and which graph a size runs in.

A bucket table maps a size ``n`` (a batch, a token count) to the smallest
bucket ``b >= n``. It holds the buckets and nothing per size, so
``buckets=[1, 2**31]`` costs two ints; a lookup is one bisection.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

__all__ = ["default_buckets", "validate_buckets", "BucketTable"]


def default_buckets(max_batch_size: int = 256) -> list[int]:
    """Fine steps at small sizes, coarser above (as serving stacks do): 1, 2, 4, 8, then steps of
    8 to 64, 16 to 128, 32 to 256, 64 to 1024, then doubling; capped at ``max_batch_size``.

    The list is O(log max_batch_size) long beyond 1024, so any positive int is accepted.
    """
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size: expected a positive int, got {max_batch_size!r}")
    out = [1, 2, 4, 8]
    b = 8
    while b < max_batch_size:
        b += 8 if b < 64 else 16 if b < 128 else 32 if b < 256 else 64 if b < 1024 else b
        out.append(b)
    return sorted({min(x, max_batch_size) for x in out})


def validate_buckets(buckets: Iterable[int]) -> list[int]:
    """Positive ints, returned sorted and de-duplicated; anything else is a clear error."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        raise TypeError(f"buckets: expected an iterable of positive ints, got {type(buckets).__name__}")
    values = list(buckets)
    if not values:
        raise ValueError("buckets: expected at least one bucket size, got an empty list")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"buckets: expected positive ints, got {v!r} in {values!r}")
    return sorted(set(values))


class BucketTable:
    """The smallest bucket >= a size (see the module docstring).

    ``exact``: every size up to the largest bucket is its own bucket (for a
    model that is never padded); lookups then return the size itself.
    Cost per lookup: one ``bisect`` over the buckets (none when exact).
    """

    __slots__ = ("buckets", "largest", "exact")

    def __init__(self, buckets: list[int], *, exact: bool = False) -> None:
        self.buckets = buckets
        self.largest = buckets[-1]
        self.exact = exact

    def __getitem__(self, size: int) -> int:
        """The bucket of ``size`` (1 <= size <= largest)."""
        if self.exact:
            return size
        b = self.buckets
        return b[bisect.bisect_left(b, size)]

    def bucket_for(self, size: int) -> int | None:
        """The bucket a call of ``size`` rows runs in; None when above the largest."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"batch_size: expected a positive int, got {size!r}")
        return self[size] if size <= self.largest else None

    def __repr__(self) -> str:
        return f"BucketTable({self.buckets}{', exact=True' if self.exact else ''})"
