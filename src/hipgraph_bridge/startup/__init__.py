"""Start-up: warm every bucket before serving, warm-start compiles through PyTorch's caches, and save a
compiled function's traced frame so a new process runs no dynamo."""

from . import cache
from .frames import load_compiled, save_compiled
from .regions import compile_regions
from .warmup import WarmupReport, resized, warmup

__all__ = ["cache", "warmup", "WarmupReport", "resized", "compile_regions", "save_compiled", "load_compiled"]
