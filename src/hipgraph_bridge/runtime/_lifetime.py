"""One release path for every runtime handle, shared by ``close()`` and finalizers.

Rules (the reasons are what abort processes elsewhere):

* Never raise: a finalizer that raises prints noise at best, and a failing
  destroy must not mask the exception that made an object go away.
* Never call into the runtime while the interpreter is finalizing: the
  process is ending and the driver reclaims every object; the runtime may
  already be tearing down.
* Never destroy while a stream capture is live in this process (one gfxgraph
  registered, or PyTorch's current stream): in global capture mode unsafe
  calls invalidate the capture. Such releases are deferred and drained by the
  next object that is created or closed outside a capture.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch

from ..log import logger
from ._base import Runtime
from ._captures import captures_live

__all__ = ["release", "drain_deferred", "deferred_count", "capture_active", "attach_finalizer"]

_deferred: list[tuple[Runtime, str, int]] = []
_lock = threading.Lock()


def capture_active() -> bool:
    """Whether a capture this process can see is live (gfxgraph's registry or torch's stream)."""
    if captures_live():
        return True
    try:
        return bool(torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())
    except Exception:  # no CUDA, or a broken device: nothing is capturing here
        return False


def release(runtime: Runtime, kind: str, handle: int) -> None:
    """Destroy ``handle`` now, or later when a capture is live. Never raises."""
    try:
        if sys.is_finalizing():
            return
        if capture_active():
            with _lock:
                _deferred.append((runtime, kind, handle))
            return
        runtime.destroy(kind, handle)
    except BaseException as exc:  # noqa: BLE001 - a release must never propagate
        try:
            logger.debug("gfxgraph: releasing %s %#x failed: %s", kind, handle, exc)
        except BaseException:
            pass


def drain_deferred() -> int:
    """Release what was deferred during a capture; returns how many were released."""
    if not _deferred or capture_active():
        return 0
    with _lock:
        pending = list(_deferred)
        _deferred.clear()
    for runtime, kind, handle in pending:
        release(runtime, kind, handle)
    return len(pending)


def deferred_count() -> int:
    with _lock:
        return len(_deferred)


def attach_finalizer(owner: Any, runtime: Runtime, kind: str, handle: int) -> weakref.finalize:
    """Release ``handle`` when ``owner`` is collected; the finalizer holds no reference to it.

    ``atexit`` is off: at interpreter exit the process teardown frees device
    objects, and calling into a runtime that may be shutting down is the risk.
    """
    fin = weakref.finalize(owner, release, runtime, kind, handle)
    fin.atexit = False
    return fin
