"""The parts of the capture primitive that need no GPU: the frozen collector, warm-up bookkeeping."""

from __future__ import annotations

import gc
import threading

from hipgraph_bridge.graph.capture import frozen_gc


def test_frozen_gc_restores_the_collector():
    gc.unfreeze()  # some interpreters start with frozen objects
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


def test_objects_made_before_are_out_of_reach_of_an_explicit_collection():
    freed = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            freed.append(1)  # a finaliser that would touch CUDA under a real capture

    gc.disable()
    try:
        Cycle()
        with frozen_gc():
            gc.collect()  # what a library's own collection inside the region does
            assert not freed
        gc.collect()
        assert freed == [1]
    finally:
        gc.enable()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    try:
        with frozen_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
