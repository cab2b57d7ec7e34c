"""Ordering a pool's calls across streams: they share static buffers and one memory pool."""

from __future__ import annotations

import torch

from .._torch_compat import current_raw_stream, raw_stream_of

__all__ = ["CallOrder"]


class CallOrder:
    """Makes each call's stream wait for the previous call's, when the two differ."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None  # stream of the previous call
        # its handle: comparing handles is much cheaper than Stream objects. None until a first call
        # (the default stream's handle is 0, so 0 cannot mean "no call yet"). Public so that a hot
        # path can compare it with the current handle inline and call after_previous() only on a change
        self.raw: int | None = None

    def after_previous(self, device: int | None = None) -> None:
        """Order the current stream of ``device`` (default: the current device; pass the graphs' device,
        where a replay launches) after the previous call (a handle comparison when it is the same)."""
        raw = current_raw_stream() if device is None else raw_stream_of(device) if raw_stream_of is not None else None
        if raw is not None and raw == self.raw and self._stream is not None:
            return
        stream = torch.cuda.current_stream(device)
        last = self._stream
        if last is not None and last != stream:
            stream.wait_stream(last)
        self._stream, self.raw = stream, raw

    def forget(self) -> None:
        self._stream, self.raw = None, None
