"""The ``gfxgraph`` logger, where its records go, and log-once bookkeeping.

Where records go (Python's library conventions, with one addition):

* Nothing configured: the library attaches no handler by default, so records
  of level WARNING and above (the first eager fallback of each cause, a failed
  inductor compile, a discarded capture) reach stderr through Python's
  ``logging.lastResort``, as any library's warnings do. Below WARNING nothing
  prints.
* The application configured logging (``basicConfig``, or handlers on
  ``gfxgraph`` or an ancestor): records go there and nowhere else.
* The user asked for a level (``GFXGRAPH_LOG_LEVEL``/``HGB_LOG_LEVEL``, or
  ``enable(debug=True)``): the logger gets that level and one stderr handler
  (attached once). That handler prints a record only while no other handler
  would receive it, so it never duplicates the application's output, whether
  the application configured logging before or after ``import gfxgraph``.

Fallback notices go to the child logger ``gfxgraph.fallback``, so they can be
silenced alone: ``logging.getLogger("gfxgraph.fallback").setLevel(logging.ERROR)``.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Hashable
from typing import TextIO

from .config import read_log_level

__all__ = [
    "logger",
    "fallback_logger",
    "log_once",
    "forget_logged",
    "apply_env_level",
    "StderrHandler",
    "attach_stderr_handler",
    "detach_stderr_handler",
]

logger = logging.getLogger("gfxgraph")
fallback_logger = logging.getLogger("gfxgraph.fallback")

_seen: set[Hashable] = set()
_seen_lock = threading.Lock()
_handler_lock = threading.Lock()


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes gfxgraph's records to ``sys.stderr`` unless another handler receives them.

    ``sys.stderr`` is looked up for each record (as ``logging.lastResort`` does),
    so a redirected stderr is honoured. Cost per emitted record: one walk up the
    logger tree; nothing on the replay path logs.
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler.__init__ would pin today's sys.stderr
        self.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    def handle(self, record: logging.LogRecord) -> bool:
        if _other_handlers(logging.getLogger(record.name), self, record.levelno):
            return False
        return bool(super().handle(record))


def _other_handlers(start: logging.Logger, mine: logging.Handler, level: int = logging.NOTSET) -> bool:
    """Whether a record of ``level`` logged on ``start`` reaches a handler other than ``mine`` whose own
    level lets it through (a NullHandler counts)."""
    node: logging.Logger | None = start
    while node is not None:
        if any(h is not mine and level >= h.level for h in node.handlers):
            return True
        if not node.propagate:
            return False
        node = node.parent  # type: ignore[assignment]
    return False


_stderr_handler = StderrHandler()


def attach_stderr_handler() -> bool:
    """Attach the stderr handler to the ``gfxgraph`` logger; returns whether this call attached it.

    Idempotent: the handler is attached at most once however often this is called.
    """
    with _handler_lock:
        if _stderr_handler in logger.handlers:
            return False
        logger.addHandler(_stderr_handler)
        return True


def detach_stderr_handler() -> None:
    """Remove the stderr handler again (what :func:`attach_stderr_handler` did). Idempotent."""
    with _handler_lock:
        logger.removeHandler(_stderr_handler)


def apply_env_level() -> int | None:
    """Apply ``GFXGRAPH_LOG_LEVEL`` (or ``HGB_LOG_LEVEL``): set the logger's level, print to stderr.

    Returns the level applied, None when neither variable is set (or the value is bad:
    a warning names it and the logger is left as it is).
    """
    level = read_log_level()
    if level is not None:
        logger.setLevel(level)
        attach_stderr_handler()
    return level


def log_once(key: Hashable, level: int, msg: str, *args: object,
             target: logging.Logger = logger) -> bool:
    """Log ``msg`` on ``target`` the first time ``key`` is seen in this process; return whether it logged.

    Fallbacks call this with the cause as key, so each cause is logged once
    while every occurrence is still counted in the stats.
    """
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
    target.log(level, msg, *args)
    return True


def forget_logged() -> None:
    """Let every cause be logged again (used by ``reset_stats``)."""
    with _seen_lock:
        _seen.clear()
