"""Process-wide counters: captures, replays, fallbacks, validation.

Replays are the hot path. Each graph owns a :class:`ReplayCounter` whose
``tick`` is one atomic C call per replay (no lock, no attribute write);
:func:`snapshot` sums the live counters it tracks plus the counts of graphs
already released. Latency is sampled: graphs time one replay in
``REPLAY_SAMPLE_EVERY`` and record it into a per-thread recorder (no lock),
which the percentiles are computed from. Rare events (captures, fallbacks,
validation results) take a lock. :func:`reset` starts a new generation; a
thread notices on its next sample and starts a new recorder, so no sample is
lost or double-counted across a reset.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Any

from .fallbacks import Fallback
from .log import fallback_logger, forget_logged, log_once

__all__ = [
    "REPLAY_SAMPLE_EVERY",
    "ReplayCounter",
    "track_replays",
    "retire_replays",
    "record_replay_ns",
    "record_capture",
    "record_capture_failure",
    "record_fallback",
    "record_validation",
    "set_enabled_at",
    "snapshot",
    "reset",
]

_RING = 4096  # replay latency samples kept per thread for percentiles (power of two)
_MASK = _RING - 1
REPLAY_SAMPLE_EVERY = 16  # power of two: graphs time one replay in this many


class ReplayCounter:
    """The replays of one graph, exact under concurrent replays, without a lock.

    ``tick()`` is the hot path: ``next()`` of an ``itertools.count``, one atomic
    C call under the GIL. Reading never parses or races: ``next()`` hands out
    each number once, to a replay or to a read, so the replays so far are the
    number a read draws minus the reads before it. Reads are serialised by
    :func:`snapshot`'s lock.
    """

    __slots__ = ("tick", "_numbers", "_reads", "_base", "__weakref__")

    def __init__(self) -> None:
        self._numbers = itertools.count()
        self.tick = self._numbers.__next__
        self._reads = 0
        self._base = 0  # replays before the last zero()

    def _total(self) -> int:
        n = next(self._numbers) - self._reads
        self._reads += 1
        return n

    def value(self) -> int:
        """Replays since creation or the last :meth:`zero`."""
        return self._total() - self._base

    def zero(self) -> None:
        self._base = self._total()


class _ReplayRecorder:
    __slots__ = ("count", "total_ns", "ring", "gen")

    def __init__(self, gen: object) -> None:
        self.count = 0
        self.total_ns = 0
        self.ring = [0] * _RING
        self.gen = gen


class _Registry:
    def __init__(self) -> None:
        # reentrant: a finaliser that records (a graph released by the collector) may run while it is held
        self.lock = threading.RLock()
        self.gen = object()
        self.recorders: list[_ReplayRecorder] = []
        self.enabled_at: float | None = None
        self.counted: weakref.WeakSet[ReplayCounter] = weakref.WeakSet()
        self.retired_replays = 0
        self.clear_events()

    def clear_events(self) -> None:
        self.capture_count = 0
        self.capture_failures = 0
        self.capture_seconds = 0.0
        self.fallback_reasons: dict[str, int] = {}
        self.validation_checks = 0
        self.validation_failures = 0


_reg = _Registry()
_local = threading.local()


def _new_recorder() -> _ReplayRecorder:
    with _reg.lock:
        rec = _ReplayRecorder(_reg.gen)
        _reg.recorders.append(rec)
    _local.rec = rec
    return rec


def track_replays(counter: ReplayCounter) -> None:
    """Include ``counter`` in the replay counts (held weakly)."""
    with _reg.lock:
        _reg.counted.add(counter)


def retire_replays(counter: ReplayCounter) -> None:
    """Fold ``counter`` into the totals and zero it, before its graph is released or reset."""
    with _reg.lock:
        if counter in _reg.counted:
            _reg.retired_replays += counter.value()
            _reg.counted.discard(counter)
        counter.zero()


def record_replay_ns(ns: int) -> None:
    """Record one sampled replay's host time. Hot path: no lock, no allocation."""
    try:
        rec = _local.rec
    except AttributeError:
        rec = _new_recorder()
    if rec.gen is not _reg.gen:
        rec = _new_recorder()
    c = rec.count
    rec.ring[c & _MASK] = ns
    rec.count = c + 1
    rec.total_ns += ns


def record_capture(seconds: float) -> None:
    with _reg.lock:
        _reg.capture_count += 1
        _reg.capture_seconds += seconds


def record_capture_failure() -> None:
    with _reg.lock:
        _reg.capture_failures += 1


def record_fallback(fallback: Fallback) -> None:
    """Count one fallback under ``fallback.reason``; log it once per (reason, detail).

    An eager fallback, or a refusal to pad (the work then runs in exact-size
    graphs or unpadded). The notice goes to the ``gfxgraph.fallback`` logger at
    ``fallback.level``: with logging unconfigured a WARNING reaches stderr
    through ``logging.lastResort``.
    """
    if not isinstance(fallback, Fallback):
        raise TypeError(f"record_fallback: expected a Fallback(reason, detail), got {type(fallback).__name__}")
    reason = fallback.reason.value
    with _reg.lock:
        _reg.fallback_reasons[reason] = _reg.fallback_reasons.get(reason, 0) + 1
    detail = fallback.detail
    log_once(
        ("fallback", reason, detail),
        fallback.level,
        "gfxgraph: not padding (reason: %s)%s" if fallback.reason.refuses_padding
        else "gfxgraph: running eagerly (reason: %s)%s",
        reason,
        f": {detail}" if detail else "",
        target=fallback_logger,
    )


def record_validation(ok: bool) -> None:
    with _reg.lock:
        _reg.validation_checks += 1
        if not ok:
            _reg.validation_failures += 1


def set_enabled_at(ts: float | None) -> None:
    with _reg.lock:
        _reg.enabled_at = ts


def _percentile(sorted_vals: list[int], q: float) -> float:
    # nearest-rank on the sorted window; returns microseconds
    idx = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return sorted_vals[idx] / 1000.0


def snapshot() -> dict[str, Any]:
    """A consistent copy of every counter (see ``gfxgraph.stats`` for the keys)."""
    with _reg.lock:
        recs = list(_reg.recorders)
        replays = _reg.retired_replays + sum(c.value() for c in list(_reg.counted))
        out: dict[str, Any] = {
            "enabled_at": _reg.enabled_at,
            "capture_count": _reg.capture_count,
            "capture_failures": _reg.capture_failures,
            "capture_seconds": _reg.capture_seconds,
            "fallback_count": sum(_reg.fallback_reasons.values()),
            "fallback_reasons": dict(_reg.fallback_reasons),
            "validation_checks": _reg.validation_checks,
            "validation_failures": _reg.validation_failures,
        }
    samples = 0
    total_ns = 0
    window: list[int] = []
    for rec in recs:
        c = rec.count  # read once: the owner may be writing
        samples += c
        total_ns += rec.total_ns
        window.extend(rec.ring[: min(c, _RING)])
    window.sort()
    out["replay_count"] = replays
    out["replay_samples"] = samples
    out["avg_replay_us"] = (total_ns / samples / 1000.0) if samples else 0.0
    if window:
        out["replay_us_p50"] = _percentile(window, 0.50)
        out["replay_us_p90"] = _percentile(window, 0.90)
        out["replay_us_p99"] = _percentile(window, 0.99)
    else:
        out["replay_us_p50"] = out["replay_us_p90"] = out["replay_us_p99"] = 0.0
    out["snapshot_time"] = time.time()
    return out


def reset() -> None:
    """Zero every counter; each fallback cause will be logged again."""
    with _reg.lock:
        _reg.gen = object()
        _reg.recorders = []
        _reg.retired_replays = 0
        for counter in list(_reg.counted):
            counter.zero()
        _reg.clear_events()
    forget_logged()
