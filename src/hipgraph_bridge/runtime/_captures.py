"""The captures this process has live, by stream: what the runtime layer must not disturb.

Capture objects register here while they capture. Three things read it: a
new capture refuses a stream that is already capturing (before the runtime
would invalidate the outer capture); the release path defers destroying
runtime handles while any capture is live (in global capture mode such calls
invalidate it); and the failure path skips its stream sync and RNG re-arm
while another capture is live. Entries are weak, so an owner dropped mid-capture is still
finalised (and its finaliser ends the capture).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["register_capture", "unregister_capture", "capture_owner", "captures_live"]

_lock = threading.RLock()  # reentrant: a graph's finaliser unregisters, and may run while it is held
_live: dict[int, weakref.ref[Any]] = {}  # raw stream handle -> capturing object


def register_capture(stream: int, owner: object) -> None:
    with _lock:
        _live[stream] = weakref.ref(owner)


def unregister_capture(stream: int, owner: object) -> None:
    """Forget ``owner``'s capture on ``stream`` (a no-op when another owner holds it)."""
    with _lock:
        ref = _live.get(stream)
        if ref is not None and ref() in (owner, None):
            del _live[stream]


def capture_owner(stream: int) -> Any:
    """The object capturing on the raw ``stream`` handle, if any."""
    with _lock:
        ref = _live.get(stream)
    return None if ref is None else ref()


def captures_live(excluding: object = None) -> bool:
    """Whether any registered capture other than ``excluding``'s is live."""
    with _lock:
        owners = [ref() for ref in _live.values()]
    return any(o is not None and o is not excluding for o in owners)
