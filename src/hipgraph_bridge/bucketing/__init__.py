"""Dynamic batch sizes: one graph per batch-size bucket, padded inputs, one memory pool."""

from __future__ import annotations

from .buckets import BucketTable, default_buckets, validate_buckets
from .pool import ShapeBucketPool

__all__ = ["ShapeBucketPool", "BucketTable", "default_buckets", "validate_buckets"]
