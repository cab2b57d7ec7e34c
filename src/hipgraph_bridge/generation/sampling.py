"""Token sampling with a random stream indexed by (seed, sequence, position), the same on every strategy.

PyTorch's CUDA generator advances its offset once per graph replay, so the
steps of one WHILE-node launch would all draw the same numbers. Sampling here
uses a counter-based generator instead, Philox4x32-10 (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011; the generator behind
cuRAND's and PyTorch's CUDA streams): the random number of a token is a pure
function of ``(seed, sequence, position)``, so a seed gives the same tokens
whatever the chunk size, the strategy (a device loop, a host loop, eager) or
the batch the sequence shares. The functions here are the reference: plain
torch ops on any device, which the eager strategy runs and the device
kernels must reproduce.

On a GPU, :func:`uniform`, :func:`draw` and :func:`draw_filtered` run Triton
kernels (:mod:`._philox_triton`): the same random bits as the reference, which
costs some 300 small kernels; ``fused=False`` forces the reference (what a test
compares a kernel with). Triton is optional: without it (PyTorch's CPU build)
or on a CPU tensor, the reference runs. :func:`prepare_fused` compiles and
loads the kernels ahead of a capture. :func:`greedy` is the greedy choice the
device loop's body makes: ``argmax``'s tokens, on a GPU from one Triton kernel
that spreads a row over up to 64 programs (torch's argmax gives a row of a
large vocabulary few blocks).

A token is drawn as ``generate(do_sample=True)`` draws it, in transformers'
order: the logits divided by ``temperature``, then top-k (every logit below
the k-th largest removed; ties kept), then top-p (the smallest tokens whose
probabilities add up to at most ``1 - top_p`` removed, at least one token
kept), then one token from the softmax of what is left. The draw is the
Gumbel-max form of that softmax: each token ``v`` gets its own uniform number
``u`` (the stream's lane ``v + 1``; lane 0 is :func:`uniform`'s) and the token
with the largest ``score - log(-log(u))`` (float64) is drawn, which is exactly
a draw from the softmax of the scores (Gumbel 1954; Maddison et al., "A* Sampling",
NIPS 2014), in one pass over the logits, as ``argmax`` is.

Top-k with a small k reads the k-th largest logit from ``topk`` over a window
of at least k (a power of two, :func:`top_k_window`) instead of a sort of the
vocabulary, and top-p then works on that window: every survivor above the
k-th value is in it, and the tokens tied at the k-th value are counted over
the vocabulary. transformers orders tied tokens by an unstable sort, so which
of several tied tokens top-p removes is not defined there; here the tokens
tied at the k-th value go in vocabulary order (lowest id removed first), and so
do tokens tied above it (the window holds equal scores highest id first, and
top-p removes from the smallest running sum up).
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from ..errors import ConfigError

__all__ = ["FUSED_BY_DEFAULT", "WINDOW_MAX", "SamplingParams", "philox4x32", "uniform", "seed_key", "filter_logits",
           "filter_tensors", "filter_scores", "filter_flags", "top_k_window", "draw", "draw_filtered", "chooser",
           "sample_tokens", "greedy", "fused_unavailable_reason", "prepare_fused"]

FUSED_BY_DEFAULT = True
"""What ``fused=None`` does on a GPU where triton imports (:func:`uniform`, :func:`draw`,
:func:`draw_filtered`): the Triton kernels (True) or the torch reference (False: a switch for the whole
process, e.g. to rule the kernels out while debugging; read at each call, so set it before a loop captures
its body)."""

_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments (golden ratio, sqrt(3) - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen; checked when made (``ConfigError`` names what was expected).

    ``do_sample=False`` is greedy (``argmax``) and ignores the rest. ``seed``:
    the stream's key (any int in [0, 2**64)); None draws one from torch's
    default generator when the generation starts.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ConfigError(f"do_sample: expected a bool, got {self.do_sample!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ConfigError(f"temperature: expected a finite number > 0, got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ConfigError(f"top_k: expected None or an int >= 0 (0: off, as in transformers), got {k!r}")
        if k == 0:
            object.__setattr__(self, "top_k", None)
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ConfigError(f"top_p: expected None or a number in (0, 1], got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**64):
            raise ConfigError(f"seed: expected None or an int in [0, 2**64), got {s!r}")

    def with_seed(self) -> SamplingParams:
        """These parameters with a seed (drawn from torch's default CPU generator when there is none)."""
        if self.seed is not None:
            return self
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        return SamplingParams(self.do_sample, self.temperature, self.top_k, self.top_p, seed)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a * b`` for a 32-bit constant ``a`` and 32-bit words ``b`` in int64
    (split in 16-bit halves: every partial product fits int64)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    p_lo = b * a_lo  # < 2**48
    p_hi = b * a_hi  # < 2**48
    mid = ((p_hi & 0xFFFF) << 16) + p_lo  # < 2**49
    lo = mid & _MASK
    hi = (p_hi >> 16) + (mid >> 32)
    return hi & _MASK, lo


def philox4x32(counter: torch.Tensor, key: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """Philox4x32-``rounds`` of ``counter`` (``(..., 4)`` 32-bit words in int64) under ``key``
    (``(..., 2)``, broadcast against it): four 32-bit words per counter, in int64."""
    c0, c1, c2, c3 = (counter[..., i].to(torch.int64) & _MASK for i in range(4))
    k0 = key[..., 0].to(torch.int64) & _MASK
    k1 = key[..., 1].to(torch.int64) & _MASK
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def uniform(seed: int | torch.Tensor, sequence: torch.Tensor, position: torch.Tensor, *,
            fused: bool | None = None) -> torch.Tensor:
    """The uniform number in [0, 1) (float64, 53 bits) of each ``(sequence, position)`` under ``seed``
    (an int, or its :func:`seed_key` on the device: a captured graph reads the key from a buffer).

    The counter is ``(position, sequence, position >> 32, 0)`` and the key the seed's two 32-bit
    halves; ``sequence`` and ``position`` broadcast against each other (int tensors, any device).

    ``fused``: None (default) runs the one-kernel Triton form on a CUDA device where triton
    imports (unless :data:`FUSED_BY_DEFAULT` is False) and the torch reference elsewhere; False
    forces the reference; True demands the kernel (``RuntimeError`` naming why it cannot run).
    Both give the same bits.
    """
    seq, pos = torch.broadcast_tensors(sequence.to(torch.int64), position.to(torch.int64))
    key = seed_key(seed, seq.device) if isinstance(seed, int) else seed
    if _fused_wanted(key, fused, "uniform"):
        if seq.device != key.device:
            raise ValueError(f"uniform: expected sequence and position on the key's device {key.device}, "
                             f"got {seq.device}")
        return _fused_module().uniform_fused(key.to(torch.int64), seq, pos)
    return _reference_uniform(key, seq, pos, torch.zeros_like(seq))


def _reference_uniform(key: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """The uniform numbers of counters ``(position low word, sequence, position high word, lane)`` under
    ``key``, in torch ops: 27 bits of Philox's word 0 and 26 of word 1, scaled by 2**-53."""
    seq, pos, lane = torch.broadcast_tensors(seq, pos, lane)
    counter = torch.stack((pos & _MASK, seq & _MASK, (pos >> 32) & _MASK, lane & _MASK), dim=-1)
    words = philox4x32(counter, key)
    a = (words[..., 0] >> 5).to(torch.float64)  # 27 bits
    b = (words[..., 1] >> 6).to(torch.float64)  # 26 bits
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)


def _fused_wanted(key: torch.Tensor, fused: bool | None, caller: str) -> bool:
    """Whether ``caller`` runs its Triton kernel for ``key``: None picks it on a CUDA (or ROCm) device where
    triton imports (unless :data:`FUSED_BY_DEFAULT` is False); True demands it (``RuntimeError`` naming why
    it cannot run)."""
    if fused is None:
        return (FUSED_BY_DEFAULT and key.device.type == "cuda" and key.shape == (2,)
                and _load_fused()[0] is not None)
    if fused:
        why = fused_unavailable_reason() if key.device.type == "cuda" else f"the tensors are on {key.device}"
        if why is None and key.shape != (2,):
            why = f"it takes one (2,) key (seed_key), got a key of shape {tuple(key.shape)}"
        if why is not None:
            raise RuntimeError(f"{caller}(fused=True): the Triton kernel cannot run: {why}; fused=None picks the "
                               "torch reference then")
    return fused


@functools.cache
def _load_fused() -> tuple[ModuleType | None, str | None]:
    """The Triton kernel's module, or why it cannot be had; imported once, on the first CUDA call.

    Imported here, not at the top: triton ships with PyTorch's CUDA and ROCm builds only, and its
    import (some hundreds of milliseconds) is not for ``import gfxgraph`` to pay."""
    try:
        return importlib.import_module("._philox_triton", __package__), None
    except ImportError as exc:
        return None, f"triton does not import ({type(exc).__name__}: {exc})"


def _fused_module() -> ModuleType:
    module, why = _load_fused()
    if module is None:
        raise RuntimeError(f"the fused Philox kernel needs triton: {why}")
    return module


def fused_unavailable_reason() -> str | None:
    """None where the Triton kernels can run (CUDA/ROCm tensors), else why not."""
    if not torch.cuda.is_available():
        return "no GPU (torch.cuda.is_available() is False)"
    return _load_fused()[1]


def prepare_fused(device: torch.device | str, *, k_window: int | None = None, top_p: bool = False,
                  dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)) -> bool:
    """Compile and load the Triton kernels for ``device`` now, so that no capture pays (or fails on) them:
    the random numbers' and the draw's for logits of each of ``dtypes``, and with ``k_window``
    (:func:`top_k_window`) the fused top-k kernel of that window, top-p on or off (each is its own
    compile; triton keeps them in its cache folder, so a later process loads them). Returns whether the
    kernels will run there."""
    dev = torch.device(device)
    if not FUSED_BY_DEFAULT or dev.type != "cuda" or fused_unavailable_reason() is not None:
        return False
    _fused_module().prepare(dev, k_window=k_window, top_p=top_p, dtypes=dtypes)
    return True


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """``logits`` (``(batch, vocab)``) after temperature, top-k and top-p, in transformers' order and
    rules; removed tokens hold ``-inf``. Float32 (as transformers computes them)."""
    use_top_k, use_top_p = filter_flags(top_k, top_p)
    return filter_scores(logits, *filter_tensors(temperature, top_k, top_p, logits.shape[-1], logits.device),
                         use_top_k=use_top_k, use_top_p=use_top_p, k_window=top_k_window(top_k))


def filter_flags(top_k: int | None, top_p: float | None) -> tuple[bool, bool]:
    """Which filters can remove a token: ``(top-k on, top-p on)``. Off (None, or ``top_p >= 1``) a filter
    removes nothing, so :func:`filter_scores` may leave it out, with its work over the vocabulary."""
    return top_k is not None and top_k > 0, top_p is not None and top_p < 1.0


def filter_tensors(temperature: float, top_k: int | None, top_p: float | None, vocab: int,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filters' settings as the 0-dim tensors :func:`filter_scores` reads (a captured loop keeps them
    in buffers, so one graph serves every value): the temperature (float32), top-k's k (long; the
    vocabulary size when off) and top-p's removal threshold ``1 - top_p`` (float32, rounded from float64
    as transformers' comparison with a Python float rounds it; -1 when off: nothing is removed)."""
    t = torch.tensor(float(temperature), dtype=torch.float32, device=device)
    k = torch.tensor(vocab if top_k is None else min(top_k, vocab), dtype=torch.long, device=device)
    cut = torch.tensor(-1.0 if top_p is None or top_p >= 1.0 else 1.0 - top_p, dtype=torch.float32, device=device)
    return t, k, cut


WINDOW_MAX = 128
"""The largest top-k window (:func:`top_k_window`): a larger k sorts the vocabulary once. The fused
kernel's last program holds 32 lists of the window's size (int64 keys) and merges them: a larger window
would spill its registers."""


def top_k_window(top_k: int | None) -> int | None:
    """The ``topk`` window that serves a top-k of ``top_k``: the power of two >= k (at least 16, so that
    nearby values of k share a captured body), or None (no top-k, or k above :data:`WINDOW_MAX`: a sort)."""
    if top_k is None or top_k <= 0 or top_k > WINDOW_MAX:
        return None
    return max(16, 1 << (top_k - 1).bit_length())


def filter_scores(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p_cut: torch.Tensor, *, use_top_k: bool = True, use_top_p: bool = True,
                  k_window: int | None = None) -> torch.Tensor:
    """:func:`filter_logits` with its settings as device tensors (:func:`filter_tensors`): no host read,
    so it runs inside a captured graph; every strategy draws through it.

    ``use_top_k``/``use_top_p`` (host flags, :func:`filter_flags`) leave a filter out, with its work over
    the vocabulary: a filter that is off (k = the vocabulary, cut = -1) removes nothing, so leaving it
    out gives the same scores bit for bit; the flags only say which settings may remove tokens.

    ``k_window`` (an int >= the k in ``top_k``, :func:`top_k_window`): top-k reads the k-th value from
    ``topk`` over that many tokens, and top-p works on them (see :func:`_window_top_p`), instead of a
    sort of the vocabulary. Without it, top-k and top-p share one sort (top-k on its own sorts too).
    The k-th value is the same either way; top-p's sums are added in another order (the same tokens
    removed but where a sum lies within rounding of the cut) and its ties at the k-th value go in
    vocabulary order."""
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    rows = scores.shape[0]
    if use_top_k and k_window is not None and k_window < vocab:
        window, index = scores.topk(k_window, dim=-1)  # descending
        k = (top_k - 1).clamp(min=0, max=k_window - 1)
        kth = window.gather(-1, k.view(1, 1).expand(rows, 1))
        if not use_top_p:
            return scores.masked_fill(scores < kth, -math.inf)
        window, index = _window_by_id(window, index)  # top-p removes equal scores in a fixed order
        return scores.masked_fill(_window_top_p(scores, window, index, kth, top_p_cut), -math.inf)
    if not use_top_p:
        if use_top_k:
            descending = scores.sort(dim=-1, descending=True).values
            k = (top_k - 1).clamp(min=0, max=vocab - 1)  # a k above the vocabulary keeps every token
            kth = descending.gather(-1, k.view(1, 1).expand(rows, 1))
            scores = scores.masked_fill(scores < kth, -math.inf)
        return scores
    ascending, order = torch.sort(scores, dim=-1, descending=False)
    if use_top_k:  # the sorted top-k-filtered scores are the sorted scores with the same tokens removed
        k = (top_k - 1).clamp(min=0, max=vocab - 1)
        kth = ascending.gather(-1, (vocab - 1 - k).view(1, 1).expand(rows, 1))
        scores = scores.masked_fill(scores < kth, -math.inf)
        ascending = ascending.masked_fill(ascending < kth, -math.inf)
    remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= top_p_cut
    remove[..., -1:] = False  # at least one token stays
    return scores.masked_fill(remove.scatter(-1, order, remove), -math.inf)


def _window_by_id(window: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk``'s window (descending) with equal scores highest id first (``topk`` leaves their order
    undefined; the kernel's window has this order), -0.0 read as 0.0 (they compare equal)."""
    window = window + 0.0  # -0.0 + 0.0 is 0.0: a sort by value must not part equal scores
    by_id = index.argsort(dim=-1, descending=True)
    window, index = window.gather(-1, by_id), index.gather(-1, by_id)
    window, order = window.sort(dim=-1, descending=True, stable=True)
    return window, index.gather(-1, order)


def _window_top_p(scores: torch.Tensor, window: torch.Tensor, index: torch.Tensor, kth: torch.Tensor,
                  cut: torch.Tensor) -> torch.Tensor:
    """Which tokens top-k and then top-p remove, from ``topk``'s ``window`` (descending, equal scores
    highest id first: :func:`_window_by_id`) and ``index`` and the k-th value ``kth`` (``(rows, 1)``):
    a ``(rows, vocab)`` bool mask.

    The survivors of top-k are the tokens >= ``kth``. Those above it number fewer than k, so all are in
    the window; those equal to it (``m`` of them) may not be, and are counted over the vocabulary.
    transformers' top-p adds the survivors' probabilities from the smallest up and removes each token
    whose running sum is <= ``cut``: the ``m`` tied tokens come first (the j-th removed when
    ``j * p_kth <= cut``; here in vocabulary order), then the window's tokens above ``kth``, whose
    running sums are ``m * p_kth`` plus a suffix sum of the window. The largest token always stays."""
    above = window > kth
    ties = scores == kth
    m = ties.sum(dim=-1, keepdim=True)
    top = window[:, :1]
    e_above = torch.exp(window - top).masked_fill(~above, 0.0)
    e_tie = torch.exp(kth - top)
    z = e_above.sum(dim=-1, keepdim=True) + m * e_tie
    p_tie = e_tie / z
    running = m * p_tie + (e_above / z).flip(-1).cumsum(dim=-1).flip(-1)
    gone_above = above & (running <= cut)
    gone_above[:, :1] = False  # the largest token (above the k-th value or not, it is never removed)
    # ties removed: the j with j * p_tie <= cut; if none is above (the largest is tied), one tie stays
    # (tokens tied at -inf have p_tie 0: the quotient is inf, clamped before the cast; all go, as they would)
    fit = torch.floor(cut / p_tie).clamp(min=0, max=scores.shape[-1]).long()
    gone_ties = torch.minimum(fit, m - (~above[:, :1]).long()).clamp(min=0)
    rank = ties.long().cumsum(dim=-1)  # 1 for the first tied token in vocabulary order
    removed = (scores < kth) | (ties & (rank <= gone_ties))
    return removed | torch.zeros_like(removed).scatter(-1, index, gone_above)


def draw_filtered(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p_cut: torch.Tensor,
                  seed: int | torch.Tensor, sequence: torch.Tensor, position: torch.Tensor, *, use_top_k: bool,
                  use_top_p: bool, k_window: int | None, fused: bool | None = None) -> torch.Tensor:
    """:func:`filter_scores` then :func:`draw`: the token of each row of ``logits`` (``(batch, vocab)``),
    the settings as :func:`filter_tensors` makes them. Long, ``(batch,)``. Every strategy chooses
    through it.

    On a GPU (``fused`` as :func:`draw` takes it) with top-k in a window, the temperature, the window's
    top-k, the filters and the draw are one Triton kernel (:func:`._philox_triton.topk_draw_fused`): the
    same tokens but where a top-p running sum lies within float32 rounding of the cut (the sums are
    added in another order). With the temperature alone, the draw's kernel divides the logits as it
    reads them: the same tokens. Otherwise :func:`filter_scores`' torch ops and :func:`draw`."""
    key = seed_key(seed, logits.device) if isinstance(seed, int) else seed
    _same_device("draw_filtered", logits, key, sequence, position)
    vocab = logits.shape[-1]
    if (use_top_k and k_window is not None and k_window < vocab) or not (use_top_k or use_top_p):
        if _fused_wanted(key, fused, "draw_filtered"):
            seq, pos = sequence.to(torch.int64), position.to(torch.int64)
            if not use_top_k:  # the temperature alone: divided inside the draw's kernel
                return _fused_module().gumbel_max_fused(logits, key.to(torch.int64), seq, pos,
                                                        temperature=temperature)
            return _fused_module().topk_draw_fused(logits, temperature, top_k, top_p_cut, key.to(torch.int64), seq,
                                                   pos, window=k_window, top_p=use_top_p)
    scores = filter_scores(logits, temperature, top_k, top_p_cut, use_top_k=use_top_k, use_top_p=use_top_p,
                           k_window=k_window)
    return draw(scores, key, sequence, position, fused=fused)


def _same_device(caller: str, scores: torch.Tensor, key: torch.Tensor, sequence: torch.Tensor,
                 position: torch.Tensor) -> None:
    """A copy to the device inside a captured body would fail late (or sync): refuse it now."""
    for name, t in (("the key", key), ("sequence", sequence), ("position", position)):
        if t.device != scores.device:
            raise ValueError(f"{caller}: expected {name} on the logits' device {scores.device}, got {t.device}")


_GREEDY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def greedy(logits: torch.Tensor, *, fused: bool | None = None) -> torch.Tensor:
    """The greedy token of each row of ``logits`` (``(batch, vocab)``): ``logits.argmax(dim=-1)``, the same
    tokens bit for bit (the first of the largest values; a NaN counts as the largest, the first NaN wins).
    Long, ``(batch,)``.

    ``fused=None``: on a GPU, for float32, bf16 or fp16 logits where triton imports, one Triton kernel
    that spreads each row over up to 64 programs (:func:`._philox_triton.argmax_fused`; torch's argmax
    gives a row of a 128k vocabulary few blocks: tens of microseconds at batch 1), except inside a
    capture that would have to load it (the kernel is loaded by the first eager call on such logits: a
    warm-up; until then a capture gets torch's argmax, the same tokens). Elsewhere, or with
    ``fused=False``, torch's argmax. ``fused=True`` demands the kernel (``RuntimeError`` naming why not)."""
    if logits.dim() != 2:
        raise ValueError(f"greedy: expected (batch, vocab) logits, got shape {tuple(logits.shape)}")
    if _greedy_fused_wanted(logits, fused):
        return _fused_module().argmax_fused(logits)
    return logits.argmax(dim=-1)


def _greedy_fused_wanted(logits: torch.Tensor, fused: bool | None) -> bool:
    if fused is False:
        return False
    why = None
    if logits.device.type != "cuda":
        why = f"the logits are on {logits.device}"
    elif logits.dtype not in _GREEDY_DTYPES:
        why = f"it takes float32, bf16 or fp16 logits, got {logits.dtype}"
    elif logits.numel() == 0:
        why = f"it takes a non-empty batch and vocabulary, got shape {tuple(logits.shape)}"
    else:
        why = fused_unavailable_reason()
    if fused is None:
        return FUSED_BY_DEFAULT and why is None and (
            not torch.cuda.is_current_stream_capturing() or _fused_module().argmax_ready(logits))
    if why is None and torch.cuda.is_current_stream_capturing() and not _fused_module().argmax_ready(logits):
        why = ("a capture cannot load it, and no eager call on such logits (device, dtype, alignment) has: run "
               "one first (a warm-up)")
    if why is not None:
        raise RuntimeError(f"greedy(fused=True): the Triton kernel cannot run: {why}; fused=None picks torch's "
                           "argmax then")
    return True


def chooser(params: SamplingParams, vocab: int,
            device: torch.device | str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``params``' token choice as ``choose(logits, sequence, position)``: ``argmax`` without sampling, else
    :func:`draw_filtered` from the stream of ``(params.seed, sequence[i], position[i])``. The settings are
    put on ``device`` here, once: a call copies nothing from the host, so it can run inside a capture.
    Long, ``(batch,)``. ``params`` must carry a seed when it samples (:meth:`SamplingParams.with_seed`)."""
    if not params.do_sample:
        return lambda logits, sequence, position: logits.argmax(dim=-1)
    if params.seed is None:
        raise ConfigError("chooser: expected params with a seed (SamplingParams.with_seed())")
    settings = filter_tensors(params.temperature, params.top_k, params.top_p, vocab, device)
    use_top_k, use_top_p = filter_flags(params.top_k, params.top_p)
    key, window = seed_key(params.seed, device), top_k_window(params.top_k)

    def choose(logits: torch.Tensor, sequence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return draw_filtered(logits, *settings, key, sequence, position, use_top_k=use_top_k, use_top_p=use_top_p,
                             k_window=window)
    return choose


def sample_tokens(logits: torch.Tensor, params: SamplingParams, sequence: torch.Tensor,
                  position: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` (``(batch, vocab)``): greedy, or drawn with ``params`` from the
    stream of ``(params.seed, sequence[i], position[i])`` (:func:`draw_filtered`). Long, ``(batch,)``."""
    if params.do_sample and params.seed is None:
        raise ConfigError("sample_tokens: expected params with a seed (SamplingParams.with_seed())")
    return chooser(params, logits.shape[-1], logits.device)(logits, sequence, position)


def draw(scores: torch.Tensor, seed: int | torch.Tensor, sequence: torch.Tensor, position: torch.Tensor, *,
         fused: bool | None = None) -> torch.Tensor:
    """The token of each row of filtered ``scores`` (``(batch, vocab)``, removed tokens ``-inf``) drawn from
    their softmax with the stream of ``seed`` (an int or its :func:`seed_key`) at ``(sequence[i],
    position[i])`` (int tensors that broadcast to ``(batch,)``). Long, ``(batch,)``.

    Gumbel-max: token ``v`` of row ``i`` gets the uniform number ``u`` of lane ``v + 1`` at that counter,
    and the row's token is the argmax of ``score - log(-log(u))`` in float64 (ties to the lowest token).
    ``fused`` as :func:`uniform` takes it: on a GPU one Triton kernel computes it, else torch ops (a
    ``(batch, vocab)`` Philox: some 300 kernels). Both draw the same tokens: the same bits of ``u`` and
    the same float64 operations (where the two logs round alike: on a GPU, the same libdevice ``log``)."""
    b, vocab = scores.shape
    key = seed_key(seed, scores.device) if isinstance(seed, int) else seed
    _same_device("draw", scores, key, sequence, position)
    seq = sequence.to(torch.int64).reshape(-1, 1)
    pos = position.to(torch.int64).reshape(-1, 1)
    if _fused_wanted(key, fused, "draw"):
        return _fused_module().gumbel_max_fused(scores.float(), key.to(torch.int64), seq, pos)
    lane = torch.arange(1, vocab + 1, dtype=torch.int64, device=scores.device).view(1, vocab)
    seq, pos = (t.expand(b, 1) for t in torch.broadcast_tensors(seq, pos))
    u = _reference_uniform(key.to(torch.int64), seq, pos, lane)
    return (scores.double() - torch.log(-torch.log(u))).argmax(dim=-1)


def seed_key(seed: int, device: torch.device | str) -> torch.Tensor:
    """The Philox key of ``seed``: its two 32-bit halves, a ``(2,)`` long tensor."""
    return torch.tensor([seed & _MASK, (seed >> 32) & _MASK], dtype=torch.int64, device=device)
