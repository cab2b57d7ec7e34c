"""The row analysis of a compiled graph: its FX graph run once on fake tensors under the row tracer.

The compile backend has the model's graph already; nothing of the user's
Python runs again. The graph is run on fresh fake tensors with static shapes
(no shape environment, so dynamo's guards are never touched): every symbolic
size is given its example value, and the padded one (the batch, or a
piecewise frame's token count) a value chosen so that no other size of the
inputs equals it, which keeps a coincidence of sizes from hiding where the
batch goes. The ops dispatch at the aten level exactly as a real run's
would, so the verdict is :mod:`.rows`' own.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import fx

from .._torch_compat import generated_forward, is_fake, static_fake_mode, sym_expr, sym_hint
from ..fallbacks import Reason
from ..log import logger
from .rows import RowTracer, RowVerdict

__all__ = ["trace_graph", "pick_rows"]

_CANDIDATES = (13, 11, 17, 19, 23, 29, 31, 37, 41, 43, 47, 7, 5, 3, 2)


def pick_rows(taken: set[int], lo: int, hi: int | None) -> int:
    """A row count in ``[lo, hi]`` that no other size in ``taken`` equals (a small prime, when one fits)."""
    for c in _CANDIDATES:
        if c >= max(lo, 2) and (hi is None or c <= hi) and c not in taken:
            return c
    top = hi if hi is not None else max(taken | {lo}) + 1
    for c in range(top, max(lo, 2) - 1, -1):
        if c not in taken:
            return c
    return max(lo, 2)


def _value(v: Any, subs: dict[Any, int]) -> Any:
    e = sym_expr(v)
    if e is None:
        return sym_hint(v) if isinstance(v, torch.SymInt) else v
    return int(e.xreplace(subs))


def _hints(fakes: Sequence[Any]) -> dict[Any, int]:
    subs: dict[Any, int] = {}
    for f in fakes:
        sizes = [*f.shape, *f.stride()] if isinstance(f, torch.Tensor) else [f]
        for s in sizes:
            e = sym_expr(s)
            if e is not None and e.is_Symbol and e not in subs:
                h = sym_hint(s)
                if h is not None:
                    subs[e] = h
    return subs


def trace_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], *, batched: dict[int, int],
                refs: Collection[int] = (), symbols: Collection[Any] = (), lo: int = 2,
                hi: int | None = None) -> RowVerdict:
    """What the row analysis finds in ``gm`` when the inputs ``batched`` (index -> dim) carry the rows.

    ``refs``: inputs that are parameters, buffers or static-address tensors the graph reads in place
    (writing one is writing state); every other tensor input is the call's own.
    ``symbols``: the symbolic sizes that are the padded one (empty: the batch inputs'
    sizes are static, as in a frame dynamo specialised); they take one value in ``[lo, hi]``.
    Never raises: a graph that cannot run on fake tensors is ``unproven``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [n.meta.get("example_value", ex) for n, ex in zip(placeholders, example_inputs)]
    for i, ex in enumerate(example_inputs):
        if isinstance(ex, torch.Tensor) and not isinstance(fakes[i], torch.Tensor):
            fakes[i] = ex
    subs = _hints(fakes)
    if symbols:
        taken = {v for s, v in subs.items() if s not in symbols}
        for f in fakes:
            if isinstance(f, torch.Tensor):
                taken |= {int(s) for s in f.shape if sym_expr(s) is None}
        rows = pick_rows(taken, lo, hi)
        subs.update({s: rows for s in symbols})
    try:
        mode = static_fake_mode()
        with mode:
            args: list[Any] = []
            for f in fakes:
                if isinstance(f, torch.Tensor):
                    shape = tuple(_value(s, subs) for s in f.shape)
                    stride = tuple(_value(s, subs) for s in f.stride())
                    args.append(torch.empty_strided(shape, stride, dtype=f.dtype, device=f.device))
                else:
                    args.append(_value(f, subs))
            lab = [(args[i], d) for i, d in batched.items()]
            first = next(iter(batched), None)
            count = args[first].shape[batched[first]] if first is not None else None
            own = [a for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in batched and i not in refs]
            scalars = {id(args[i]): ex.item() for i, ex in enumerate(example_inputs)
                       if isinstance(ex, torch.Tensor) and ex.dim() == 0 and not is_fake(ex) and ex.device.type == "cpu"}
            forward = generated_forward(gm)
            with torch.no_grad(), RowTracer(lab, own, rows=count, scalars=scalars) as tracer:
                out = forward(*args)
        return tracer.verdict(out)
    except Exception as exc:
        logger.debug("gfxgraph: the row analysis could not run a graph on fake tensors: %s: %s",
                     type(exc).__name__, exc)
        return RowVerdict(Reason.UNPROVEN, f"the row analysis could not run the graph on fake tensors "
                          f"({type(exc).__name__}: {exc})", ())
