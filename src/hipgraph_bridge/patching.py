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

from . import config, stats
from .compat.graph import BridgedCUDAGraph
from .compile.backend import register as register_compile_backend
from .log import attach_stderr_handler, detach_stderr_handler, logger

__all__ = ["enable", "disable", "is_enabled"]

_TARGETS: tuple[tuple[ModuleType, str], ...] = ((torch.cuda, "CUDAGraph"), (torch.cuda.graphs, "CUDAGraph"))

_lock = threading.RLock()
_originals: dict[tuple[str, str], object] = {}
_level_before_debug: int | None = None  # the logger's level before enable(debug=True), restored by disable()
_handler_by_debug = False  # enable(debug=True) attached the stderr handler; disable() detaches it
_atexit_registered = False


def enable(*, debug: bool = False, validate: bool = False) -> None:
    """Route ``torch.cuda.CUDAGraph`` through gfxgraph.

    Idempotent: a second call keeps the patch and updates ``debug``/``validate``.

    Args:
        debug: log every capture, fallback and replay failure at DEBUG level,
            printed on stderr unless the application configured logging (the
            ``gfxgraph`` logger's level and that stderr handler are put back by
            :func:`disable`).
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
            stats.set_enabled_at(time.time())
        config.set_switches(enabled=True, debug=debug, validate=validate)
        _set_debug_logging(debug)
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        try:
            register_compile_backend()
        except Exception as exc:  # graphs work without the compile backend; never fail enable() over it
            logger.debug("gfxgraph: compile backend not registered: %s", exc)
    logger.debug("gfxgraph enabled (debug=%s, validate=%s)", debug, validate)


def disable() -> None:
    """Undo :func:`enable`: put back the exact objects it replaced, and the logger's level. Idempotent."""
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
        config.set_switches(enabled=False, debug=False, validate=False)
        stats.set_enabled_at(None)
        _set_debug_logging(False)
    logger.debug("gfxgraph disabled")


def _set_debug_logging(debug: bool) -> None:
    """Turn debug logging on (DEBUG level, records on stderr) or back to what it was (under ``_lock``)."""
    global _level_before_debug, _handler_by_debug
    if debug and _level_before_debug is None:
        _level_before_debug = logger.level
        logger.setLevel(logging.DEBUG)
        _handler_by_debug = attach_stderr_handler()
    elif not debug and _level_before_debug is not None:
        logger.setLevel(_level_before_debug)
        _level_before_debug = None
        if _handler_by_debug:
            detach_stderr_handler()
            _handler_by_debug = False


def is_enabled() -> bool:
    """Whether :func:`enable` is in force."""
    return config.switches.enabled


def _at_exit() -> None:
    if is_enabled():
        snap = stats.snapshot()
        logger.debug("gfxgraph at exit: %d captures, %d replays, %d fallbacks %s",
                     snap["capture_count"], snap["replay_count"], snap["fallback_count"],
                     snap["fallback_reasons"])
        disable()
