"""The parts of the capture primitive that need no GPU: the frozen collector, warm-up bookkeeping."""

from __future__ import annotations

import gc
import threading

from hipgraph_bridge.graph.capture import frozen_gc


def test_frozen_gc_restores_the_collector():
    assert gc.isenabled()
    with frozen_gc():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_nested_and_concurrent_uses_share_one_freeze():
    inner_done, release = threading.Event(), threading.Event()

    def other_thread():
        with frozen_gc():
            inner_done.set()
            release.wait(5)

    with frozen_gc():
        t = threading.Thread(target=other_thread)
        t.start()
        inner_done.wait(5)
        with frozen_gc():
            pass
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # the inner exit did not end the outer freeze
    assert not gc.isenabled()  # the other thread's capture is still running
    release.set()
    t.join(5)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_freeze_the_process_made_itself_stays():
    gc.freeze()  # what a server does before forking workers
    try:
        with frozen_gc():
            assert not gc.isenabled()
        assert gc.get_freeze_count() > 0 and gc.isenabled()  # not unfrozen
    finally:
        gc.unfreeze()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        with frozen_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
