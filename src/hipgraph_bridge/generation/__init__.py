"""Token generation on the device: a decode loop that runs many steps per graph launch."""

from __future__ import annotations

from .device_loop import DeviceDecodeLoop

__all__ = ["DeviceDecodeLoop"]
