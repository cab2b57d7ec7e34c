"""Which batch sizes get a graph, and which graph a batch runs in."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["default_buckets", "validate_buckets", "BucketTable"]


def default_buckets(max_batch_size: int = 256) -> list[int]:
    """Fine steps at small sizes, coarser above (as serving stacks do): 1, 2, 4, 8, then
    steps of 8 to 64, 16 to 128, 32 to 256, 64 beyond; capped at ``max_batch_size``."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size: expected a positive int, got {max_batch_size!r}")
    out = [1, 2, 4, 8]
    b = 8
    while b < max_batch_size:
        b += 8 if b < 64 else 16 if b < 128 else 32 if b < 256 else 64
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
    """The smallest bucket >= a batch size, by table lookup (one list index per call)."""

    def __init__(self, buckets: list[int], *, exact: bool = False) -> None:
        """``exact``: every size up to the largest bucket is its own bucket (a model that is never padded)."""
        self.buckets = buckets
        self.largest = buckets[-1]
        self._table = list(range(self.largest + 1))
        if exact:
            return
        j = 0
        for n in range(1, self.largest + 1):
            while buckets[j] < n:
                j += 1
            self._table[n] = buckets[j]

    def __getitem__(self, batch: int) -> int:
        """The bucket of ``batch`` (1 <= batch <= largest)."""
        return self._table[batch]

    def bucket_for(self, batch_size: int) -> int | None:
        """The bucket a batch of ``batch_size`` rows runs in; None when above the largest."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
        return self._table[batch_size] if batch_size <= self.largest else None
