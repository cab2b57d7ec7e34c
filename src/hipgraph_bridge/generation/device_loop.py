"""DeviceDecodeLoop: greedy decoding where one graph launch runs up to ``chunk`` steps.

A host-driven decode loop pays, per token, a device-to-host read (the EOS
check), the Python step and a launch while the GPU waits. Here the loop
itself is on the device: a :class:`~hipgraph_bridge.conditional.DeviceWhileLoop`
whose body runs the decode step, writes the token into a device buffer,
advances the position, marks the sequences that produced EOS, and stops when
every sequence has ended or the launch's share of the budget is spent::

    def step(tokens, position):         # (B,) long, 0-dim long -> (B,) long, all on the device
        return model_logits(tokens, position).argmax(-1)

    loop = DeviceDecodeLoop(step, batch_size=4, chunk=64)
    new = loop.generate(first, prompt_len, max_new_tokens=256, eos_token_id=2)   # (4, n <= 256)
    for chunk in loop.chunks(first, prompt_len, max_new_tokens=256, eos_token_id=2):
        ...                             # streaming: one (4, <= 64) tensor per launch

Per launch the host writes a few scalars, replays once and reads one
three-element control tensor (how many steps ran, whether any sequence is
still going): ``ceil(max_new_tokens / chunk)`` reads per generation at most,
instead of one per token.

Semantics are those of ``generate(do_sample=False)``: a sequence that produced
``eos_token_id`` (an id, or up to 8 of them as a list, tuple or tensor: any one
ends a sequence) gets ``pad_token_id`` from then on; decoding stops when every
sequence has ended. The step must be deterministic and free of host syncs
(it is captured), write any state it keeps (a static KV cache) in place, and
keep its own write position right: a capture or warm-up runs the step, so a
step over a KV cache needs the cache reset after :meth:`capture`.

Strategies are the loop's (:attr:`strategy`): ``"native"`` (a CUDA WHILE
node: one launch per chunk, no host sync inside it; after each step one kernel
does the EOS bookkeeping, writes the token, advances the position and decides
whether to go on, for up to 1024 sequences, torch ops beyond), ``"host"`` (HIP, which
has no conditional nodes; forcible on CUDA: the step is one graph replayed
with one host read per token) and ``"eager"`` (no GPU graphs).

A step may return logits ``(batch_size, vocab)`` instead of token ids; the
loop then chooses the token itself: greedy, or sampled with
``generate(do_sample=True, temperature=, top_k=, top_p=, seed=)`` in
transformers' order and rules (:mod:`.sampling`). PyTorch's generators
advance their offsets once per graph replay, not per iteration of a WHILE
body, so the loop draws from a counter-based stream instead: the random number
of a token is a function of ``(seed, sequence, position)``, the position
being the loop's device tensor. A seed therefore gives the same tokens
whatever the chunk size and the strategy. The settings live in device buffers
written per generation; greedy and sampling bodies are captured separately
(switching recaptures the loop), so greedy decoding pays nothing for sampling.
The same holds for the filters: a body is captured for the filters that are on
(top-k, top-p, and top-k's ``topk`` window, a power of two), so plain
temperature sampling does no work for them; changing a filter's value within
its window needs no capture, turning one on or off does. On a GPU the draw is
one Triton kernel over the logits (:mod:`._philox_triton`, compiled and loaded
before the capture), the same tokens as the torch reference. A greedy body
chooses with :func:`.sampling.greedy`: ``argmax``'s tokens from one Triton
kernel that spreads each row over up to 64 programs (loaded by the warm-up;
torch's argmax where there is none: ``warmup_iters=0``, no triton, a CPU).

Ragged batches: ``position`` may be one position per sequence, a ``(batch_size,)``
tensor (left-padded prompts of different lengths); the step then receives a
``(batch_size,)`` position tensor, every entry advancing by one per step, and
sequence ``i``'s random numbers are indexed by its own position. The loop keeps
a step counter (what the fused WHILE step advances) and adds the per-sequence
offsets to it in the body: one small kernel per step. A ragged body is captured
apart from a scalar one, as a sampling body is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..checks import check_int, check_token_ids
from ..conditional import DeviceWhileLoop, LoopCondition
from ..conditional.kernels import DECODE_STEP_MAX_BATCH, MAX_EOS_IDS
from ..conditional.loop import LOOP_STRATEGIES
from ..conditional.native_nodes import NativeConditional
from ..tree import describe
from .sampling import SamplingParams, draw_filtered, filter_flags, greedy, prepare_fused, seed_key, top_k_window

__all__ = ["DeviceDecodeLoop", "BodyKind"]

EosIds = int | Sequence[int] | torch.Tensor | None
"""An EOS id as transformers takes it: an int, a list or tuple of ints, an integer tensor (or None)."""

Position = int | torch.Tensor
"""Where a generation starts: an int or a 0-dim integer tensor (every sequence), or a ``(batch_size,)``
integer tensor (one position per sequence: left-padded prompts of different lengths)."""


@dataclass(frozen=True)
class BodyKind:
    """What a captured body does, fixed on the host when it is captured (a generation of another kind
    captures the loop again; the values of the settings live in device buffers and need no capture).

    ``sampling``: draw (else argmax); ``top_k``/``top_p``: that filter is on (sampling only: it may
    remove tokens, so its work over the vocabulary runs); ``k_window``: top-k's ``topk`` window
    (:func:`.sampling.top_k_window`: a power of two, so values of k in one window share the body;
    None: a sort); ``ragged``: one position per sequence."""

    sampling: bool = False
    top_k: bool = False
    top_p: bool = False
    ragged: bool = False
    k_window: int | None = None

    @classmethod
    def of(cls, do_sample: bool, top_k: int | None, top_p: float | None, ragged: bool) -> BodyKind:
        use_k, use_p = filter_flags(top_k, top_p) if do_sample else (False, False)
        return cls(do_sample, use_k, use_p, ragged, top_k_window(top_k) if use_k else None)


_IDS_ONLY = ("do_sample=True: expected a step that returns (batch_size, vocab) logits; this step returns token "
             "ids (greedy only)")
_COL, _LIMIT, _ALIVE = 0, 1, 2  # the control tensor: steps run this launch, steps allowed, any sequence going
_STATE = ("tokens", "position", "out", "control", "unfinished", "go")


class DeviceDecodeLoop:
    """Greedy decoding of ``batch_size`` sequences, ``chunk`` steps per graph launch; see the module docstring.

    Args:
        step: ``step(tokens, position) -> next_tokens``: ``tokens`` a ``(batch_size,)`` long
            tensor (the last token of each sequence), ``position`` a 0-dim long tensor (its
            position, the same for every sequence) or, in a generation given one position per
            sequence, a ``(batch_size,)`` long tensor; returns ``(batch_size,)`` integer token ids,
            or ``(batch_size, vocab)`` floating logits (the loop then chooses: greedy or sampled).
        batch_size: the number of sequences (fixed: the loop's buffers are static).
        chunk: the most steps one launch runs (the cap of the WHILE loop).
        device: where the step's tensors live (default: the current CUDA device, else CPU).
        strategy: ``"auto"``, ``"native"`` or ``"host"`` (see :class:`DeviceWhileLoop`).
        warmup_iters: eager runs of the step before capture.

    Memory: the buffers are ``batch_size * (chunk + 4)`` longs and a few scalars; the
    step's own allocations live in the loop graph's pool for its lifetime. Launches
    are serialised by a lock; one generation runs at a time (a new one ends the last).
    """

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, batch_size: int,
                 chunk: int = 64, device: torch.device | str | None = None, strategy: str = "auto",
                 warmup_iters: int = 1) -> None:
        if not callable(step):
            raise TypeError(f"step: expected a callable (tokens, position) -> next tokens, got {type(step).__name__}")
        check_int("batch_size", batch_size, minimum=1)
        check_int("chunk", chunk, minimum=1)
        if strategy not in LOOP_STRATEGIES:
            raise ValueError(f"strategy: expected one of {', '.join(LOOP_STRATEGIES)}, got {strategy!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        self.step = step
        self.batch_size = batch_size
        self.chunk = chunk
        self.launches = 0  # graph launches (host strategy: launches of the loop, one replay per step)
        long = dict(dtype=torch.long, device=dev)
        # set per generation: MAX_EOS_IDS EOS ids (-1, which no token matches, in unused slots), then the pad id
        self._eos_pad = torch.full((MAX_EOS_IDS + 1,), -1, **long)
        self._nxt: torch.Tensor | None = None  # the step's output in the captured body (the fused step reads it)
        self._fused = batch_size <= DECODE_STEP_MAX_BATCH
        state = (torch.zeros(batch_size, **long), torch.zeros((), **long), torch.zeros(batch_size, chunk, **long),
                 torch.tensor([0, chunk, 1], **long), torch.ones(batch_size, dtype=torch.bool, device=dev),
                 torch.ones((), dtype=torch.bool, device=dev))
        self._loop = DeviceWhileLoop(LoopCondition(_STATE.index("go"), "nonzero"), self._body, state,
                                     max_iters=chunk, strategy=strategy, copy_outputs=False,  # type: ignore[arg-type]
                                     warmup_iters=warmup_iters,
                                     native_step=self._native_step if self._fused else None)
        # sampling's settings, written per generation (the captured body reads them): the Philox key, the
        # temperature, top-k's k, top-p's removal threshold, and each row's sequence index
        self._key = torch.zeros(2, **long)
        self._temperature = torch.ones((), dtype=torch.float32, device=dev)
        self._top_k = torch.zeros((), **long)
        self._top_p_cut = torch.full((), -1.0, dtype=torch.float32, device=dev)
        self._sequences = torch.arange(batch_size, **long)
        # ragged generations: each sequence's position is the step counter plus its offset (written per
        # generation); the sum goes to a static buffer the step reads
        self._offsets = torch.zeros(batch_size, **long)
        self._row_position = torch.zeros(batch_size, **long)
        self._kind = BodyKind()  # the body captured (or to capture)
        self.returns_logits: bool | None = None  # what the step returned at the capture (None before it)
        self._lock = threading.Lock()
        self._generation = 0  # which chunks() iterator may launch

    @property
    def strategy(self) -> str:
        """The loop's strategy: ``native``, ``host``, ``eager``, or ``pending`` before the capture."""
        return self._loop.strategy

    @property
    def strategy_reason(self) -> str:
        return self._loop.strategy_reason

    @property
    def _sampling(self) -> bool:
        return self._kind.sampling

    def _body(self, tokens: torch.Tensor, position: torch.Tensor, out: torch.Tensor, control: torch.Tensor,
              unfinished: torch.Tensor, go: torch.Tensor) -> None:
        kind = self._kind
        # (B,) per-sequence positions, or the 0-dim counter shared by every sequence
        pos = torch.add(self._offsets, position, out=self._row_position) if kind.ragged else position
        nxt = self.step(tokens, pos)
        if isinstance(nxt, torch.Tensor) and nxt.is_floating_point() and nxt.dim() == 2 \
                and nxt.shape[0] == self.batch_size:
            self.returns_logits = True
            if kind.sampling:
                nxt = draw_filtered(nxt, self._temperature, self._top_k, self._top_p_cut, self._key,
                                    self._sequences, pos, use_top_k=kind.top_k, use_top_p=kind.top_p,
                                    k_window=kind.k_window)
            else:
                nxt = greedy(nxt)
        elif not isinstance(nxt, torch.Tensor) or nxt.numel() != self.batch_size or nxt.is_floating_point():
            raise TypeError(f"step: expected {self.batch_size} integer token ids or ({self.batch_size}, vocab) "
                            f"logits, got {describe(nxt)}")
        else:
            self.returns_logits = False
            if kind.sampling:
                raise ValueError(_IDS_ONLY)
        if self._fused and self._loop.strategy == "native":  # the bookkeeping is the WHILE step's kernel
            self._nxt = nxt.reshape(self.batch_size).long().contiguous()
            return
        eos, pad = self._eos_pad[:MAX_EOS_IDS], self._eos_pad[MAX_EOS_IDS]
        nxt = torch.where(unfinished, nxt.reshape(self.batch_size).long(), pad)
        unfinished.logical_and_((nxt.view(-1, 1) != eos).all(dim=1))
        col = control[_COL:_COL + 1]
        out.index_copy_(1, col, nxt.view(self.batch_size, 1))  # column chosen on the device: no host read
        tokens.copy_(nxt)
        position.add_(1)
        col.add_(1)
        control[_ALIVE:_ALIVE + 1].copy_(unfinished.any().view(1))
        torch.logical_and(control[_COL] < control[_LIMIT], control[_ALIVE] != 0, out=go)

    def _native_step(self, native: NativeConditional, handle: int, first: bool) -> None:
        """The native loop's WHILE step: before the loop, the host-set ``go``; after each body one kernel
        does the torch path's dozen (EOS, output column, feedback, position, the stop test)."""
        tokens, position, out, control, unfinished, go = self._loop.state
        if first:
            native.launch_set_if(handle, go)
            return
        assert self._nxt is not None
        native.launch_decode_step(handle, nxt=self._nxt, tokens=tokens, out=out, control=control,
                                  position=position, unfinished=unfinished, eos_pad=self._eos_pad)

    def capture(self, *, do_sample: bool = False, top_k: int | None = None, top_p: float | None = None,
                ragged: bool = False) -> None:
        """Capture the loop now for one kind of generation (otherwise the first generation does, at its
        own tokens and position; a generation of another kind captures again): greedy or sampled,
        with the top-k and top-p filters on where ``top_k``/``top_p`` say so (their values are set
        per generation), and one position per sequence with ``ragged=True``. It runs the step
        ``warmup_iters`` times (twice per stream on the native path), so a step whose state
        advances on every run (transformers 5's ``StaticCache`` keeps its own write position) must
        have it reset afterwards: capture first, then reset and prefill."""
        for name, flag in (("do_sample", do_sample), ("ragged", ragged)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {flag!r}")
        SamplingParams(do_sample, 1.0, top_k, top_p)  # the settings checked as a generation checks them
        kind = BodyKind.of(do_sample, top_k, top_p, ragged)
        with self._lock:
            if do_sample and self.returns_logits is False:
                raise ValueError(_IDS_ONLY)
            if kind != self._kind:
                self._generation += 1  # a live iterator must not go on with the other body
            self._use_body(kind)
            self._restart_column()
            self._prepare_kernels()
            self._loop.capture()  # idempotent: nothing when this body is captured already

    def _restart_column(self) -> None:
        """The output column back to 0 and the limit to a chunk: a capture warms up on the state, and the
        body writes column ``control[_COL]`` (after a generation it may sit at the end of the buffer)."""
        control = self._loop.state[_STATE.index("control")]
        with torch.no_grad():
            control[_COL] = 0
            control[_LIMIT] = self.chunk

    def captured_for(self, do_sample: bool, *, top_k: int | None = None, top_p: float | None = None,
                     ragged: bool = False) -> bool:
        """Whether the loop's graph is captured (or runs eagerly) with the body for this kind of generation
        (the arguments as :meth:`capture` takes them): a generation of this kind then runs no warm-up of
        the step."""
        return BodyKind.of(do_sample, top_k, top_p, ragged) == self._kind and self._loop.strategy != "pending"

    @property
    def body_kind(self) -> BodyKind:
        """The kind of generation the loop's body is (or will be) captured for."""
        return self._kind

    def _use_body(self, kind: BodyKind) -> None:
        """Make the loop's body the one for ``kind`` (dropping a capture of another)."""
        if kind != self._kind:
            self._loop.close()
            self._nxt = None
            self._kind = kind

    def _prepare_kernels(self) -> None:
        """Compile and load, before a capture, what the body launches that a capture could not load: the
        sampling body's Triton kernels, the fused top-k kernel of its window included, for float32, bf16
        and fp16 logits (the warm-ups would compile the one used; this does not depend on their number:
        ``warmup_iters=0`` is safe; each variant is compiled once per machine, then read from triton's
        cache)."""
        kind = self._kind
        if kind.sampling and self._loop.strategy == "pending":
            prepare_fused(self._eos_pad.device, k_window=kind.k_window, top_p=kind.top_p)

    def chunks(self, tokens: torch.Tensor, position: Position, *, max_new_tokens: int, eos_token_id: EosIds = None,
               pad_token_id: int | None = None, unfinished: torch.Tensor | None = None, do_sample: bool = False,
               temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None) -> Iterator[torch.Tensor]:
        """Feed ``tokens`` at ``position`` and yield the next tokens, one ``(batch_size, k)`` tensor per
        launch (``k <= chunk``), until ``max_new_tokens`` or every sequence has ended.

        ``position``: an int >= 0 or a 0-dim integer tensor (every sequence's), or a ``(batch_size,)``
        integer tensor, one per sequence (a ragged batch: the step then gets ``(batch_size,)``
        positions; the values of a tensor are not checked on the host, which would cost a sync).

        A sequence ends when it produces ``eos_token_id`` (an int, or up to
        ``MAX_EOS_IDS`` = 8 ids as a list, tuple or integer tensor: any of them) and
        gets ``pad_token_id`` (default: the first EOS id) from then on; ``unfinished`` (a ``(batch_size,)`` bool
        tensor, with an EOS id) marks the sequences still going on entry (default:
        all). Each yielded tensor is a copy (one kernel). Native strategy: the host
        reads three numbers per launch; host strategy: one per step.

        ``do_sample=True`` (a step that returns logits) draws each token as
        ``generate(do_sample=True)`` does, with ``temperature``, ``top_k`` and
        ``top_p`` in transformers' order; ``seed`` (default: drawn from torch's
        generator) fixes the tokens: the token of sequence ``i`` generated after
        position ``p`` (its own, in a ragged batch) uses the stream's number at ``(seed, i, p)``.

        Arguments are checked and the state loaded now, not at the first ``next()``.
        One generation at a time: a later :meth:`chunks` or :meth:`generate` on the
        same loop reloads the state, and an earlier iterator then raises ``RuntimeError``.
        """
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        ragged = self._check_position(position)
        eos = () if eos_token_id is None else check_token_ids("eos_token_id", eos_token_id)
        if len(eos) > MAX_EOS_IDS:
            raise ValueError(f"eos_token_id: expected at most {MAX_EOS_IDS} ids (the device step compares with "
                             f"that many), got {len(eos)}")
        if pad_token_id is not None:
            check_int("pad_token_id", pad_token_id)
        if not eos and (pad_token_id is not None or unfinished is not None):
            what = "pad_token_id" if pad_token_id is not None else "unfinished"
            raise ValueError(f"{what}: expected together with eos_token_id (without an EOS no sequence ends)")
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        params = SamplingParams(do_sample, temperature, top_k, top_p, seed).with_seed() if do_sample \
            else SamplingParams(do_sample, temperature, top_k, top_p, seed)
        with self._lock:
            if do_sample and self.returns_logits is False:  # known from an earlier capture: refuse before any change
                raise ValueError(_IDS_ONLY)
            self._generation += 1  # from here the state changes: an earlier iterator is superseded
            self._use_body(BodyKind.of(do_sample, params.top_k, params.top_p, ragged))  # the _load below captures it
            self._load(tokens, position, unfinished)
            if do_sample and self.returns_logits is False:
                raise ValueError(_IDS_ONLY)
            if do_sample:  # after the checks: a refused call leaves the settings as they were
                self._key.copy_(seed_key(params.seed or 0, "cpu"))
                self._temperature.fill_(params.temperature)
                self._top_k.fill_(2**62 if params.top_k is None else params.top_k)
                self._top_p_cut.fill_(-1.0 if params.top_p is None or params.top_p >= 1.0 else 1.0 - params.top_p)
            self._eos_pad.copy_(torch.tensor([*eos, *[-1] * (MAX_EOS_IDS - len(eos)), pad]))
            return self._iterate(self._generation, max_new_tokens)

    def _iterate(self, ticket: int, max_new_tokens: int) -> Iterator[torch.Tensor]:
        done, alive = 0, True
        while done < max_new_tokens and alive:
            with self._lock:  # held per launch, never across a yield
                if ticket != self._generation:
                    raise RuntimeError("DeviceDecodeLoop: this chunks() iterator was superseded by a later "
                                       "generation on the same loop (the state was reloaded); run one at a time")
                n, alive = self._launch(min(self.chunk, max_new_tokens - done))
                part = self._loop.state[_STATE.index("out")][:, :n].clone() if n else None
            done += n
            if part is not None:
                yield part

    def generate(self, tokens: torch.Tensor, position: Position, *, max_new_tokens: int, eos_token_id: EosIds = None,
                 pad_token_id: int | None = None, unfinished: torch.Tensor | None = None, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None) -> torch.Tensor:
        """All of :meth:`chunks` as one ``(batch_size, n)`` tensor, ``n <= max_new_tokens``."""
        parts = list(self.chunks(tokens, position, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                 pad_token_id=pad_token_id, unfinished=unfinished, do_sample=do_sample,
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
        if not parts:
            return torch.empty(self.batch_size, 0, dtype=torch.long, device=self._eos_pad.device)
        return torch.cat(parts, dim=1)

    def _check_position(self, position: Any) -> bool:
        """Check a generation's ``position``; True when it gives one position per sequence."""
        if not isinstance(position, torch.Tensor):
            check_int("position", position)
            return False
        if position.is_floating_point() or position.is_complex() or position.dtype == torch.bool \
                or position.shape not in ((), (self.batch_size,)):
            raise ValueError(f"position: expected an int >= 0, a 0-dim integer tensor or ({self.batch_size},) "
                             f"integer positions (one per sequence), got {describe(position)}")
        return position.dim() == 1

    def _load(self, tokens: torch.Tensor, position: Position, unfinished: torch.Tensor | None) -> None:
        tok, pos, _, _, alive, _ = self._loop.state
        _check_vector("tokens", tokens, tok, integer=True)
        if unfinished is not None:
            _check_vector("unfinished", unfinished, alive, integer=False)
        ragged = self._check_position(position)
        if ragged != self._kind.ragged:
            raise RuntimeError(f"DeviceDecodeLoop: a {'ragged' if ragged else 'scalar'} position with a body "
                               f"captured for {self._kind}; chunks() chooses the body first")
        with torch.no_grad():
            tok.copy_(tokens.reshape(self.batch_size))
            if ragged:  # the counter from 0, each sequence's start in its offset
                pos.zero_()
                self._offsets.copy_(position)
            elif isinstance(position, torch.Tensor):
                pos.copy_(position)
            else:
                pos.fill_(position)
            alive.copy_(True if unfinished is None else unfinished)
        self._restart_column()  # a capture below warms up on this state
        if self._loop.strategy == "pending":
            self._prepare_kernels()
            # after the load: the warm-up runs the step at this generation's own position (a KV cache
            # written there is overwritten by the first real step) and puts the loaded state back
            self._loop.capture()

    def _launch(self, limit: int) -> tuple[int, bool]:
        """One launch of at most ``limit`` steps: (steps run, any sequence still going)."""
        _, _, _, control, alive, go = self._loop.state
        with torch.no_grad():
            control[_COL] = 0
            control[_LIMIT] = limit
            torch.any(alive, out=go)  # a batch that has already ended runs no step
            self._loop.run()
            self.launches += 1
            n, _, any_alive = control.tolist()
        return n, bool(any_alive) and n > 0  # no step ran: every sequence had ended

    def close(self) -> None:
        """Release the loop's graph (idempotent); the next generation captures again."""
        with self._lock:
            self._loop.close()
            self._nxt = None

    def __repr__(self) -> str:
        return f"DeviceDecodeLoop(batch_size={self.batch_size}, chunk={self.chunk}, strategy={self.strategy})"


def _check_vector(name: str, value: Any, like: torch.Tensor, *, integer: bool) -> None:
    kind = "integer token ids" if integer else "bools"
    ok = isinstance(value, torch.Tensor) and value.numel() == like.numel() and value.device == like.device and (
        (not value.is_floating_point() and value.dtype != torch.bool) if integer else value.dtype == torch.bool)
    if not ok:
        raise ValueError(f"{name}: expected {like.numel()} {kind} on {like.device}, got {describe(value)}")
