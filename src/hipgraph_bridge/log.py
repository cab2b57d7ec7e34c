"""The ``gfxgraph`` logger and log-once bookkeeping.

The library adds no handler beyond :class:`logging.NullHandler` (Python's
convention for libraries); the CLI configures output. ``HGB_LOG_LEVEL`` sets
the logger's level.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

from .config import read_log_level

__all__ = ["logger", "log_once", "forget_logged", "apply_env_level"]

logger = logging.getLogger("gfxgraph")
logger.addHandler(logging.NullHandler())

_seen: set[Hashable] = set()
_seen_lock = threading.Lock()


def apply_env_level() -> None:
    """Set the logger's level from ``HGB_LOG_LEVEL`` when it is set and valid."""
    level = read_log_level()
    if level is not None:
        logger.setLevel(level)


def log_once(key: Hashable, level: int, msg: str, *args: object) -> bool:
    """Log ``msg`` the first time ``key`` is seen in this process; return whether it logged.

    Fallbacks call this with the cause as key, so each cause is logged once
    while every occurrence is still counted in the stats.
    """
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.log(level, msg, *args)
    return True


def forget_logged() -> None:
    """Let every cause be logged again (used by ``reset_stats``)."""
    with _seen_lock:
        _seen.clear()
