"""``enable()``/``disable()``: the only place gfxgraph patches PyTorch.

``enable()`` swaps ``torch.cuda.CUDAGraph`` (and ``torch.cuda.graphs.CUDAGraph``,
which ``make_graphed_callables`` and inductor reach through the package) for
:class:`BridgedCUDAGraph`; ``disable()`` puts back exactly the objects it found.
Both are idempotent and thread-safe.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from types import ModuleType

import torch
import torch.cuda.graphs

from . import settings as _settings
from . import stats as _stats
from .graph_manager import BridgedCUDAGraph
from .log import logger

__all__ = ["enable", "disable", "is_enabled"]

_TARGETS: tuple[tuple[ModuleType, str], ...] = ((torch.cuda, "CUDAGraph"), (torch.cuda.graphs, "CUDAGraph"))

_lock = threading.RLock()
_originals: dict[tuple[str, str], object] = {}
_atexit_registered = False


def enable(*, debug: bool = False, validate: bool = False) -> None:
    """Route ``torch.cuda.CUDAGraph`` through gfxgraph.

    Idempotent: a second call keeps the patch and updates ``debug``/``validate``.

    Args:
        debug: log every capture, fallback and replay failure at DEBUG level.
        validate: high-level replays (``capture(model_fn=...)``, ``ShapeBucketPool``)
            also run eagerly, compare with dtype-aware tolerances, count
            mismatches and return the eager result. Costs one eager run per replay.
    """
    global _atexit_registered
    if not isinstance(debug, bool) or not isinstance(validate, bool):
        raise TypeError(f"enable(): debug and validate must be bools, got debug={debug!r}, validate={validate!r}")
    with _lock:
        if not _originals:
            for module, name in _TARGETS:
                _originals[(module.__name__, name)] = getattr(module, name)
                setattr(module, name, BridgedCUDAGraph)
            _stats.set_enabled_at(time.time())
        _settings.update(enabled=True, debug=debug, validate=validate)
        if debug:
            logger.setLevel(logging.DEBUG)
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        _register_compile_backend()
    logger.debug("gfxgraph enabled (debug=%s, validate=%s)", debug, validate)


def disable() -> None:
    """Undo :func:`enable`: put back the exact objects it replaced. Idempotent."""
    with _lock:
        if not _originals:
            return
        for module, name in _TARGETS:
            original = _originals.pop((module.__name__, name))
            if getattr(module, name) is BridgedCUDAGraph:
                setattr(module, name, original)
            else:
                logger.warning("gfxgraph.disable(): %s.%s was replaced by someone else since enable(); "
                               "leaving it as it is", module.__name__, name)
        _settings.update(enabled=False, debug=False, validate=False)
        _stats.set_enabled_at(None)
    logger.debug("gfxgraph disabled")


def is_enabled() -> bool:
    """Whether :func:`enable` is in force."""
    return _settings.current().enabled


def _register_compile_backend() -> None:
    try:
        from .compile_backend import register

        register()
    except Exception as exc:  # compile support is optional; graphs work without it
        logger.debug("gfxgraph: compile backend not registered: %s", exc)


def _at_exit() -> None:
    if is_enabled():
        snap = _stats.snapshot()
        logger.debug("gfxgraph at exit: %d captures, %d replays, %d fallbacks %s",
                     snap["capture_count"], snap["replay_count"], snap["fallback_count"],
                     snap["fallback_reasons"])
        disable()
