"""Every private PyTorch API gfxgraph touches, and the path each torch version takes.

Nothing else in the package reads an underscore name of torch. Each accessor
below is probed once; :func:`describe` reports the path this process took
(``gfxgraph doctor --json`` and the tests print it). Supported: torch >= 2.6.

=============================  ==========================================  ======================================
what                           torch 2.6 - 2.12 (device: 2.11)             torch 2.13+ (CI: 2.13 CPU)
=============================  ==========================================  ======================================
``torch.utils._pytree``        argument and output trees (no public twin)  same
``TorchDispatchMode``          input liveness in debug/validate mode;      the row analysis (without the
                               the row analysis                            per-op dynamo wrapper, 2.12+)
replay entry point             ``torch._C._CUDAGraph.replay`` when the     the Python ``CUDAGraph.replay`` (it
                               Python wrapper only delegates               checks input liveness when asked)
``check_input_liveness``       absent: debug mode records the captured     passed to ``capture_begin``
                               inputs' storages itself
pool release after a failed    ``_cuda_endAllocateToPool`` +               same
capture                        ``_cuda_releasePool`` (CUDA/ROCm builds)
non-owning output views        ``_construct_storage_from_data_pointer``,   same
                               ``_storage_Use_Count``; absent: outputs
                               stay owned (correct, more memory)
current raw stream             ``_cuda_getCurrentRawStream`` (GPU builds)  same
a call's input copies          ``torch._foreach_copy_`` (2.1+): one        same
                               launch per dtype; absent: one copy each
parameter address check        ``_tensors_data_ptrs_at_indices_equal``     same
                               (GPU builds; else a Python loop)
region raised in               reads ``args`` of ``torch.cuda.graph``'s    same
``torch.cuda.graph``           ``__exit__`` frame (it calls capture_end
                               without the exception)
symbolic sizes                 ``SymInt.node.expr``/``hint``,              same
                               ``shape_env.bound_sympy``
debug-mode output views        ``torch._C.DisableTorchFunctionSubclass``   same
                               (a subclass's ops on plain tensors)
dynamo / inductor              ``compile_fx``, ``list_mode_options``,      same
                               ``get_static_address_type``, the backend
                               registry, ``TracingContext.fw_metadata``
collectives in an FX graph     ``torch._ops.OpOverload[Packet]`` in the    same
                               ``_c10d_functional`` (and ``c10d``) op
                               namespaces
torch ops by name              ``torch._ops.OpOverload`` and its packet    same
                               (the piecewise backend's splitting ops)
generator states and graphs    ``~CUDAGraph()`` checks its registration    per-capture RNG state: nothing
                               with each generator state (2.3 - 2.12)      to check (pytorch#176752)
op schemas                     ``OpOverload._schema``: which arguments     same
                               an op writes, and of what type each is
                               (the row analysis)
fake tensors                   ``torch._subclasses.FakeTensorMode``: the   same
                               row analysis of a compiled graph
lazy fx code                   ``_LazyGraphModule.real_recompile`` (2.3+)  same
saved compiled frames          ``aot_compile``, ``SerializableCallable``,  same
                               ``GraphPickler``, ``ShapeEnv.replacements``,
                               ``TracingContext`` (2.10+; before: refused)
=============================  ==========================================  ======================================

Function-local imports here are of ``torch._dynamo``/``torch._inductor``:
importing them costs over a second, and only compiled code needs them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.cuda.graphs
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "pytree",
    "TorchDispatchMode",
    "OriginalCUDAGraph",
    "base_replay",
    "has_check_input_liveness",
    "graph_context_exception",
    "end_allocate_to_pool",
    "weak_view_supported",
    "storage_use_count",
    "non_owning_view",
    "current_raw_stream",
    "pointers_equal",
    "sym_expr",
    "sym_hint",
    "sym_range",
    "static_address_type",
    "aot_mutated_inputs",
    "compile_fx",
    "mode_options",
    "cpp_compiler_problem",
    "inductor_config_keys",
    "op_writes",
    "op_arguments",
    "RowDispatchMode",
    "op_kind",
    "OP_PLAIN",
    "OP_COMPOSITE",
    "OP_REGION",
    "OP_HIGHER_ORDER",
    "inline_subgraph",
    "subgraph_operand_placeholder",
    "subgraph_operands",
    "size_oblivious_tracing",
    "static_fake_mode",
    "is_fake",
    "generator_states_track_graphs",
    "dynamo_registry",
    "lookup_backend",
    "is_dynamo_signal",
    "resolve_op",
    "op_packet",
    "op_name",
    "generated_forward",
    "describe",
    "raw_stream_of",
    "copy_all",
    "plain_torch_function",
    "tensor_version",
    "has_cache_artifacts",
    "save_cache_artifacts",
    "load_cache_artifacts",
    "compile_cache_counters",
    "has_aot_precompile",
    "make_serializable",
    "aot_compile_frame",
    "load_compiled_frame",
    "compiled_frame_bytes",
    "compiled_frame_admits",
    "compiled_frame_code",
    "pickle_graph",
    "unpickle_graph",
    "tracing_with",
    "constant_symbols",
    "maybe_mark_dynamic",
]

# Taken at first import, before gfxgraph.enable() can swap torch.cuda.CUDAGraph.
OriginalCUDAGraph: type = torch.cuda.graphs.CUDAGraph


# ------------------------------------------------------------------ capture / replay
def _pick_base_replay() -> Callable[[Any], None]:
    # The wrapper frame is ~150 ns of the hot path on a slow host; calling the C++
    # method is the same operation unless the wrapper does more (2.13's liveness check).
    py_replay = OriginalCUDAGraph.replay
    cpp_replay = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None)
    code = getattr(py_replay, "__code__", None)
    if cpp_replay is not None and code is not None and set(code.co_names) <= {"super", "replay"}:
        return cpp_replay
    return py_replay


base_replay = _pick_base_replay()
has_check_input_liveness = "check_input_liveness" in inspect.signature(OriginalCUDAGraph.capture_begin).parameters
_GRAPH_EXIT = getattr(torch.cuda.graphs.graph.__exit__, "__code__", None)


def graph_context_exception(depth: int = 2) -> tuple[bool, BaseException | None]:
    """Whether ``capture_end`` is being called by ``torch.cuda.graph.__exit__``, and the region's exception.

    That ``__exit__`` passes no exception to ``capture_end``, so the frame
    ``depth`` levels up is read: (True, the exception or None). (False, None)
    when ``capture_end`` was called some other way.
    """
    frame = sys._getframe(depth)
    if frame.f_code is not _GRAPH_EXIT:
        return False, None
    args = frame.f_locals.get("args")
    return True, (args[1] if args and len(args) > 1 and isinstance(args[1], BaseException) else None)


def end_allocate_to_pool(device: int, pool: tuple[int, int]) -> tuple[bool, str]:
    """Undo the allocator's begin-allocate-to-pool of a capture that never ended.

    Returns (released, why not). PyTorch's ``capture_end`` skips this when
    ``cudaStreamEndCapture`` fails, which would leave the pool referenced
    forever and a dead capture filter consulted on every allocation.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        return False, "this PyTorch has no _cuda_endAllocateToPool/_cuda_releasePool"
    try:
        end(device, pool)
    except Exception as exc:  # not recording to this pool: its reference was never taken
        return False, f"not being recorded to: {exc}"
    try:
        release(device, pool)
    except Exception as exc:
        return False, f"release failed: {exc}"
    return True, ""


# ------------------------------------------------------------------ storages and streams
_construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
_use_count = getattr(torch._C, "_storage_Use_Count", None)
weak_view_supported = _construct is not None and _use_count is not None


def storage_use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage, not counting the one this call makes."""
    return int(_use_count(t.untyped_storage()._cdata)) - 1  # type: ignore[misc]


def non_owning_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep the memory allocated."""
    storage = t.untyped_storage()
    weak = _construct(storage.data_ptr(), t.device, storage.nbytes())  # type: ignore[misc]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.size(), t.stride())


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
# For hot paths that inline the stream check (a Python frame is a tenth of a graph launch's host
# time): raw_stream_of(device index) is that device's current stream handle; None without CUDA.
raw_stream_of: Callable[[int], int] | None = _raw_stream


def _copy_each(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    for d, s in zip(dsts, srcs):
        d.copy_(s)


# copy_all(dsts, srcs): dsts[i].copy_(srcs[i]) for all i in one dispatch. On CUDA, tensors of one
# dtype go in one multi-tensor kernel (torch._foreach_copy_, torch >= 2.1): a pool call's three small
# inputs then cost one launch instead of three, which is most of the call's host time.
copy_all: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None] = getattr(
    torch, "_foreach_copy_", _copy_each)


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (``Tensor._version``): in-place writes move it."""
    return t._version


def plain_torch_function() -> Any:
    """A context in which a tensor subclass's ``__torch_function__`` runs ops as on plain tensors
    (their results are plain tensors, not the subclass)."""
    return torch._C.DisableTorchFunctionSubclass()


def current_raw_stream() -> int | None:
    """The current stream's handle on the current device (None without a GPU build)."""
    if _raw_stream is None or _get_device is None:
        return None
    return _raw_stream(_get_device())


def _pointers_equal_py(args: Sequence[Any], ptrs: list[int | None], idx: list[int]) -> bool:
    return all(args[i].data_ptr() == ptrs[i] for i in idx)


@functools.lru_cache(maxsize=1)
def _pointer_check() -> Callable[[Sequence[Any], list[int | None], list[int]], bool]:
    fast = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if fast is None:
        return _pointers_equal_py
    t = torch.zeros(2)
    try:  # the same check inductor's CUDA graphs make per call; trusted once it passes a self-test
        if fast([t, 3], [t.data_ptr(), None], [0]) and not fast([t, 3], [t.data_ptr() + 4, None], [0]):
            return lambda args, ptrs, idx: fast(list(args), ptrs, idx)
    except Exception:
        pass
    return _pointers_equal_py


def pointers_equal(args: Sequence[Any], ptrs: list[int | None], idx: list[int]) -> bool:
    """Whether ``args[i].data_ptr() == ptrs[i]`` for every ``i`` in ``idx`` (hot path)."""
    return _pointer_check()(args, ptrs, idx)


# ------------------------------------------------------------------ symbolic shapes
def sym_expr(v: Any) -> Any:
    """The sympy expression of a SymInt (None for a plain int or a specialised SymInt)."""
    if isinstance(v, torch.SymInt):
        e = v.node.expr
        return None if e.is_number else e
    return None


def sym_hint(v: Any) -> int | None:
    """A SymInt's example value without guarding on it (``int(s)`` would specialise it)."""
    if isinstance(v, torch.SymInt):
        h = getattr(v.node, "hint", None)
        return h if isinstance(h, int) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def sym_range(example: Any, symbol: Any) -> tuple[int, int | None]:
    """The values ``symbol`` may take under the frame's guards: dynamo specialises 0 and 1, so usually [2, inf)."""
    try:
        vr = example.node.shape_env.bound_sympy(symbol)
        lo = max(1, int(vr.lower))
    except Exception:  # no shape env to ask: assume the usual 0/1 specialisation
        return 2, None
    try:
        hi: int | None = int(vr.upper)
    except Exception:  # int_oo: unbounded
        hi = None
    if hi is not None and hi >= 2**62:
        hi = None
    return lo, hi


# ------------------------------------------------------------------ dynamo and inductor
def mark_static_address_type(t: torch.Tensor, kind: Any) -> None:
    """Give ``t`` dynamo's static-address mark ``kind`` (``"guarded"``/``"unguarded"``), as dynamo marks a
    module's buffers while it traces (a process that loads a saved frame runs no dynamo)."""
    from torch._dynamo import mark_static_address  # heavy: only a loaded frame gets here

    mark_static_address(t, guard=kind == "guarded")


def unmark_static_address(t: torch.Tensor) -> None:
    """Drop dynamo's static-address mark from ``t`` (as a tensor of a process where dynamo never ran)."""
    if hasattr(t, "_dynamo_static_input_type"):
        del t._dynamo_static_input_type


def static_address_type(t: torch.Tensor) -> Any:
    """Dynamo's static-address mark of ``t`` (parameters, buffers, ``mark_static_address``), or None."""
    try:
        from torch._dynamo.utils import get_static_address_type  # heavy: only compiled code gets here
    except ImportError:
        return None
    return get_static_address_type(t)


def aot_mutated_inputs(n_inputs: int) -> frozenset[int] | None:
    """Inputs AOT autograd found mutated in the compile that just ran (None: no metadata)."""
    try:
        ctx = torch._guards.TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        if meta is None or len(meta.input_info) != n_inputs:
            return None
        return frozenset(i for i, info in enumerate(meta.input_info)
                         if info.mutates_data or info.mutates_metadata)
    except Exception:  # private metadata: any surprise means "unknown"
        return None


def compile_fx(gm: torch.fx.GraphModule, args: list[Any], config_patches: dict[str, Any]) -> Any:
    """Inductor's compile of a dynamo subgraph.

    A subgraph compiled later than dynamo's call (a static one, compiled on a later call) gets real
    tensors, and inductor's FX graph cache and the AOTAutograd cache then bypass it ("No shape env"):
    it would compile from scratch in every process. Its arguments are turned into fake tensors of a
    fake mode with a shape environment (static shapes: the graph is static), so the caches key it.
    """
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.compile_fx import compile_fx as _compile_fx  # heavy: imports inductor

    if detect_fake_mode(args) is None and any(isinstance(a, torch.Tensor) for a in args):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # as dynamo hands a backend its graph: fake arguments and a tracing context holding their mode
        # (not an ambient mode: inductor's passes expect none)
        mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
        with tracing(TracingContext(mode)):
            return _compile_fx(gm, fakes, config_patches=config_patches)
    return _compile_fx(gm, args, config_patches=config_patches)


def mode_options(mode: str) -> dict[str, Any]:
    """Inductor's config for ``torch.compile(mode=...)``."""
    from torch._inductor import list_mode_options  # heavy: imports inductor

    return dict(list_mode_options(mode))


@functools.lru_cache(maxsize=1)
def cpp_compiler_problem() -> str | None:
    """Why inductor cannot build CPU kernels here (None: a C++ compiler was found)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # heavy: imports inductor

        get_cpp_compiler()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@functools.lru_cache(maxsize=1)
def inductor_config_keys() -> frozenset[str]:
    """Every key ``torch._inductor.config`` accepts as a config patch (dotted for nested ones)."""
    import torch._inductor.config as inductor_config  # heavy: imports inductor

    return frozenset(inductor_config.get_config_copy())


def dynamo_registry() -> Any:
    """Dynamo's backend registry module, or None when dynamo is not imported yet."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.backends import registry  # dynamo is loaded already (checked above)

    return registry


def lookup_backend(name: str) -> Any:
    from torch._dynamo.backends.registry import lookup_backend as _lookup  # heavy: imports dynamo

    return _lookup(name)


def dynamo_counters() -> Any:
    """Dynamo's event counters (``["stats"]["unique_graphs"]``: frames compiled); the benchmarks read them."""
    from torch._dynamo.utils import counters  # heavy: imports dynamo

    return counters


def is_dynamo_signal(exc: BaseException) -> bool:
    """Whether ``exc`` is one dynamo uses for control flow (it must reach dynamo)."""
    dexc = sys.modules.get("torch._dynamo.exc")
    if dexc is None:
        return False
    signals = tuple(t for t in (getattr(dexc, "SkipFrame", None), getattr(dexc, "RestartAnalysis", None)) if t)
    return isinstance(exc, signals)


# the op namespaces dynamo traces torch.distributed collectives into (private names of c10d)
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d"})


def collective_op_name(target: Any) -> str | None:
    """The name of an FX node target that is a torch.distributed collective (None if it is not)."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = str(target)
        return name if name.split(".")[0] in _COLLECTIVE_NAMESPACES else None
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__name__', '?')}" if module.startswith("torch.distributed") else None


# ------------------------------------------------------------------ torch ops by name
def resolve_op(path: list[str]) -> Any:
    """``torch.ops.<ns>.<name>[.<overload>]`` for ``path == [ns, name(, overload)]``; None when absent."""
    obj: Any = torch.ops
    for part in path:
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            return None
    return obj if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                                   torch._ops.HigherOrderOperator)) else None


def op_packet(target: Any) -> Any:
    """The overload packet of an ``OpOverload`` (``aten.add`` for ``aten.add.Tensor``); None for anything else."""
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else None


def op_name(obj: Any) -> str | None:
    """``"ns::op.overload"`` for an ``OpOverload``, ``"ns::op"`` for its packet; None for anything else."""
    if isinstance(obj, torch._ops.OpOverload):
        full = obj.name()
        return full if "." in full.split("::", 1)[1] else f"{full}.default"
    if isinstance(obj, torch._ops.OpOverloadPacket):
        return obj._qualified_op_name
    if isinstance(obj, torch._ops.HigherOrderOperator):
        return f"higher_order::{obj.name()}"
    return None


@functools.lru_cache(maxsize=None)
def op_writes(op: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The arguments ``op`` (an ``OpOverload``) writes, from its schema: (positions, keyword names).

    ``aten::add_.Tensor(Tensor(a!) self, ...)`` writes position 0; an ``out=``
    variant writes its keyword-only ``out`` (which may also come positionally).
    Cached per op: the row analysis asks for every op it sees.
    """
    try:
        arguments = op._schema.arguments
    except AttributeError:
        return (), ()
    pos: list[int] = []
    names: list[str] = []
    for i, a in enumerate(arguments):
        info = a.alias_info
        if info is not None and info.is_write:
            names.append(a.name)
            pos.append(i)
    return tuple(pos), tuple(names)


_ARG_KINDS = {"TensorType": "tensor", "NumberType": "number", "ComplexType": "number", "FloatType": "float",
              "IntType": "int", "SymIntType": "symint", "BoolType": "bool"}


def op_arguments(op: Any) -> tuple[tuple[str, str], ...]:
    """Each argument of ``op`` (an ``OpOverload``) from its schema: (name, kind), the kind one of ``tensor``,
    ``number`` (a ``Scalar``), ``float``, ``int``, ``symint`` (an integer that may be a size), ``bool`` or
    ``other``; an optional or a list is its element's kind (``view``'s ``SymInt[] size``: ``symint``).
    Empty for an op without a schema. Not cached: the caller keeps what it derives."""
    try:
        arguments = op._schema.arguments
    except AttributeError:
        return ()
    out = []
    for a in arguments:
        t = a.real_type
        while type(t).__name__ in ("OptionalType", "ListType"):
            t = t.getElementType()
        out.append((a.name, _ARG_KINDS.get(type(t).__name__, "other")))
    return tuple(out)


@contextlib.contextmanager
def compiled_code_runs_eagerly() -> Iterator[None]:
    """While open, ``torch.compile``'d code runs its Python eagerly (``set_stance("force_eager")``,
    torch 2.6+), so a tracer's modes see its ops one by one; a ``fullgraph=True`` function would
    otherwise try to compile the mode's own ``__torch_dispatch__`` and raise. Compiled caches are
    kept. The stance is process-wide: while open, compiled code in other threads runs eagerly too
    (the same results, slower). Inside a compiled region torch refuses the change; then nothing
    changes (that region's code is already being traced or run by dynamo)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    try:
        # set_stance takes effect when called, not on __enter__; RuntimeError: inside a compiled region
        stance = set_stance("force_eager") if set_stance is not None else None
    except RuntimeError:
        stance = None
    try:
        yield
    finally:
        if stance is not None:
            stance.__exit__(None, None, None)


class RowDispatchMode(TorchDispatchMode):
    """The dispatch mode the row analysis traces with, without the wrapper that keeps dynamo out of
    ``__torch_dispatch__`` (torch 2.12+: a frame hook per op, a fifth of the mode's cost). Nothing
    here is compiled, so the wrapper protects nothing.

    Higher-order operators reach ``__torch_dispatch__`` too (``supports_higher_order_operators``):
    :func:`inline_subgraph` runs a region's subgraph under the mode, its ops traced one by one; the
    mode refuses any other such operator (:func:`op_kind`), and the analysis counts the graph as
    unproven."""

    supports_higher_order_operators = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


OP_PLAIN, OP_COMPOSITE, OP_REGION, OP_HIGHER_ORDER = 0, 1, 2, 3


def op_kind(func: Any) -> int:
    """What a dispatch mode is handed: :data:`OP_PLAIN` (an op to run), :data:`OP_COMPOSITE` (a
    ``CompositeImplicitAutograd`` op: autograd decomposes it before a mode sees it, except where
    autograd is off, under ``torch.inference_mode`` and inside a region's subgraph, where it arrives
    whole and ``func.decompose(...)`` runs that kernel), :data:`OP_REGION` (``invoke_subgraph``:
    :func:`inline_subgraph`) or :data:`OP_HIGHER_ORDER` (another higher-order operator). Cheap enough
    to cache per op by the caller."""
    if isinstance(func, torch._ops.HigherOrderOperator):
        return OP_REGION if func is _INVOKE_SUBGRAPH else OP_HIGHER_ORDER
    try:
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
    except (AttributeError, RuntimeError, TypeError):
        composite = False
    return OP_COMPOSITE if composite else OP_PLAIN


def inline_subgraph(args: Sequence[Any]) -> Any:
    """A call of ``invoke_subgraph`` (:data:`OP_REGION`: a region marked with
    ``torch.compiler.nested_compile_region``) run as its subgraph on its operands, in the caller's
    dispatch context (a mode that re-enters itself first sees every op inside). The call's arguments
    are the subgraph, its identifier, then the operands."""
    return args[0](*args[2:])


def static_fake_mode() -> Any:
    """A fresh fake-tensor mode with static shapes (no shape environment: nothing guards dynamo's frames)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # heavy: only the compile backend gets here

    return FakeTensorMode(allow_non_fake_inputs=True)


def generator_states_track_graphs(version: str | None = None) -> bool:
    """Whether this PyTorch's CUDA generator states record the graphs registered with them and
    ``~CUDAGraph()`` insists on finding itself there: torch 2.3 - 2.11 (the device runs 2.11), and
    2.12, which is treated alike (registering again, the repair, is harmless where it does not check).

    aten/src/ATen/cuda/CUDAGeneratorImpl.cpp (2.3 - 2.11): ``CUDAGeneratorState::unregister_graph``
    is ``TORCH_CHECK(registered_graphs_.find(graph) != registered_graphs_.end(), "The graph should be
    registered to the state")``, and aten/src/ATen/cuda/CUDAGraph.cpp ``CUDAGraph::~CUDAGraph()``
    calls it for every state in ``captured_generator_states_``. A check that throws in a destructor
    ends the process (``std::terminate``, SIGABRT). ``register_generator_state`` arrived with that
    bookkeeping (pytorch/pytorch#114068, 2.3); torch 2.13 keys RNG state by capture id instead
    (pytorch/pytorch#176752: its CUDAGeneratorImpl.h has no ``unregister_graph``). ``version``:
    ``torch.__version__`` by default.
    """
    text = torch.__version__ if version is None else version
    try:
        major, minor = (int(part) for part in text.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < (2, 13) and callable(getattr(OriginalCUDAGraph, "register_generator_state", None))


def is_fake(t: Any) -> bool:
    """Whether ``t`` is a fake tensor (dynamo's example values; no data to read)."""
    mod = sys.modules.get("torch._subclasses.fake_tensor")
    return mod is not None and isinstance(t, mod.FakeTensor)


def generated_forward(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s generated ``forward``, compiled now: a lazily recompiled module would otherwise check
    (through ``nn.Module.__call__``) whether to recompile on every call."""
    materialize = getattr(gm, "real_recompile", None)
    if materialize is not None:
        materialize()
    return gm.forward


def describe() -> dict[str, Any]:
    """Which path each private API took in this process (for ``doctor`` and the tests)."""
    replay = "torch._C._CUDAGraph.replay" if base_replay is not OriginalCUDAGraph.replay \
        else "CUDAGraph.replay (Python)"
    return {
        "torch": torch.__version__,
        "replay": replay,
        "check_input_liveness": has_check_input_liveness,
        "graph_exit_frame": _GRAPH_EXIT is not None and "args" in _GRAPH_EXIT.co_varnames,
        "pool_release": hasattr(torch._C, "_cuda_endAllocateToPool") and hasattr(torch._C, "_cuda_releasePool"),
        "weak_outputs": weak_view_supported,
        "raw_stream": _raw_stream is not None and _get_device is not None,
        "input_copies": "torch._foreach_copy_" if copy_all is not _copy_each else "one copy_ each",
        "pointer_check": "C++" if _pointer_check() is not _pointers_equal_py else "Python",
        "saved_frames": "aot_compile" if has_aot_precompile else "unavailable (torch < 2.10)",
    }


# ------------------------------------------------------------------ compile caches (start-up)
# torch.compiler.save_cache_artifacts / load_cache_artifacts ("mega-cache": inductor's FX graph
# cache, the AOTAutograd cache, autotuning and PGO entries in one blob) are public since torch 2.7;
# the package needs torch >= 2.6, where they are missing. Inductor's FX graph cache and the
# AOTAutograd cache are on by default since 2.5 and 2.6 (local, under TORCHINDUCTOR_CACHE_DIR).
has_cache_artifacts = hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler,
                                                                                 "load_cache_artifacts")


def save_cache_artifacts() -> tuple[bytes, Any] | None:
    """``torch.compiler.save_cache_artifacts()``: (the blob, torch's CacheInfo), None when nothing was
    compiled in this process. ``NotImplementedError`` on a torch without it (before 2.7)."""
    if not has_cache_artifacts:
        raise NotImplementedError(f"torch {torch.__version__} has no torch.compiler.save_cache_artifacts "
                                  "(added in 2.7): its FX graph and AOTAutograd caches still work on disk")
    return torch.compiler.save_cache_artifacts()


def load_cache_artifacts(blob: bytes) -> Any:
    """``torch.compiler.load_cache_artifacts(blob)``: torch's CacheInfo of what it loaded, or None."""
    if not has_cache_artifacts:
        raise NotImplementedError(f"torch {torch.__version__} has no torch.compiler.load_cache_artifacts "
                                  "(added in 2.7)")
    return torch.compiler.load_cache_artifacts(blob)


# ------------------------------------------------------------------ compiled frames saved whole (start-up)
# torch.compile(...).aot_compile((args, kwargs)) traces one frame with dynamo, ahead of its first call, and
# its save_compiled_function / torch.compiler.load_compiled_function write and read the traced frame: its
# bytecode, its guards and what the backend returned, which must implement torch's SerializableCallable
# (torch._dynamo.aot_compile_types; the same API in 2.11 and 2.13). A process that loads it runs no dynamo.
has_aot_precompile = hasattr(torch.compiler, "load_compiled_function") and hasattr(torch.compiler,
                                                                                  "keep_portable_guards_unsafe")


def _need_aot_precompile() -> None:
    if not has_aot_precompile:
        raise NotImplementedError(f"saving a compiled frame needs torch.compile(...).aot_compile and "
                                  f"torch.compiler.load_compiled_function (torch >= 2.10); this is PyTorch "
                                  f"{torch.__version__}: use gfxgraph.cache.save/load (inductor's caches) instead")


def make_serializable(cls: type) -> type:
    """Register ``cls`` (a class with torch's ``serialize_compile_artifacts`` / ``deserialize_compile_artifacts``
    classmethods) as a virtual subclass of torch's ``SerializableCallable``, which aot_compile asks of what
    a backend returns. Returns ``cls``."""
    _need_aot_precompile()
    from torch._dynamo.aot_compile_types import SerializableCallable  # heavy: imports dynamo

    SerializableCallable.register(cls)
    return cls


def aot_compile_frame(fn: Callable[..., Any], backend: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
    """``torch.compile(fn, backend=backend, fullgraph=True).aot_compile((args, kwargs))`` with the portable
    guards: dynamo's trace of one whole frame. torch 2.11 gives the compiled function its ``aot_compile``
    only under ``torch._dynamo.config.enable_aot_compile`` (2.13 always), so the flag is set for the call."""
    _need_aot_precompile()
    import torch._dynamo  # heavy

    flag = {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
    with torch._dynamo.config.patch(**flag):
        compiled = torch.compile(fn, backend=backend, fullgraph=True, options={"guard_filter_fn": _saved_guards})
    if not hasattr(compiled, "aot_compile"):
        raise NotImplementedError(f"PyTorch {torch.__version__}: torch.compile gave no aot_compile for "
                                  f"{type(fn).__name__}; save a plain function (a module's forward as a function "
                                  f"taking the module)")
    return compiled.aot_compile((args, kwargs))


def compiled_frame_bytes(frame: Any) -> bytes:
    """What ``frame.save_compiled_function(path)`` writes, as bytes (torch's own serialisation)."""
    return type(frame).serialize(frame).serialized_data


def compiled_frame_admits(frame: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a loaded frame's saved guards pass for this call (what its ``__call__`` checks first)."""
    return bool(frame.guard_check(*args, **kwargs))


def compiled_frame_code(frame: Any) -> Callable[..., Any]:
    """A loaded frame's code without its guard check (``frame.fn``): for a caller that checked them."""
    return frame.fn


# Value guards on the frame's own arguments and what they hold (a Python scalar argument, a module's
# ``training`` flag or a config value its forward reads): compared by value, so they hold in another process.
_VALUE_GUARDS = frozenset({"EQUALS_MATCH", "CONSTANT_MATCH", "BOOL_MATCH", "NONE_MATCH"})


def _saved_guards(entries: Sequence[Any]) -> list[bool]:
    """The guards a saved frame keeps: PyTorch's portable ones (``keep_portable_guards_unsafe``: tensor
    metadata, shapes, global state) and the value guards on its arguments, without which a call with
    another Python value (``scale=3`` for a frame traced with 2, a module in train mode) would run the
    code traced for the first one. Guards on object identity and on globals are dropped."""
    from torch._dynamo.guards import CheckFunctionManager  # heavy: only a saved frame gets here

    unsaved = set(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ("ID_MATCH",)))
    portable = torch.compiler.keep_portable_guards_unsafe(entries)
    return [keep or (not e.is_global and e.guard_type in _VALUE_GUARDS and not unsaved & set(e.derived_guard_types))
            for keep, e in zip(portable, entries)]


def load_compiled_frame(data: bytes, f_globals: dict[str, Any] | None) -> Any:
    """``torch.compiler.load_compiled_function`` of the bytes ``save_compiled_function`` wrote."""
    _need_aot_precompile()
    return torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=f_globals)


@contextlib.contextmanager
def _slices_as_pytree() -> Iterator[None]:
    """Slices as pytree nodes while a graph is pickled or read back, so that a node inside one
    (``x[:, :n]`` with a symbolic ``n``) is found: torch 2.13's GraphPickler does this itself, 2.11's not."""
    if slice in pytree.SUPPORTED_NODES:
        yield
        return
    pytree._private_register_pytree_node(slice, lambda x: ([x.start, x.stop, x.step], None),
                                         lambda x, _: slice(*x))
    try:
        yield
    finally:
        pytree._deregister_pytree_node(slice)


def pickle_graph(gm: torch.fx.GraphModule) -> bytes:
    """``gm`` with every node's fake value (``example_value``, as dynamo traced it), through torch's
    ``GraphPickler`` (every op allowed: the graph is read back by the same torch). Other node metadata is
    left out (it holds stacks and, on placeholders, dynamo's real example tensors). The values are kept
    rather than recomputed on load: running the graph again on fake tensors outside dynamo can fix a
    symbolic size (torch 2.11, a Llama step on CUDA: the batch became its traced size)."""
    from torch.fx._graph_pickler import GraphPickler, Options  # heavy: only a saved frame gets here

    saved = {n: n.meta for n in gm.graph.nodes}
    gm_meta = gm.meta
    try:
        for n in gm.graph.nodes:
            n.meta = ({"example_value": pytree.tree_map(_unviewed, saved[n]["example_value"])}
                      if "example_value" in saved[n] else {})
        gm.meta = {}
        with _slices_as_pytree():
            return GraphPickler.dumps(gm, Options(ops_filter=None))
    finally:
        for n, meta in saved.items():
            n.meta = meta
        gm.meta = gm_meta


def _unviewed(value: Any) -> Any:
    """A fake tensor that is a view (its base does not pickle) as a fresh one of the same sizes and strides."""
    if isinstance(value, torch.Tensor) and value._is_view() and getattr(value, "fake_mode", None) is not None:
        with value.fake_mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device,
                                       requires_grad=value.requires_grad)
    return value


def unpickle_graph(data: bytes) -> tuple[torch.fx.GraphModule, Any]:
    """The graph :func:`pickle_graph` wrote, in a new fake mode whose shape environment is the one dynamo
    traced it with (the pickle holds it), with every node's ``example_value``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    with _slices_as_pytree():
        gm = GraphPickler.loads(data, mode)
    gm.recompile()
    return gm, mode


def constant_symbols(fake_mode: Any) -> dict[str, int]:
    """The symbols ``fake_mode``'s shape environment has replaced by a number (specialised sizes)."""
    env = getattr(fake_mode, "shape_env", None)
    replacements = getattr(env, "replacements", None) or {}
    return {str(k): int(v) for k, v in replacements.items() if getattr(v, "is_number", False)}


def tracing_with(fake_mode: Any) -> Any:
    """The tracing context dynamo holds while it calls a backend: one whose fake mode is ``fake_mode``."""
    from torch._guards import TracingContext, tracing

    return tracing(TracingContext(fake_mode))


def compile_cache_counters() -> dict[str, int]:
    """Hits and misses of inductor's FX graph cache and the AOTAutograd cache in this process
    (dynamo's ``counters``, the numbers its own cache tests read)."""
    from torch._dynamo.utils import counters  # heavy (imports dynamo): only start-up tools ask

    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {"fx_graph_hit": int(ind["fxgraph_cache_hit"]), "fx_graph_miss": int(ind["fxgraph_cache_miss"]),
            "fx_graph_bypass": int(ind["fxgraph_cache_bypass"]),
            "aot_autograd_hit": int(aot["autograd_cache_hit"]), "aot_autograd_miss": int(aot["autograd_cache_miss"]),
            "aot_autograd_bypass": int(aot["autograd_cache_bypass"])}


def compile_time_seconds() -> dict[str, float]:
    """Seconds dynamo's own timers recorded in this process: ``dynamo`` (tracing, guards, bytecode: its
    compiles minus the backend's part) and ``backend`` (the backend compiler on each graph: AOTAutograd
    and inductor, or gfxgraph's backend with the inductor it calls). Zeros where a torch version lacks
    the timers (``torch._dynamo.utils.compilation_time_metrics``, ``_compile.compile_inner``,
    ``OutputGraph.call_user_compiler``)."""
    from torch._dynamo import utils  # heavy (imports dynamo): only start-up tools ask

    metrics = getattr(utils, "compilation_time_metrics", {})
    total = float(sum(metrics.get("_compile.compile_inner", ())))
    backend = float(sum(metrics.get("OutputGraph.call_user_compiler", ())))
    return {"dynamo": max(total - backend, 0.0), "backend": backend}


def compile_profile(top: int = 12) -> dict[str, Any]:
    """Where this process's compile time went, for a start-up report: the ``top`` timers of dynamo's
    ``compilation_time_metrics`` (seconds and calls each) and its frame and graph counters (frames
    traced, unique graphs, graph breaks, recompiles). Empty where a torch version lacks them."""
    from torch._dynamo import utils  # heavy (imports dynamo): only start-up tools ask

    metrics = getattr(utils, "compilation_time_metrics", {})
    timers = sorted(((str(name), float(sum(v)), len(v)) for name, v in metrics.items()), key=lambda x: -x[1])[:top]
    counters = getattr(utils, "counters", {})

    def counts(group: str) -> dict[str, int]:  # JSON-ready: a counter's keys may be tuples or objects
        return {str(k): int(v) for k, v in counters.get(group, {}).items()}
    return {"timers_s": {name: {"s": round(sec, 3), "calls": n} for name, sec, n in timers},
            "frames": counts("frames"), "stats": counts("stats"),
            "graph_breaks": sum(counts("graph_break").values()), "recompiles": sum(counts("recompiles").values())}


_INVOKE_SUBGRAPH = getattr(getattr(torch.ops, "higher_order", None), "invoke_subgraph", None)
"""The region call (``torch.compiler.nested_compile_region``), looked up once: code that dynamo may trace
(a dispatch mode under ``torch.cond``) must not touch ``torch.ops``."""


def subgraph_operands(node: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """``(subgraph, operands)`` where the FX node ``node`` calls ``invoke_subgraph`` (a region marked with
    ``torch.compiler.nested_compile_region``, traced once however often it is called): the region's
    ``GraphModule`` and the operands in its placeholder order. None for any other node. The call's
    arguments are the subgraph (a ``get_attr``), its identifier, then the operands."""
    if _INVOKE_SUBGRAPH is None or node.op != "call_function" or node.target is not _INVOKE_SUBGRAPH:
        return None
    module = getattr(node.graph, "owning_module", None)
    attr = node.args[0] if node.args else None
    sub = getattr(module, attr.target, None) if getattr(attr, "op", None) == "get_attr" else None
    return None if sub is None else (sub, tuple(node.args[2:]))


def subgraph_operand_placeholder(user: Any, operand: Any) -> Any:
    """Where ``user``, a region's call (:func:`subgraph_operands`), passes ``operand`` into its subgraph:
    that subgraph's placeholder for it. None where ``user`` is no region call or does not pass it."""
    found = subgraph_operands(user)
    if found is None:
        return None
    sub, operands = found
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for k, a in enumerate(operands):
        if a is operand and k < len(placeholders):
            return placeholders[k]
    return None


def size_oblivious_tracing() -> Any:
    """A context in which dynamo traces dynamic sizes without their 0/1 specialisation: PyTorch's
    ``torch.fx.experimental._config.backed_size_oblivious`` set for the block, so the frame traced
    there serves size 1 too (no second frame). A process-wide setting while the block runs.

    Raises ``NotImplementedError`` where this torch has no such setting."""
    import torch.fx.experimental._config as fx_config  # heavy: only a compiled function's warm-up asks

    if "backed_size_oblivious" not in getattr(fx_config, "_config", {}):
        raise NotImplementedError(f"one_frame needs torch.fx.experimental._config.backed_size_oblivious, which "
                                  f"PyTorch {torch.__version__} does not have")
    return fx_config.patch(backed_size_oblivious=True)


def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """``torch._dynamo.maybe_mark_dynamic``: compile ``t``'s ``dim`` as a symbol from its first
    frame (one compile for every batch size) unless the code specialises it; never raises for that."""
    import torch._dynamo  # heavy: only a compiled function's warm-up asks

    torch._dynamo.maybe_mark_dynamic(t, dim)


def gpu_sleep(cycles: int) -> bool:
    """Keep the current CUDA stream busy for about ``cycles`` GPU clock cycles (``torch.cuda._sleep``), so
    that work queued behind it runs back to back without waiting for the host. Returns False (and does
    nothing) where this torch has no such kernel."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return False
    sleep(int(cycles))
    return True
