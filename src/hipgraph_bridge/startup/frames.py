"""A compiled function saved whole: dynamo's trace of its frame and the gfxgraph backend's options in one file.

A warm start through PyTorch's caches (:mod:`.cache`) skips inductor's compile,
but dynamo still traces the Python in every new process: on the startup suite's
1.2B Llama decode step that is most of a warm start (8 s of 18 s). PyTorch can
trace a whole frame ahead of its first call and save it (``aot_compile``: the
frame's bytecode, its guards, and what the backend returned); a process that
loads the file runs no dynamo at all. :func:`save_compiled` traces ``fn`` that
way through the gfxgraph backend and writes the file; :func:`load_compiled`
reads it back. What the file holds for the backend is the FX graph dynamo
traced, the backend's options and gfxgraph's row analysis of the graph (made
when saving, used by the same gfxgraph code only), not compiled kernels: at
its first call the loaded function compiles the graph with inductor, whose FX graph and
AOTAutograd caches (local, or :func:`.cache.load` on a new machine) then hit,
and captures the batch buckets as any compiled function does (warm them all
with :func:`~hipgraph_bridge.startup.warmup`).

What it asks of ``fn`` (PyTorch's rules for a saved frame):

* one frame, no graph break (``fullgraph=True``);
* the modules it runs passed as arguments, not held in a closure or a global:
  the file holds no weights, and torch refuses to save a module;
* the batch dimension is traced symbolic (the example's batched tensors are
  marked dynamic) at 2 rows or more; batch 1, which dynamo specialises, is
  traced as a second frame, as ``torch.compile`` would, and the file holds
  both; a call runs the first frame whose guards admit it. ``one_frame=True``
  traces without the 0/1 specialisation (with the risk
  :func:`~hipgraph_bridge.startup.warmup` explains), and then the second frame
  is saved only where the first one's guards still refuse batch 1 (an op that
  specialises it anyway: ``scaled_dot_product_attention`` on torch 2.11);
* inference: under grad mode no tensor argument or parameter may require grad.

What it risks: the saved guards are the portable ones
(``torch.compiler.keep_portable_guards_unsafe``: tensor metadata of the
arguments and parameters, symbolic shapes, global state such as grad mode and
autocast) plus value guards on the arguments (a Python scalar, a config value
``forward`` reads, compared by value); the module arguments' ``training`` flags
are checked by gfxgraph. Checks of object identity and of globals are dropped:
a loaded function called with a model whose code differs, or that differs in a
value only an identity guard would catch, runs the code traced for the saved
one. New assumptions inductor makes while compiling (a guard on a symbolic size
other than fixing it to one number, which is refused) are not added to the
saved guards. A call whose tensors fail
the kept guards raises PyTorch's ``RuntimeError`` (its message first). The
file is a pickle (torch's own format for a saved frame is one too): load only
files you trust. Needs torch >= 2.10 (``NotImplementedError`` before).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import os
import pickle
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from .._torch_compat import (aot_compile_frame, compiled_frame_admits, compiled_frame_bytes, compiled_frame_code,
                             constant_symbols, has_aot_precompile, load_compiled_frame, make_serializable,
                             mark_static_address_type, maybe_mark_dynamic, pickle_graph, pytree, size_oblivious_tracing,
                             static_address_type, sym_expr, sym_hint, tracing_with, unpickle_graph)
from ..compile.backend import serve
from ..compile.subgraph import Analysis
from ..compile.options import BackendOptions
from ..errors import ConfigError
from ..log import logger
from .cache import write_whole
from .warmup import batched_leaves, example_rows, resized

__all__ = ["save_compiled", "load_compiled", "SavedFrame", "CompiledFrame"]

_FORMAT = 2  # the layout of SavedFrame's bytes


class SavedFrame:
    """What the backend hands dynamo for a frame that is saved: the traced FX graph and the options.

    It compiles and serves the graph (:func:`~hipgraph_bridge.compile.backend.serve`, as the backend
    does when dynamo calls it) when it is saved, and in a process that loads it at its first call,
    under a tracing context holding the graph's own fake values, so inductor's and AOTAutograd's cache
    keys are those of the process that saved it.
    """

    def __init__(self, graph: bytes, options: Mapping[str, Any], one_frame: bool,
                 analysis: Analysis | None = None, statics: Mapping[int, Any] | None = None) -> None:
        self._graph = graph
        self._options = dict(options)
        self._one_frame = one_frame  # traced without the 0/1 specialisation: compiled so too
        self._analysis = analysis  # the row analysis the saving process made: not made again where it applies
        # inputs dynamo marked static-address while tracing (a module's buffers), by position: marked again in
        # a process that loads the frame, so that the graph reads them in place there too
        self._statics = dict(statics or {})
        self._run: Callable[..., Any] | None = None
        self._failed: BaseException | None = None  # a compile that failed: raised again, not repeated
        self._lock = threading.Lock()

    @classmethod
    def serialize_compile_artifacts(cls, fn: SavedFrame) -> bytes:
        """What a saved frame file holds for the backend (torch's ``SerializableCallable``): the pickled
        graph, the options, the torch version that traced it, and the graph's row analysis where the
        frame was compiled before it was saved (pickled apart, with a hash of the code that made it: another
        gfxgraph reads the frame without it, whatever its classes became)."""
        return pickle.dumps({"format": _FORMAT, "torch": torch.__version__, "graph": fn._graph,
                             "options": fn._options, "one_frame": fn._one_frame, "gfxgraph": _code_version(),
                             "analysis": None if fn._analysis is None else pickle.dumps(fn._analysis),
                             "statics": fn._statics})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> SavedFrame:
        """The frame's backend part back (``RuntimeError`` if another torch saved it); uncompiled, unless
        :func:`save_compiled` is reading back the frame it has just compiled in this process."""
        state = pickle.loads(data)
        if state.get("format") != _FORMAT or state.get("torch") != torch.__version__:
            raise RuntimeError(f"gfxgraph: this compiled frame was saved by PyTorch {state.get('torch')} (format "
                               f"{state.get('format')}); this is PyTorch {torch.__version__} (format {_FORMAT}): "
                               f"save it again with gfxgraph.cache.save_compiled in this environment")
        analysis = None
        if state.get("analysis") is not None and state.get("gfxgraph") == _code_version():
            try:  # another gfxgraph may analyse differently: its analysis is not taken
                analysis = pickle.loads(state["analysis"])
            except Exception as exc:
                logger.debug("gfxgraph: a saved frame's row analysis did not read back (%s); made again", exc)
        frame = cls(state["graph"], state["options"], state["one_frame"], analysis, state.get("statics"))
        twin = (_saving.get() or {}).get(frame._key())
        if twin is not None:  # save_compiled compiled this frame just now: served by that compile
            frame._run, frame._failed = twin._run, twin._failed
        return frame

    def _key(self) -> bytes:
        return hashlib.sha256(self._graph + pickle.dumps((self._options, self._one_frame))).digest()

    def __call__(self, *args: Any) -> Any:
        run = self._run
        if run is None:
            run = self._build(args)
        return run(*args)

    def _build(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if self._run is None:
                try:
                    self._run = self._compile(args)
                except BaseException as exc:
                    self._failed = exc
                    raise
            return self._run

    def _compile(self, args: tuple[Any, ...]) -> Callable[..., Any]:
        """The graph compiled for its symbolic sizes, under the setting it was traced with."""
        for i, kind in self._statics.items():
            if isinstance(args[i], torch.Tensor) and static_address_type(args[i]) is None:
                mark_static_address_type(args[i], kind)
        gm, fake_mode = unpickle_graph(self._graph)
        opts = BackendOptions.from_mapping(self._options)
        fakes = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        # as dynamo calls a backend: its fake mode in the context, and inductor compiles for the
        # graph's symbolic sizes (dynamo's fake mode maps the real tensors to them; this one cannot)
        # and with the setting it was traced under: inductor's lowering would otherwise specialise a
        # size the trace kept symbolic (as dynamo compiles inside its trace, warmup(one_frame=True) too)
        before = constant_symbols(fake_mode)
        with tracing_with(fake_mode), (size_oblivious_tracing() if self._one_frame
                                       else contextlib.nullcontext()):
            run = serve(gm, list(args), opts, compile_inputs=fakes, analysis=self._analysis)
        fixed = {k: v for k, v in constant_symbols(fake_mode).items() if k not in before}
        if fixed:  # the saved guards admit other sizes, which the compiled code would refuse
            raise RuntimeError(f"gfxgraph: compiling the saved frame fixed its symbolic size(s) {fixed}: the "
                               f"code serves those sizes only, while its saved guards admit others; call "
                               f"it through torch.compile instead (this frame cannot be served)")
        return run


# while save_compiled reads back the file it wrote (what it returns): the frames it compiled, by graph and
# options, whose compile the frames read back take instead of compiling again (this call's, this context's)
_saving: contextvars.ContextVar[dict[bytes, SavedFrame] | None] = contextvars.ContextVar("gfxgraph_saving",
                                                                                      default=None)


@functools.cache
def _code_version() -> str:
    """A hash of the Python sources of ``hipgraph_bridge`` (where the analysis lives): an analysis made by
    other code is made again."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _saving_backend(options: Mapping[str, Any], one_frame: bool,
                    made: list[tuple[SavedFrame, list[Any]]]) -> Callable[..., SavedFrame]:
    """The backend that saves: each frame it returns is appended to ``made`` with the real inputs dynamo
    gave it (symbolic sizes as their traced values), which compile it as the frame's first call would."""
    make_serializable(SavedFrame)

    def gfxgraph_saved(gm: torch.fx.GraphModule, example_inputs: Any, **_: Any) -> SavedFrame:
        marks = {i: static_address_type(a) for i, a in enumerate(example_inputs)
                 if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter)}
        statics = {i: kind for i, kind in marks.items() if kind is not None}
        frame = SavedFrame(pickle_graph(gm), options, one_frame, statics=statics)  # pickled before anything changes it
        made.append((frame, [a if sym_expr(a) is None else sym_hint(a) for a in example_inputs]))
        return frame

    gfxgraph_saved.compiler_name = "gfxgraph"  # type: ignore[attr-defined]
    return gfxgraph_saved


def save_compiled(path: str | os.PathLike[str], fn: Callable[..., Any], *example_args: Any,
                  options: Mapping[str, Any] | None = None, batch_dim: int = 0,
                  static_args: Collection[int | str] = (), one_frame: bool = False,
                  **example_kwargs: Any) -> Callable[..., Any]:
    """Trace ``fn`` on the example with the gfxgraph backend, write its frames to ``path``, return them.

    Returns the function to call in this process (the same one :func:`load_compiled` gives in the next,
    already compiled here; there it compiles at its first call), which serves graphs. ``options``: the backend's options
    (``torch.compile(..., options=...)``), checked now; a ``process_group`` cannot be saved
    (``ConfigError``). ``batch_dim``/``static_args``: where the example's tensors carry the batch (marked
    dynamic before the trace). ``one_frame``: trace without the 0/1 specialisation so that one frame
    serves batch 1 too where the code allows (``warmup``'s ``one_frame`` explains the risk: code that
    broadcasts a batch of 1); by default, or where its guards refuse batch 1 anyway, batch 1 is traced
    as a second frame. Saving runs under the caller's grad mode and is for inference: a tensor that
    requires grad under grad mode is refused (``NotImplementedError``). Torch's own errors pass through
    (a graph break: ``fullgraph`` is required; a module held in a closure, with a hint after it: it must
    be an argument). The file is written whole or not at all. Cost: one dynamo trace and one compile
    per frame (the compile its first call would make; the file then holds the frame's row analysis).
    """
    given = dict(options or {})
    opts = BackendOptions.from_mapping(given)  # ConfigError now, not at the next process's first call
    if opts.process_group is not None:
        raise ConfigError("options['process_group']: a saved frame cannot hold a process group (it belongs to "
                          "this process); compile distributed steps with torch.compile")
    if opts.piecewise:
        raise NotImplementedError("options['piecewise']: saving a piecewise compile is not supported yet (its "
                                  "pieces are split and compiled per frame); save the whole-graph backend")
    if not isinstance(one_frame, bool):
        raise ConfigError(f"one_frame: expected a bool, got {one_frame!r}")
    if not has_aot_precompile:
        raise NotImplementedError(f"gfxgraph.cache.save_compiled needs torch >= 2.10 (aot_compile); this is "
                                  f"PyTorch {torch.__version__}: use gfxgraph.cache.save/load instead")
    static = set(static_args)
    rows = example_rows(example_args, example_kwargs, batch_dim, static)
    if torch.is_grad_enabled() and _needs_grad(example_args, example_kwargs):
        raise NotImplementedError("save_compiled saves inference steps: a tensor or parameter of the example "
                                  "requires grad under grad mode; call it under torch.no_grad() or "
                                  "torch.inference_mode(), as the step will be served")
    # copies of the example's batched tensors, marked dynamic (a mark left on the caller's tensors would fail
    # the saved guards at their next call); at 2 rows or more: a symbolic size traced at 1 gets the range [1, 2]
    wide_args, wide_kwargs = resized(example_args, example_kwargs, max(rows, 2), rows=rows, batch_dim=batch_dim,
                                     static=static, fresh=True)
    for t in batched_leaves(wide_args, wide_kwargs, batch_dim, static):
        maybe_mark_dynamic(t, batch_dim)
    made: list[tuple[SavedFrame, list[Any]]] = []
    backend = _saving_backend(given, one_frame, made)
    with _hinted("save"), size_oblivious_tracing() if one_frame else contextlib.nullcontext():
        frames = [aot_compile_frame(fn, backend, wide_args, wide_kwargs)]
    one_args, one_kwargs = resized(example_args, example_kwargs, 1, rows=rows, batch_dim=batch_dim, static=static,
                                   fresh=True)
    if not compiled_frame_admits(frames[0], one_args, one_kwargs):
        # dynamo kept its 0/1 specialisation (one_frame=False, or an op that guards on it anyway, such as
        # scaled_dot_product_attention on torch 2.11): batch 1 gets a frame of its own, as torch.compile would
        with _hinted("save"):
            frames.append(aot_compile_frame(fn, backend, one_args, one_kwargs))
    for frame, inputs in made:  # compiled now, as its first call would: the file holds the row analysis
        try:
            run = frame._build(tuple(inputs))
        except Exception as exc:  # remembered: the frame's first call raises it again
            logger.warning("gfxgraph: a frame saved to %s did not compile (%s: %s); its calls will raise this",
                           path, type(exc).__name__, exc)
            continue
        try:  # its compile's analysis, or one made now for a frame that compiles at a later call (batch 1)
            frame._analysis = run.subgraph.analyse_ahead(inputs)
        except Exception as exc:  # its compile analyses it then
            logger.warning("gfxgraph: the row analysis of a frame saved to %s failed (%s: %s); saved without it",
                           path, type(exc).__name__, exc)
    with _hinted("save"):
        saved = [compiled_frame_bytes(f) for f in frames]
    data = pickle.dumps({"gfxgraph_frames": _FORMAT, "torch": torch.__version__,
                         "modes": _module_modes(example_args, example_kwargs), "frames": saved})
    target = write_whole(path, data)
    logger.info("gfxgraph: saved %d compiled frame(s) of %s to %s (%d bytes)", len(frames),
                getattr(fn, "__qualname__", fn), target, len(data))
    # the frames read back are served by the compiles made above; `made` (dynamo keeps the backend, which holds
    # it, and it holds the model's tensors) is emptied so that nothing here outlives the returned function
    token = _saving.set({frame._key(): frame for frame, _ in made})
    try:
        return _load(data, _globals_of(fn), str(target))
    finally:
        _saving.reset(token)
        made.clear()


def load_compiled(path: str | os.PathLike[str], *, f_globals: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The function :func:`save_compiled` wrote to ``path``; no dynamo runs, now or at its calls.

    ``f_globals``: globals to add to those the file holds (torch saves the ones the traced code reads;
    none are needed for a plain step). Raises
    ``FileNotFoundError``, ``NotImplementedError`` on a torch without saved frames, and ``RuntimeError``
    for a file saved by another torch version.
    """
    return _load(Path(path).read_bytes(), f_globals, os.fspath(path))


def _load(data: bytes, f_globals: dict[str, Any] | None, path: str) -> CompiledFrame:
    try:
        state = pickle.loads(data)
    except Exception as exc:
        raise RuntimeError(f"gfxgraph: {path} is not a file gfxgraph.cache.save_compiled wrote ({exc})") from None
    if not isinstance(state, dict) or state.get("gfxgraph_frames") != _FORMAT:
        raise RuntimeError(f"gfxgraph: {path} is not a file this gfxgraph's save_compiled wrote (format "
                           f"{state.get('gfxgraph_frames') if isinstance(state, dict) else None}, expected {_FORMAT})")
    if state.get("torch") != torch.__version__:
        raise RuntimeError(f"gfxgraph: {path} was saved by PyTorch {state.get('torch')}; this is PyTorch "
                           f"{torch.__version__}: save it again with gfxgraph.cache.save_compiled in this environment")
    with _hinted("load"):
        frames = [load_compiled_frame(b, f_globals) for b in state["frames"]]
    return CompiledFrame(frames, path, state["modes"])


@contextlib.contextmanager
def _hinted(what: str) -> Iterator[None]:
    """PyTorch's refusal to save or load a frame, its message first, then what it means with gfxgraph."""
    try:
        yield
    except RuntimeError as exc:
        msg = str(exc)
        if what == "save" and "Failed to serialize" in msg:
            hint = ("a module the step reads from a closure or a global cannot be saved: pass it as an argument "
                    "(step(model, ids, pos)); gfxgraph saves no external data")
        elif what == "load" and ("ompatib" in msg or "mismatch" in msg):
            hint = ("the frame was saved in another environment (Python, CUDA, Triton or device); save it again "
                    "with gfxgraph.cache.save_compiled there")
        else:
            raise
        raise RuntimeError(f"{msg}\ngfxgraph: {hint}") from exc


def _needs_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    leaves = [*args, *kwargs.values()]
    return any(t.requires_grad for v in leaves
               for t in (v.parameters() if isinstance(v, torch.nn.Module) else
                         (x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor))))


def _module_modes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int | str, bool]:
    """The ``training`` flag of each module argument (PyTorch's saved guards do not keep it)."""
    named = [*enumerate(args), *kwargs.items()]
    return {k: v.training for k, v in named if isinstance(v, torch.nn.Module)}


class CompiledFrame:
    """Saved frames ready to call: the first whose saved guards admit the call runs its code (no dynamo)."""

    traced_ahead = True  # gfxgraph.warmup marks no tensor dynamic for it (its guards would refuse the mark)

    def __init__(self, frames: list[Any], path: str, modes: dict[int | str, bool]) -> None:
        self._frames = frames
        self._modes = list(modes.items())
        self._codes = [compiled_frame_code(f) for f in frames]
        self.path = path
        self.__name__ = f"saved frame {Path(path).name}"

    @property
    def frames(self) -> int:
        """How many frames the file holds (2 where batch 1 needed its own)."""
        return len(self._frames)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the first frame whose saved guards admit the call. Cost: PyTorch's guard check in Python
        (every tensor argument's and parameter's metadata) per frame tried, before the frame's code."""
        for where, training in self._modes:
            m = args[where] if isinstance(where, int) else kwargs.get(where)
            if isinstance(m, torch.nn.Module) and m.training != training:
                raise RuntimeError(f"gfxgraph: the frame saved in {self.path} was traced with the module "
                                   f"argument {where!r} in {'training' if training else 'eval'} mode; it is in "
                                   f"{'training' if m.training else 'eval'} mode now (call .train()/.eval(), or save "
                                   f"a frame for this mode)")
        for frame, code in zip(self._frames, self._codes):
            if compiled_frame_admits(frame, args, kwargs):
                return code(*args, **kwargs)
        try:
            return self._frames[0](*args, **kwargs)  # fails its guards again: torch's message says which
        except RuntimeError as exc:
            if "GuardManager check failed" in str(exc):  # torch's message first, then what it means here
                raise RuntimeError(f"{exc}\ngfxgraph: this call matches none of the frames saved in {self.path} "
                                   f"(a tensor's shape, dtype or device, grad mode, a value the step reads, or which "
                                   f"arguments are one tensor differs from the example's); save it again with an "
                                   f"example like such calls") from None
            raise

    def __repr__(self) -> str:
        return f"<gfxgraph CompiledFrame from {self.path}>"


def _globals_of(fn: Callable[..., Any]) -> dict[str, Any] | None:
    g = getattr(fn, "__globals__", None)
    return g if isinstance(g, dict) else None
