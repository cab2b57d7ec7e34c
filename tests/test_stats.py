"""stats(): the seed's keys plus per-reason fallbacks and latency percentiles; thread-safe."""

from __future__ import annotations

import threading

import gfxgraph
from hipgraph_bridge import stats as core
from hipgraph_bridge.fallbacks import Fallback, Reason

SEED_KEYS = {"enabled_at", "capture_count", "replay_count", "fallback_count", "validation_failures",
             "avg_replay_us"}


def test_keys_present():
    snap = gfxgraph.stats()
    assert SEED_KEYS <= snap.keys()
    assert {"fallback_reasons", "replay_us_p50", "replay_us_p90", "replay_us_p99", "graph_pool_bytes",
            "capture_seconds", "capture_failures", "validation_checks"} <= snap.keys()


def _ticked(n: int) -> core.ReplayCounter:
    c = core.ReplayCounter()
    for _ in range(n):
        c.tick()
    return c


def test_replay_counts_from_tracked_counters_survive_release():
    a, b = _ticked(5), _ticked(7)
    core.track_replays(a)
    core.track_replays(b)
    assert gfxgraph.stats()["replay_count"] == 12
    assert gfxgraph.stats()["replay_count"] == 12  # reading does not count
    core.retire_replays(a)  # released graphs keep counting in the totals
    assert a.value() == 0
    assert gfxgraph.stats()["replay_count"] == 12
    gfxgraph.reset_stats()
    assert gfxgraph.stats()["replay_count"] == 0 and b.value() == 0
    b.tick()
    assert gfxgraph.stats()["replay_count"] == 1


def _race(work, read, *, n_threads: int = 8) -> list[int]:
    """Run ``work`` in ``n_threads`` threads while another thread keeps calling ``read``; its values."""
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append(read())

    r = threading.Thread(target=reader)
    r.start()
    ts = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    r.join()
    return seen


def test_replay_counter_is_exact_under_concurrent_ticks_and_reads():
    c = core.ReplayCounter()
    core.track_replays(c)
    per_thread = 20000

    def ticker() -> None:
        for _ in range(per_thread):
            c.tick()

    seen = _race(ticker, lambda: gfxgraph.stats()["replay_count"])
    assert gfxgraph.stats()["replay_count"] == 8 * per_thread
    assert seen == sorted(seen)


def test_replay_latency_samples_and_percentiles():
    for us in range(1, 101):
        core.record_replay_ns(us * 1000)
    snap = gfxgraph.stats()
    assert snap["replay_samples"] == 100
    assert abs(snap["avg_replay_us"] - 50.5) < 1e-9
    assert snap["replay_us_p50"] in (50.0, 51.0)
    assert snap["replay_us_p90"] in (90.0, 91.0)
    assert snap["replay_us_p99"] in (99.0, 100.0)


def test_fallbacks_counted_per_reason_and_logged_once(caplog):
    for _ in range(3):
        core.record_fallback(Fallback(Reason.VRAM_CAP, "bucket 64"))
    core.record_fallback(Fallback(Reason.CAPTURE_FAILED, "boom"))
    snap = gfxgraph.stats()
    assert snap["fallback_count"] == 4
    assert snap["fallback_reasons"] == {"vram_cap": 3, "capture_failed": 1}
    assert caplog.text.count("reason: vram_cap") == 1
    assert caplog.text.count("reason: capture_failed") == 1


def test_reset_zeroes_everything_and_relogs(caplog):
    core.record_replay_ns(5000)
    core.record_capture(0.5)
    core.record_validation(False)
    core.record_fallback(Fallback(Reason.EAGER, "y"))
    gfxgraph.reset_stats()
    snap = gfxgraph.stats()
    assert snap["replay_count"] == 0 and snap["capture_count"] == 0
    assert snap["validation_failures"] == 0 and snap["fallback_count"] == 0
    core.record_fallback(Fallback(Reason.EAGER, "y"))
    assert caplog.text.count("reason: eager") == 2
    core.record_replay_ns(7000)  # a thread's recorder from before the reset is replaced
    assert gfxgraph.stats()["replay_samples"] == 1


def test_concurrent_recording_and_snapshots_are_exact():
    per_thread = 20000

    def writer() -> None:
        for _ in range(per_thread):
            core.record_replay_ns(1000)
        core.record_fallback(Fallback(Reason.EAGER))

    seen_counts = _race(writer, lambda: gfxgraph.stats()["replay_samples"])
    snap = gfxgraph.stats()
    assert snap["replay_samples"] == 8 * per_thread
    assert snap["fallback_reasons"]["eager"] == 8
    assert seen_counts == sorted(seen_counts)  # monotone while recording


def test_validation_counters():
    core.record_validation(True)
    core.record_validation(False)
    snap = gfxgraph.stats()
    assert snap["validation_checks"] == 2 and snap["validation_failures"] == 1
