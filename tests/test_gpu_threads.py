"""The library's own captures never break CUDA work in other threads (thread-local capture mode).

Random numbers in the other threads come from generators of their own: while
any capture runs, PyTorch 2.11 keeps the *default* CUDA generator in capture
mode for every thread, so an eager ``torch.randn`` on it fails there ("Offset
increment outside graph capture"), gfxgraph's captures or PyTorch's alike
(see the README's known limitations).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import torch._dynamo  # before register(): it registers only with dynamo loaded

import gfxgraph
from gfxgraph import ShapeBucketPool
from hipgraph_bridge.compile import register

register()  # also when the tests run from a checkout that is not installed (no entry points)

pytestmark = pytest.mark.gpu

CALLS = 200


def _run_threads(workers: list[Callable[[], None]]) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(len(workers))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            start.wait()
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - the test reports every thread's failure
                errors.append(exc)
        return body

    threads = [threading.Thread(target=wrap(w)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def _pool_worker(seed: int, mismatches: list[str]) -> Callable[[], None]:
    torch.manual_seed(seed)
    lin = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).cuda().eval()
    pool = ShapeBucketPool(lin, [1, 2, 4, 8, 16, 32, 64], progress=False)

    def work() -> None:
        stream = torch.cuda.Stream()
        gen = torch.Generator(device="cuda").manual_seed(seed)
        with torch.cuda.stream(stream), torch.no_grad():
            for i in range(CALLS):
                n = 1 + (i * 7 + seed) % 64  # new buckets get captured all through the run
                x = torch.randn(n, 32, device="cuda", generator=gen)
                if not torch.allclose(pool(x), lin(x), rtol=1e-4, atol=1e-5):
                    mismatches.append(f"pool {seed} batch {n}")
        stream.synchronize()

    return work


def _eager_worker(mismatches: list[str]) -> Callable[[], None]:
    def work() -> None:
        stream = torch.cuda.Stream()
        gen = torch.Generator(device="cuda").manual_seed(99)
        with torch.cuda.stream(stream):
            for i in range(CALLS):
                a = torch.randn(256 + i % 7, 256, device="cuda", generator=gen)  # fresh allocations at times
                b = (a @ a.T).relu()
                if i % 20 == 0:
                    stream.synchronize()  # host waits on this thread's own stream
                    if not torch.isfinite(b).all():
                        mismatches.append(f"eager iteration {i}")
        stream.synchronize()

    return work


def test_two_pools_capturing_and_eager_work_in_three_threads():
    mismatches: list[str] = []
    errors = _run_threads([_pool_worker(1, mismatches), _pool_worker(2, mismatches), _eager_worker(mismatches)])
    assert errors == [], [f"{type(e).__name__}: {e}" for e in errors]
    assert mismatches == []
    assert gfxgraph.stats()["capture_failures"] == 0


def test_the_compile_backend_from_two_threads():
    torch._dynamo.reset()
    models, compiled = [], []
    for seed in (3, 4):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).cuda().eval()
        models.append(m)
        c = torch.compile(m, backend="gfxgraph", options={"buckets": [2, 4, 8, 16, 32]})
        with torch.no_grad():  # compile in this thread (dynamo's compile is not what is under test)
            c(torch.randn(3, 16, device="cuda"))
            c(torch.randn(5, 16, device="cuda"))
        compiled.append(c)
    mismatches: list[str] = []

    def worker(k: int) -> Callable[[], None]:
        def work() -> None:
            stream = torch.cuda.Stream()
            gen = torch.Generator(device="cuda").manual_seed(k)
            with torch.cuda.stream(stream), torch.no_grad():
                for i in range(CALLS // 2):
                    n = 2 + (i * 5 + k) % 31
                    x = torch.randn(n, 16, device="cuda", generator=gen)
                    if not torch.allclose(compiled[k](x), models[k](x), rtol=1e-3, atol=1e-4):
                        mismatches.append(f"model {k} batch {n}")
            stream.synchronize()
        return work

    errors = _run_threads([worker(0), worker(1), _eager_worker(mismatches)])
    assert errors == [], [f"{type(e).__name__}: {e}" for e in errors]
    assert mismatches == []
