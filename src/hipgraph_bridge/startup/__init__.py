"""Start-up: warm every bucket before serving, and warm-start compiles through PyTorch's caches."""

from . import cache
from .regions import compile_regions
from .warmup import WarmupReport, resized, warmup

__all__ = ["cache", "warmup", "WarmupReport", "resized", "compile_regions"]
