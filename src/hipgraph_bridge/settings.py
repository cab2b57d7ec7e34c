"""Process-wide switches set by ``gfxgraph.enable()``; read by capture and replay paths."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["Settings", "current", "update"]


@dataclass(frozen=True)
class Settings:
    enabled: bool = False
    debug: bool = False
    validate: bool = False  # compare high-level replays with eager and return eager on mismatch


_lock = threading.Lock()
_current = Settings()


def current() -> Settings:
    """The settings in force (an immutable snapshot; a single attribute read)."""
    return _current


def update(**changes: bool) -> Settings:
    global _current
    with _lock:
        _current = Settings(**{**_current.__dict__, **changes})
        return _current
