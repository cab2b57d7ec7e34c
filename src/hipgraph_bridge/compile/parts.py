"""What every part of a piecewise frame shares: the call's context, tensor layouts, the splitting ops.

Every part of one frame reads the same :class:`CallContext` (the real token
count, its bucket, the graph key); :class:`Layout` realises a tensor input's
symbolic sizes and strides for a key; a :class:`Splitter` runs a splitting op
eagerly on its inputs narrowed back to the real token count. The graphed
pieces themselves are :class:`~.pieces.Piece`.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .._torch_compat import generated_forward, sym_expr
from ..graph.capturer import Capturer
from .plan import VIEW_OPS

__all__ = ["Mode", "CallContext", "PieceEnv", "Layout", "Splitter", "token_dims", "narrow", "trivial"]


class Mode(enum.Enum):
    DIRECT = "direct"  # every part runs compiled on what it is given: no graphs, no padding
    GRAPH = "graph"  # pieces are served from graphs of the call's key


@dataclass
class CallContext:
    """What one call of a frame decided; written by the frame, read by its parts (under its lock)."""

    mode: Mode = Mode.DIRECT
    n: int = 0  # the real token count
    b: int = 0  # its bucket (== n when nothing is padded)
    padded: bool = False
    key: tuple[Any, ...] = ()  # (b, [n == b,] *exact): what selects the pieces' graphs
    exact: tuple[Any, ...] = ()  # the values of the frame's other symbols, and its constants
    values: dict[Any, int] = field(default_factory=dict)  # every symbol's value in this call (token: n)
    ran: list[Any] = field(default_factory=list)  # graph entries whose outputs this call produced
    complete: bool = False  # every piece captured this key in one earlier call: none may capture now
    stale: bool = False  # set by a piece that could not capture: the key is captured again next time
    blocked: bool = False  # set by a piece whose padded check failed: it is graphed at exact counts only now


@dataclass
class PieceEnv:
    """What a frame shares with its pieces."""

    ctx: CallContext
    capturer: Capturer | None  # None without a GPU
    token: Any  # the token symbol
    token_range: tuple[int, int | None]  # the token counts the frame's guards admit
    largest: int  # the largest token bucket (static buffers are sized for it)
    pad_value: float | int | bool | None  # what padding rows are filled with (padding.staging.Arena)
    warmup_iters: int


def _ev(e: Any, sub: dict[Any, int]) -> int:
    return e if isinstance(e, int) else int(e.xreplace(sub))


class Layout:
    """A tensor input's sizes and strides as expressions of the frame's symbols, realised per key (cached)."""

    def __init__(self, fake: torch.Tensor) -> None:
        self.sizes = tuple(sym_expr(s) if sym_expr(s) is not None else int(s) for s in fake.shape)
        self.strides = tuple(sym_expr(s) if sym_expr(s) is not None else int(s) for s in fake.stride())
        self.dtype, self.device = fake.dtype, fake.device
        free = set().union(*(e.free_symbols for e in (*self.sizes, *self.strides) if not isinstance(e, int)))
        self.symbols = tuple(sorted(free, key=str))
        self._cache: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def realize(self, values: dict[Any, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        k = tuple(values[s] for s in self.symbols)
        hit = self._cache.get(k)
        if hit is None:
            sub = dict(zip(self.symbols, k))
            hit = self._cache[k] = (tuple(_ev(e, sub) for e in self.sizes), tuple(_ev(e, sub) for e in self.strides))
        return hit

    def conform(self, t: torch.Tensor, values: dict[Any, int]) -> torch.Tensor:
        """``t`` with the strides the compiled piece expects at these sizes (copied only when they differ)."""
        shape, strides = self.realize(values)
        if all(n == 1 or a == b for n, a, b in zip(shape, t.stride(), strides)):
            return t
        out = torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device)
        out.copy_(t)
        return out


def token_dims(t: torch.Tensor, token: Any) -> tuple[tuple[int, ...], bool]:
    """(dims whose size is the token count, whether another dim's size involves it)."""
    exact, compound = [], False
    for d, s in enumerate(t.shape):
        e = sym_expr(s)
        if e is not None and token in e.free_symbols:
            if e == token:
                exact.append(d)
            else:
                compound = True
    return tuple(exact), compound


def narrow(t: Any, dims: tuple[int, ...], n: int) -> Any:
    for d in dims:
        if t.shape[d] != n:
            t = t.narrow(d, 0, n)
    return t


def trivial(gm: fx.GraphModule) -> bool:
    """Only views, ``getitem`` and size arithmetic: nothing worth a graph (or a compile)."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node.target is operator.getitem:
            continue
        if node.op == "call_method" and node.target in VIEW_OPS and node.target != "contiguous":
            continue
        if node.op == "call_function" and not isinstance(node.meta.get("example_value"), torch.Tensor):
            continue
        return False
    return True


class Splitter:
    """A splitting op's part: its inputs narrowed to the real token count, then run eagerly as traced."""

    def __init__(self, module: fx.GraphModule, env: PieceEnv) -> None:
        self.env = env
        self.fn = generated_forward(module)
        fakes = [n.meta.get("example_value") for n in module.graph.nodes if n.op == "placeholder"]
        self.narrows = [(k, token_dims(f, env.token)[0]) for k, f in enumerate(fakes)
                        if isinstance(f, torch.Tensor) and token_dims(f, env.token)[0]]
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        ctx = self.env.ctx
        self.calls += 1
        if ctx.padded:
            args_ = list(args)
            for k, dims in self.narrows:
                args_[k] = narrow(args_[k], dims, ctx.n)
            return self.fn(*args_)
        return self.fn(*args)
