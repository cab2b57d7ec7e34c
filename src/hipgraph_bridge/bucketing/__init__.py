"""Dynamic batch sizes: one graph per batch-size bucket, padded inputs, one memory pool."""

from __future__ import annotations

from .buckets import BucketTable, default_buckets, validate_buckets
from .pool import ShapeBucketPool
from .ranks import RankAgreement

__all__ = ["ShapeBucketPool", "RankAgreement", "BucketTable", "default_buckets", "validate_buckets"]
