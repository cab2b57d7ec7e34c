"""Zero-copy calls of a pool: write the inputs into the graph's own buffers, read its outputs in place.

Serving stacks let the model runner write each step's inputs straight into
the captured graph's input buffers and read the outputs where the graph left
them; an ordinary pool call instead copies every argument in and clones every
output (a dispatch each, most of a small call's host time). A
:class:`StaticIO`, from :meth:`ShapeBucketPool.static_io(n) <.pool.ShapeBucketPool.static_io>`,
is that way for one batch size ``n``::

    io = pool.static_io(5)
    io.args[0].copy_(next_tokens)   # or any kernel writing into the view
    logits, nxt = io.run()          # views of the graph's outputs

Everything a call guarantees still holds (capture on first use, the padding
check, eager fallbacks with reasons, validation mode): :meth:`StaticIO.run`
is a pool call whose arguments already are the buffers. The outputs are
views valid until the pool's next call of any size. In debug mode
(``enable(debug=True)`` or ``GFXGRAPH=debug``) they are guarded: using one
after a later call raises :class:`~hipgraph_bridge.errors.StaleOutputError`,
and rebinding an input (``io.kwargs["x"] = t``, which the graph would never
see) raises ``RuntimeError``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._torch_compat import plain_torch_function, pytree
from ..errors import StaleOutputError
from ..padding.staging import StaticInputs

__all__ = ["StaticIO", "guard_outputs"]


class StaticIO:
    """The static input views of one batch size, and the call that replays on them.

    Attributes:
        batch_size: the rows a call has (the views' size in ``batch_dim``).
        args, kwargs: the call's arguments as the first call laid them out, each
            tensor a view of its static buffer. Write into them; do not rebind them.
    """

    def __init__(self, run: Callable[[StaticIO], Any], inputs: StaticInputs, batch_size: int) -> None:
        self.batch_size = batch_size
        self.inputs = inputs  # the pool's buffers this belongs to (a closed pool has new ones)
        self.leaves = inputs.views(batch_size, batch_size)
        self.args, self.kwargs = inputs.layout.rebuild(self.leaves)
        self.fast: Any = None  # the engine's FastCall once the checks are done: a later run only replays
        self._run = run

    def run(self) -> Any:
        """Replay the bucket on what the views hold; returns views of the outputs (no copies).

        Cost once the bucket is captured and checked: a lock, a stream-handle
        comparison and the replay (about one launch of host time). That call is
        a closure the pool installs over this method (:meth:`use`), so it is one
        Python frame above the replay. A ``run`` taken from the object before the
        closure existed (``step = io.run`` ahead of the first call) forwards to
        it: one frame more, not the checked call.
        """
        fast = self.__dict__.get("run")
        return fast() if fast is not None else self._run(self)

    def use(self, fast: Any) -> None:
        """Take ``fast`` (a :class:`~.engine.FastCall` of this batch size, or None) as this object's replay
        path: ``run`` becomes its zero-copy closure, which falls back to the checked call itself."""
        self.fast = fast
        me = weakref.ref(self)  # weak: the closure lives in this object's __dict__

        def checked() -> Any:
            io = me()
            if io is None:
                raise RuntimeError("StaticIO.run: the StaticIO it belongs to was dropped; keep the object, "
                                   "not only its run method")
            return io._run(io)

        closure = fast.zero_copy(self.inputs, checked) if fast is not None else None
        if closure is None:
            self.__dict__.pop("run", None)
        else:
            self.run = closure  # type: ignore[method-assign]

    def __call__(self) -> Any:
        return self.run()

    def check_intact(self) -> None:
        """Debug mode: the arguments are still the buffer views (a rebound one would be ignored)."""
        now, _ = pytree.tree_flatten((self.args, self.kwargs))
        for i, (got, want) in enumerate(zip(now, self.leaves)):
            if want is not None and (got is not want or got.data_ptr() != want.data_ptr()
                                     or got.shape != want.shape):
                raise RuntimeError(f"StaticIO(batch_size={self.batch_size}): input leaf {i} is no longer the "
                                   "static buffer's view (rebound, resized or set_()): the graph reads only the "
                                   "buffer; write into the view instead, e.g. io.args[0].copy_(x)")

    def __repr__(self) -> str:
        return f"StaticIO(batch_size={self.batch_size})"


class _GuardedView(torch.Tensor):
    """An output view that raises once a later call has overwritten its memory (debug mode)."""

    _gfx_epoch: list[int]
    _gfx_gen: int

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        source = None
        for leaf in pytree.tree_leaves((args, kwargs or {})):
            epoch = getattr(leaf, "_gfx_epoch", None)
            if epoch is None:
                continue
            if leaf._gfx_gen != epoch[0]:
                raise StaleOutputError(
                    f"{getattr(func, '__name__', func)} on a graph output view that a later pool call overwrote "
                    f"(this view came from call {leaf._gfx_gen}, the pool is at call {epoch[0]}); read or clone "
                    "outputs before the next call, or use copy_outputs=True")
            source = leaf
        with plain_torch_function():
            out = func(*args, **(kwargs or {}))
            if source is None:
                return out
            memory = source.untyped_storage().data_ptr()
            # a view of a guarded output (out[0], a slice, .view) is just as stale after the next call
            return pytree.tree_map(lambda t: _alias(t, source) if isinstance(t, torch.Tensor)
                                   and t.untyped_storage().data_ptr() == memory else t, out)


def _alias(t: torch.Tensor, source: Any) -> torch.Tensor:
    view = t.as_subclass(_GuardedView)
    view._gfx_epoch, view._gfx_gen = source._gfx_epoch, source._gfx_gen
    return view


def guard_outputs(out: Any, epoch: list[int]) -> Any:
    """``out`` with each tensor an alias that goes stale when ``epoch[0]`` moves on (debug mode)."""
    gen = epoch[0]

    def guard(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        view = t.as_subclass(_GuardedView)
        view._gfx_epoch, view._gfx_gen = epoch, gen
        return view

    return pytree.tree_map(guard, out)
