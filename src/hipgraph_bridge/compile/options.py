"""The options of the ``gfxgraph`` compile backend, validated at the boundary."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .._torch_compat import inductor_config_keys, mode_options
from ..bucketing.options import PoolOptions
from ..graph.buckets import validate_buckets
from ..ranks.agreement import RankAgreement, as_agreement
from ..checks import check_bool, check_int
from ..config import check_vram_cap
from ..errors import ConfigError
from .splitting import parse_splitting_ops

__all__ = ["BackendOptions", "Compiler"]

Compiler = Literal["inductor", "aot_eager", "eager"]
COMPILERS = ("inductor", "aot_eager", "eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

def _positive_int(name: str, v: Any, *, minimum: int = 1) -> int:
    return check_int(f"options[{name!r}]", v, minimum=minimum, error=ConfigError)


def _flag(name: str, v: Any) -> bool:
    return check_bool(f"options[{name!r}]", v, error=ConfigError)


_POOL_FIELDS = ("buckets", "max_batch_size", "batch_dim", "vram_cap", "copy_outputs", "pad_value", "warmup_iters",
                "simulate_padding", "process_group")


@dataclass(frozen=True)
class BackendOptions:
    """Options of the ``gfxgraph`` backend: ``torch.compile(..., options={...})``.

    The pool options are :class:`~hipgraph_bridge.bucketing.PoolOptions` (``pool``), embedded
    and read through the same names:

    Attributes:
        buckets: batch sizes to capture; default :func:`~hipgraph_bridge.default_buckets` up to
            ``max_batch_size``. Buckets outside the sizes a frame admits are dropped.
        max_batch_size: the largest default bucket (256); larger batches run
            ungraphed (compiled), counted as ``oversize``.
        batch_dim: the dimension that carries the batch, in inputs and outputs (0).
        vram_cap: no new capture once device memory use would pass this fraction;
            default ``GFXGRAPH_VRAM_CAP`` or 0.90.
        copy_outputs: return copies (True). False returns views of the graphs'
            static outputs, overwritten by the next call of this subgraph.
        pad_value: the value padding rows are filled with (0), in the batch-bucket
            graphs and in the piecewise pieces alike.
        warmup_iters: runs before each capture (1; at most 1 for a subgraph that writes state).
        simulate_padding: without a GPU, run graphed subgraphs through the pool's padded
            pipeline instead of on the call's own inputs (False): for checking what
            padding does, on any machine.
        process_group: for models that call torch.distributed collectives: a ``ProcessGroup``
            or a :class:`~hipgraph_bridge.RankAgreement` (batch ``"equal"`` or ``"trusted"``).
            A subgraph whose graph holds a collective is graphed only with it: its
            pools agree with the other ranks (same bucket, same captures, fallbacks
            together) and so does its choice to graph or not. Without it such a
            subgraph runs compiled, ungraphed (reason ``collectives``). Subgraphs
            without collectives never wait for other ranks.
        compiler: ``"inductor"`` (default); ``"aot_eager"`` or ``"eager"`` (the
            traced graph as it is) for debugging or machines without a C++ compiler.
            Inductor on CPU falls back to ``"eager"`` by itself when no compiler is found.
        inductor_config: extra inductor config patches (CUDA-graph keys refused).
        static_compile_after: a frame with every shape specialised is compiled on
            this call (2); earlier calls run the traced graph eagerly.
        max_variants: graph sets per subgraph for distinct non-batch shapes or
            constant arguments (8); further ones run ungraphed.
        graphs: False compiles only (no graphs): for comparisons.
        piecewise: split each dynamo graph at the splitting ops and graph the pieces between
            them per bucket of the token count (False); see :mod:`.piecewise`.
        splitting_ops: torch op names to split at besides the default attention ops
            (:data:`~.splitting.DEFAULT_SPLITTING_OPS`): ``"ns::op"``, ``"ns::op.overload"``,
            ``"torch.ops.ns.op"`` or a dotted function path; stored resolved and canonical.
        token_dim: the dimension of the graph's first tensor input that carries the token
            count (None: found from the dynamic sizes; see :func:`.piecewise.find_token_symbol`).
        token_buckets: token counts to capture the pieces at; default
            :func:`~hipgraph_bridge.default_buckets` up to ``max_tokens``.
        max_tokens: the largest default token bucket (512); longer calls run the pieces
            compiled, without graphs (reason ``oversize``).
    """

    pool: PoolOptions = field(default_factory=lambda: PoolOptions.create(progress=False))
    max_batch_size: int = 256
    compiler: Compiler = "inductor"
    inductor_config: tuple[tuple[str, Any], ...] = ()
    static_compile_after: int = 2
    max_variants: int = 8
    graphs: bool = True
    piecewise: bool = False
    splitting_ops: tuple[str, ...] = ()
    token_dim: int | None = None
    token_buckets: tuple[int, ...] | None = None
    max_tokens: int = 512
    mode_config: tuple[tuple[str, Any], ...] = field(default=(), repr=False)  # from torch.compile(mode=...)

    # the pool's options, read through the names ``options={...}`` uses
    buckets = property(lambda self: self.pool.buckets)
    batch_dim = property(lambda self: self.pool.batch_dim)
    vram_cap = property(lambda self: self.pool.vram_cap)
    copy_outputs = property(lambda self: self.pool.copy_outputs)
    pad_value = property(lambda self: self.pool.pad_value)
    warmup_iters = property(lambda self: self.pool.warmup_iters)
    simulate_padding = property(lambda self: self.pool.simulate_padding)
    process_group = property(lambda self: self.pool.process_group)

    @classmethod
    def known(cls) -> list[str]:
        """Option names accepted in ``options={...}``."""
        return sorted({*_POOL_FIELDS, *(f.name for f in fields(cls) if f.name not in ("mode_config", "pool"))})

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None = None, *, mode: str | None = None) -> BackendOptions:
        """Validate ``options`` (and torch.compile's ``mode``); raise :class:`ConfigError` naming the problem."""
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise TypeError(f"gfxgraph backend options: expected a dict of option names to values, got "
                            f"{type(options).__name__}; known options: {', '.join(cls.known())}")
        known = cls.known()
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ConfigError(f"gfxgraph backend: unknown option(s) {', '.join(map(repr, unknown))}; "
                              f"known options: {', '.join(known)}")
        o = dict(options)
        if o.get("buckets") is not None and "max_batch_size" in o:
            raise ConfigError(f"options['buckets'] and options['max_batch_size']: expected one of them "
                              f"(max_batch_size only chooses the default buckets), got buckets={o['buckets']!r} "
                              f"and max_batch_size={o['max_batch_size']!r}")
        kw: dict[str, Any] = {}
        pool: dict[str, Any] = {"progress": False}
        if o.get("buckets") is not None:
            try:
                pool["buckets"] = validate_buckets(o["buckets"])
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"options['buckets']: {exc}") from None
        for name in ("max_batch_size", "static_compile_after", "max_variants"):
            if name in o:
                kw[name] = _positive_int(name, o[name])
        if "max_batch_size" in kw:
            pool["max_batch_size"] = kw["max_batch_size"]
        for name in ("batch_dim", "warmup_iters"):
            if name in o:
                pool[name] = _positive_int(name, o[name], minimum=0)
        for name in ("graphs", "piecewise"):
            if name in o:
                kw[name] = _flag(name, o[name])
        for name in ("copy_outputs", "simulate_padding"):
            if name in o:
                pool[name] = _flag(name, o[name])
        kw.update(_piecewise_options(o))
        if o.get("vram_cap") is not None:
            pool["vram_cap"] = check_vram_cap(o["vram_cap"], name="options['vram_cap']")
        if "pad_value" in o:
            pv = o["pad_value"]
            if pv is not None and not isinstance(pv, (int, float, bool)):
                raise ConfigError(f"options['pad_value']: expected a number or None, got {pv!r}")
            pool["pad_value"] = pv
        if "compiler" in o:
            if o["compiler"] not in COMPILERS:
                raise ConfigError(f"options['compiler']: expected one of {', '.join(COMPILERS)}, "
                                  f"got {o['compiler']!r}")
            kw["compiler"] = o["compiler"]
        if "inductor_config" in o:
            kw["inductor_config"] = _inductor_patches(o["inductor_config"])
        if o.get("process_group") is not None:
            pool["process_group"] = _agreement(o["process_group"])
        kw["mode_config"] = _mode_patches(mode)
        try:
            kw["pool"] = PoolOptions.create(**pool)
        except (TypeError, ValueError) as exc:  # every value was checked above: a rule between options
            raise ConfigError(f"gfxgraph backend options: {exc}") from None
        return cls(**kw)

    def inductor_patches(self) -> dict[str, Any]:
        """Config patches for ``compile_fx``: mode's, then the user's, then CUDA graphs off."""
        return {**dict(self.mode_config), **dict(self.inductor_config), "triton.cudagraphs": False}

    def tree_patches(self) -> dict[str, Any]:
        """Config patches for a subgraph that needs autograd: as :meth:`inductor_patches`, with inductor's
        CUDA-graph trees on (``mode="reduce-overhead"``'s graphs: forward and backward, one per shape)."""
        return {**dict(self.mode_config), **dict(self.inductor_config), "triton.cudagraphs": True}


_PIECEWISE_ONLY = ("splitting_ops", "token_dim", "token_buckets", "max_tokens")


def _piecewise_options(o: dict[str, Any]) -> dict[str, Any]:
    """The piecewise options, checked: each needs ``piecewise=True`` and names what it expects."""
    given = [k for k in _PIECEWISE_ONLY if k in o]
    if given and o.get("piecewise") is not True:
        raise ConfigError(f"options[{given[0]!r}]: expected together with options['piecewise'] = True "
                          f"(it only applies to piecewise graphs), got piecewise={o.get('piecewise', False)!r}")
    if o.get("token_buckets") is not None and "max_tokens" in o:
        raise ConfigError(f"options['token_buckets'] and options['max_tokens']: expected one of them "
                          f"(max_tokens only chooses the default token buckets), got token_buckets="
                          f"{o['token_buckets']!r} and max_tokens={o['max_tokens']!r}")
    kw: dict[str, Any] = {}
    if "splitting_ops" in o:
        kw["splitting_ops"] = parse_splitting_ops(o["splitting_ops"])
    if o.get("token_dim") is not None:
        kw["token_dim"] = _positive_int("token_dim", o["token_dim"], minimum=0)
    if o.get("token_buckets") is not None:
        try:
            kw["token_buckets"] = tuple(validate_buckets(o["token_buckets"]))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"options['token_buckets']: {exc}") from None
    if "max_tokens" in o:
        kw["max_tokens"] = _positive_int("max_tokens", o["max_tokens"])
    return kw


def _inductor_patches(cfg: Any) -> tuple[tuple[str, Any], ...]:
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"options['inductor_config']: expected a dict of inductor config patches, got {cfg!r}")
    for k in cfg:
        if not isinstance(k, str):
            raise ConfigError(f"options['inductor_config']: expected str keys, got {k!r}")
        if "cudagraph" in k:
            raise ConfigError(f"options['inductor_config']: {k!r} is not allowed: gfxgraph captures the graphs "
                              "itself, so inductor's CUDA graphs stay off")
    unknown = sorted(k for k in cfg if k not in inductor_config_keys())
    if unknown:
        near = {k: difflib.get_close_matches(k, inductor_config_keys(), n=2) for k in unknown}
        hints = "; ".join(f"{k!r} (did you mean {', '.join(map(repr, m))}?)" if m else repr(k)
                          for k, m in near.items())
        raise ConfigError(f"options['inductor_config']: unknown inductor config key(s) {hints}; expected keys "
                          "of torch._inductor.config (nested ones dotted, e.g. 'triton.max_tiles')")
    return tuple(sorted(cfg.items()))


def _agreement(value: Any) -> RankAgreement:
    try:
        agreement = as_agreement(value, name="options['process_group']")
    except (TypeError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from None
    assert agreement is not None
    if agreement.batch == "max":
        raise ConfigError("options['process_group']: RankAgreement(batch='max') is not supported by the compile "
                          "backend (a subgraph it runs ungraphed gets each rank's own batch); expected batch='equal' "
                          "or 'trusted'")
    return agreement


def _mode_patches(mode: str | None) -> tuple[tuple[str, Any], ...]:
    if mode is None or mode in ("default", "reduce-overhead"):  # reduce-overhead: the graphs are ours
        return ()
    if mode not in MODES:
        raise ConfigError(f"torch.compile(mode={mode!r}) with backend 'gfxgraph': expected one of "
                          f"{', '.join(MODES)}")
    return tuple(sorted((k, v) for k, v in mode_options(mode).items() if "cudagraph" not in k))
