"""DeviceWhileLoop: a data-dependent while loop captured into one graph.

Workflow::

    i = torch.zeros((), dtype=torch.int64, device="cuda")
    x = torch.randn(1024, device="cuda")

    def body(i, x):             # in place: returns None (or returns new values)
        x.mul_(0.5).add_(1.0)
        i.add_(1)

    loop = DeviceWhileLoop(LoopCondition(0, "<", 64), body, (i, x), max_iters=1000)
    i_out, x_out = loop.run(i0, x0)   # copies the state in, loops on the device, returns the state
    loop.iterations                   # device int32 tensor: body iterations of the last run (no sync)

1. ``state`` is the loop-carried tuple of tensors; it is cloned into static
   buffers, which the graph reads and writes.
2. ``body_fn(*state)`` runs one iteration: in place (returning None, no extra
   kernels) or returning new values of the same layout (copied into the state,
   one copy per tensor).
3. The condition is either a :class:`LoopCondition` (a comparison of one
   state scalar with a constant, folded into the setter kernel: no extra
   kernel per iteration) or ``cond_fn(*state)`` returning a one-element
   tensor (non-zero: go on), whose kernels run once per iteration.
4. ``max_iters`` caps the iterations on every strategy (on the native path, unless a
   ``native_step`` replaces the step kernel: that step then owns the stop).

Strategies (:attr:`DeviceWhileLoop.strategy`), chosen by one cached probe
(:func:`~.support.conditional_support`) that reads the capability table
(:mod:`hipgraph_bridge.runtime.capabilities`, row ``conditional_while``):

* ``"native"`` (CUDA >= 12.4): a WHILE node; the setter kernel counts the
  iteration, evaluates the condition and stops at the cap, all on the device.
  A run is one graph launch and no host sync.
* ``"host"`` (HIP, which has no conditional nodes up to ROCm 7.2: ROCm/hip#3905;
  forcible on CUDA): the body and the condition captured as one step graph;
  the host replays it and reads the condition (one sync per iteration).
* ``"eager"``: no GPU graphs (CPU-only PyTorch) or a failed capture.

Captures go through one :class:`~hipgraph_bridge.graph.capturer.Capturer`
(its side stream, pool, warm-up runs and failure path); the warm-ups run the
body on the real state, which is put back afterwards.

What it will not do: nest loops on the native path, run random-number ops in
the body (see :mod:`.native_nodes`), or loop without a cap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .. import stats
from ..checks import check_int
from ..fallbacks import Fallback, Reason
from ..graph.capturer import Captured, Capturer
from ..log import logger
from ..tree import describe
from .kernels import COMPARE_OPS, dtype_kind
from .native_nodes import BodyPool, NativeConditional, on_stream, side_stream
from .support import choose_strategy

__all__ = ["DeviceWhileLoop", "LoopCondition", "LoopStrategy", "LOOP_STRATEGIES", "resolve_loop_strategy"]

LoopStrategy = Literal["auto", "native", "host"]
LOOP_STRATEGIES: tuple[str, ...] = ("auto", "native", "host")
_OPS = ("<", "<=", ">", ">=", "==", "!=", "nonzero")
_KERNEL_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32,
                  torch.float64)
_TORCH_OPS: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne,
}


@dataclass(frozen=True)
class LoopCondition:
    """Go on while ``state[index] <op> value`` (``op="nonzero"``: while it is non-zero).

    ``state[index]`` must be a one-element tensor of dtype bool, uint8,
    int8/16/32/64, float32 or float64; integer and bool states compare with
    an integer ``value``.
    """

    index: int
    op: str = "<"
    value: int | float = 0

    def __post_init__(self) -> None:
        check_int("LoopCondition.index", self.index)
        if self.op not in _OPS:
            raise ValueError(f"LoopCondition.op: expected one of {', '.join(_OPS)}, got {self.op!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise TypeError(f"LoopCondition.value: expected an int or float, got {type(self.value).__name__}")

    def evaluate(self, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """The condition as a bool tensor, with PyTorch ops (host and eager strategies)."""
        t = state[self.index]
        if self.op == "nonzero":
            return t != 0
        return _TORCH_OPS[self.op](t, self.value)


def resolve_loop_strategy(requested: str) -> tuple[str, str]:
    """The loop strategy and why.

    Raises:
        ValueError: an unknown strategy.
        RuntimeError: ``"native"`` forced where WHILE nodes are unsupported.
    """
    return choose_strategy(requested, LOOP_STRATEGIES, native_supported=lambda s: s.while_loop,
                           nodes="WHILE nodes", supported_nodes="WHILE nodes", fallback="host",
                           fallback_what="the host-driven loop")


class DeviceWhileLoop:
    """A while loop over tensors, captured once and replayed; see the module docstring.

    Args:
        cond: a :class:`LoopCondition` or ``cond_fn(*state)`` returning a one-element tensor.
        body_fn: ``body_fn(*state)``: in place (returns None) or returns the new state.
        state: a tensor or a tuple/list of tensors on one device (cloned).
        max_iters: the iteration cap (>= 0); the loop stops there even if the condition holds.
        strategy: ``"auto"``, ``"native"`` or ``"host"``.
        copy_outputs: :meth:`run` returns copies of the state (default) or the static buffers.
        warmup_iters: eager body runs before capture (on scratch copies; the state is restored).
        native_step: on the native path, ``native_step(native, handle, first)`` captures the
            WHILE step in place of the condition's (``first``: before the loop, else at the end
            of each body); it must set ``handle`` (e.g. ``native.launch_set_if``) and stop the
            loop itself: ``max_iters`` and :attr:`iterations` are then not kept there.
    """

    def __init__(self, cond: LoopCondition | Callable[..., torch.Tensor], body_fn: Callable[..., Any],
                 state: torch.Tensor | Sequence[torch.Tensor], *, max_iters: int = 10_000,
                 strategy: LoopStrategy = "auto", copy_outputs: bool = True, warmup_iters: int = 1,
                 native_step: Callable[[NativeConditional, int, bool], None] | None = None) -> None:
        if not isinstance(cond, LoopCondition) and not callable(cond):
            raise TypeError(f"cond: expected a LoopCondition or a callable, got {type(cond).__name__}")
        if not callable(body_fn):
            raise TypeError(f"body_fn: expected a callable, got {type(body_fn).__name__}")
        if isinstance(max_iters, bool) or not isinstance(max_iters, int) or not 0 <= max_iters < 2**31:
            raise ValueError(f"max_iters: expected an int in [0, 2**31), got {max_iters!r}")
        if strategy not in LOOP_STRATEGIES:
            raise ValueError(f"strategy: expected one of {', '.join(LOOP_STRATEGIES)}, got {strategy!r}")
        check_int("warmup_iters", warmup_iters)
        tensors = _as_state("state", state)
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"state: expected tensors on one device, got {sorted(map(str, devices))}")
        if isinstance(cond, LoopCondition):
            _check_condition(cond, tensors)
        self.cond = cond
        self.body_fn = body_fn
        self.max_iters = max_iters
        self.requested_strategy: str = strategy
        self.copy_outputs = bool(copy_outputs)
        self.warmup_iters = warmup_iters
        self._native_step = native_step
        self._device = next(iter(devices))
        with torch.no_grad():
            self._state = tuple(t.detach().clone() for t in tensors)
        self._counter = torch.zeros((), dtype=torch.int32, device=self._device)
        self._strategy = "pending"
        self._strategy_reason = ""
        self._capturer = Capturer(warmup_iters=warmup_iters)
        self._graph: Any = None
        self._pool: BodyPool | None = None  # the native bodies' allocations (kept as long as the graph)
        self._body_stream: torch.cuda.Stream | None = None  # native bodies; distinct from the capturer's
        self._flag: torch.Tensor | None = None
        self._fallback: Fallback | None = None  # why it runs eagerly
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ state
    @property
    def strategy(self) -> str:
        """``native``, ``host``, ``eager``, or ``pending`` before the first capture."""
        return self._strategy

    @property
    def strategy_reason(self) -> str:
        return self._strategy_reason

    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        """The static state buffers (write into them and call ``run()`` to skip the copy)."""
        return self._state

    @property
    def iterations(self) -> torch.Tensor:
        """Body iterations of the last run: a 0-dim int32 tensor on the state's device (no sync)."""
        return self._counter

    # ---------------------------------------------------------------- capture
    def capture(self) -> None:
        """Capture the loop now (otherwise the first :meth:`run` does). Idempotent."""
        with self._lock:
            if self._strategy != "pending":
                return
            strategy, why = resolve_loop_strategy(self.requested_strategy)
            self._strategy, self._strategy_reason = strategy, why
            if strategy == "eager":
                self._fallback = Fallback(Reason.NO_GPU, why)
                return
            if self._device.type != "cuda":
                raise ValueError(f"state: expected CUDA tensors for a captured loop, got {self._device}")
            with torch.cuda.device(self._device):
                self._capture_as(strategy)
            logger.debug("gfxgraph: DeviceWhileLoop strategy %s (%s)", self._strategy, self._strategy_reason)

    def _capture_as(self, strategy: str) -> None:
        """Warm up and capture the loop for ``strategy`` (``native`` or ``host``); a failure makes it eager."""
        with torch.no_grad():
            saved = tuple(t.clone() for t in self._state)
        try:
            try:
                captured = self._capture_native() if strategy == "native" else self._capture_host()
            except Exception as exc:  # setting the native loop up failed before any capture
                detail = f"DeviceWhileLoop: {type(exc).__name__}: {exc}"
                captured = Captured(fallback=Fallback(Reason.CAPTURE_FAILED, detail), stage="setup", error=exc)
        finally:  # the warm-ups ran the body on the real state: put the caller's values back
            with torch.no_grad():
                for t, v in zip(self._state, saved):
                    t.copy_(v)
        if captured.graph is not None:
            self._graph = captured.graph
            return
        self._strategy = "eager"
        self._strategy_reason = f"{strategy} {_failure(captured)}"
        self._fallback = captured.fallback
        if captured.stage in ("warm_up", "setup"):  # the capturer logs the other failures itself
            logger.warning("gfxgraph: DeviceWhileLoop runs eagerly from now on: %s", self._strategy_reason)

    def _warm_runs(self, body_stream: torch.cuda.Stream | None = None) -> list[Callable[[], Any]]:
        """The capture's warm-ups: the step on the capture stream (and on ``body_stream``, where
        native bodies are captured: per-stream state such as cuBLAS workspaces is set up outside it)."""
        def step() -> None:
            self._cond_tensor()
            self._apply_body()

        runs: list[Callable[[], Any]] = [step] * self.warmup_iters
        if body_stream is not None:
            runs += [on_stream(step, body_stream)] * self.warmup_iters
        return runs

    def _capture_native(self) -> Captured:
        if self._body_stream is None:
            self._body_stream = side_stream(self._device.index, avoid=[self._capturer.stream])
        body_stream = self._body_stream
        # Kept local: the bodies' allocations go to a pool of their own (a body is its own capture
        # sequence, outside the capturer's pool); it lives as long as the graph.
        pool = BodyPool(self._device.index)
        native = NativeConditional(device=self._device.index, body_stream=body_stream, pool=pool)
        cond = self.cond

        def step(handle: int, first: bool) -> None:
            if self._native_step is not None:
                self._native_step(native, handle, first)
                return
            if isinstance(cond, LoopCondition):
                value = self._state[cond.index]
                op = COMPARE_OPS[cond.op]
                rhs_i, rhs_f = _rhs(cond.value)
            else:
                value = self._cond_tensor()
                op, rhs_i, rhs_f = COMPARE_OPS["nonzero"], 0, 0.0
                if value.dtype not in _KERNEL_DTYPES:  # e.g. float16: one more kernel, read as bool
                    value = value != 0
            native.launch_loop_step(handle, value, kind=dtype_kind(value.dtype), op=op, rhs_i=rhs_i,
                                    rhs_f=rhs_f, counter=self._counter, max_iters=self.max_iters, first=first)

        captured = self._capturer.capture(lambda: native.while_loop(step, self._apply_body), "DeviceWhileLoop",
                                          warm=self._warm_runs(body_stream))
        if captured.graph is None:
            pool.close()
        else:
            self._pool = pool
        return captured

    def _capture_host(self) -> Captured:
        flag = self._flag = torch.zeros((), dtype=torch.bool, device=self._device)

        def step() -> None:
            self._apply_body()
            flag.copy_(self._cond_tensor().reshape(()) != 0)

        return self._capturer.capture(step, "DeviceWhileLoop", warm=self._warm_runs())

    # ------------------------------------------------------------- the body
    def _cond_tensor(self) -> torch.Tensor:
        if isinstance(self.cond, LoopCondition):
            return self.cond.evaluate(self._state)
        out = self.cond(*self._state)
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise TypeError(f"cond_fn: expected a one-element tensor, got {describe(out)}")
        return out

    def _apply_body(self) -> None:
        new = self.body_fn(*self._state)
        if new is None:
            return
        values = _as_state("body_fn's result", new)
        if len(values) != len(self._state):
            raise ValueError(f"body_fn: expected None (in place) or {len(self._state)} tensors like the state, "
                             f"got {len(values)}")
        for i, (s, v) in enumerate(zip(self._state, values)):
            if v.shape != s.shape or v.dtype != s.dtype:
                raise ValueError(f"body_fn result {i}: expected {describe(s)}, got {describe(v)}")
            if v is not s:
                s.copy_(v)

    # -------------------------------------------------------------------- run
    def run(self, *initial: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copy ``initial`` (if given) into the state, run the loop, return the state.

        Native: one state copy per tensor, one graph launch, no host sync.
        Host: one graph launch and one host read per iteration.
        """
        with self._lock:
            if self._strategy == "pending":
                self.capture()
            if initial:
                if len(initial) != len(self._state):
                    raise ValueError(f"run(): expected {len(self._state)} state tensors (or none), got {len(initial)}")
                for i, (s, v) in enumerate(zip(self._state, initial)):
                    if not isinstance(v, torch.Tensor) or v.shape != s.shape or v.dtype != s.dtype \
                            or v.device != s.device:
                        raise ValueError(f"run() state {i}: expected {describe(s)}, got {describe(v)}")
                    if v is not s:
                        s.copy_(v)
            if self._strategy == "native":
                self._graph.replay()
            elif self._strategy == "host":
                self._run_host()
            else:
                self._run_eager()
            if self.copy_outputs:
                return tuple(t.clone() for t in self._state)
            return self._state

    def _run_host(self) -> None:
        assert self._flag is not None
        done = 0
        with torch.no_grad():
            go = bool(self._cond_tensor().reshape(()).item())
            while go and done < self.max_iters:
                self._graph.replay()
                done += 1
                go = bool(self._flag.item())
        self._counter.fill_(done)

    def _run_eager(self) -> None:
        stats.record_fallback(self._fallback or Fallback(Reason.EAGER))
        done = 0
        with torch.no_grad():
            go = bool(self._cond_tensor().reshape(()).item())
            while go and done < self.max_iters:
                self._apply_body()
                done += 1
                go = bool(self._cond_tensor().reshape(()).item())
        self._counter.fill_(done)

    def close(self) -> None:
        """Release the graph (idempotent); the loop re-captures on its next run."""
        with self._lock:
            if self._graph is not None:
                try:  # stream syncs: a device-wide one would break other threads' captures
                    torch.cuda.current_stream(self._device).synchronize()
                    self._capturer.stream.synchronize()
                    if self._body_stream is not None:
                        self._body_stream.synchronize()
                    self._graph.reset()
                except Exception as exc:
                    logger.debug("gfxgraph: releasing a loop graph failed: %s", exc)
                # Every graph of the capturer's pool is now released, and PyTorch's allocator takes no
                # further capture into such a pool: the next capture gets a fresh capturer (and pool).
                self._capturer = Capturer(warmup_iters=self.warmup_iters)
                self._body_stream = None
            self._graph = None
            if self._pool is not None:
                self._pool.close()
                self._pool = None
            if self._strategy in ("native", "host"):
                self._strategy = "pending"

    def __repr__(self) -> str:
        return (f"DeviceWhileLoop(strategy={self._strategy}, state={len(self._state)} tensors, "
                f"max_iters={self.max_iters})")


def _as_state(name: str, value: Any) -> tuple[torch.Tensor, ...]:
    items = (value,) if isinstance(value, torch.Tensor) else value
    if not isinstance(items, (tuple, list)) or not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError(f"{name}: expected a tensor or a non-empty tuple/list of tensors, got {describe(value)}")
    return tuple(items)


def _check_condition(cond: LoopCondition, state: tuple[torch.Tensor, ...]) -> None:
    if cond.index >= len(state):
        raise ValueError(f"LoopCondition.index {cond.index}: expected < {len(state)} (the state has "
                         f"{len(state)} tensors)")
    t = state[cond.index]
    if t.numel() != 1:
        raise ValueError(f"LoopCondition: state[{cond.index}] must hold one element, got shape {tuple(t.shape)}")
    kind = dtype_kind(t.dtype)
    if kind < 5 and cond.op != "nonzero" and not float(cond.value).is_integer():
        raise TypeError(f"LoopCondition.value: state[{cond.index}] is {t.dtype}; expected an integer value, "
                        f"got {cond.value!r}")


def _failure(captured: Captured) -> str:
    """What went wrong in a failed capture, for :attr:`DeviceWhileLoop.strategy_reason`."""
    err = captured.error
    if err is None:  # refused (the VRAM cap)
        return f"capture refused: {captured.fallback}"
    stage = "warm-up" if captured.stage == "warm_up" else "capture"
    return f"{stage} failed: {type(err).__name__}: {err}"


def _rhs(value: int | float) -> tuple[int, float]:
    return int(value), float(value)
