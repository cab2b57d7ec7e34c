"""Dynamic batch sizes: one graph per batch-size bucket, padded where proven sound, one memory pool."""

from __future__ import annotations

from .options import PoolOptions
from .pool import AgreedShapeBucketPool, ShapeBucketPool

__all__ = ["ShapeBucketPool", "AgreedShapeBucketPool", "PoolOptions"]
