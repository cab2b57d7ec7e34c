"""Philox4x32-10 in Triton: the fused forms of :func:`.sampling.uniform` and :func:`.sampling.draw`.

The reference in :mod:`.sampling` builds Philox out of int64 torch ops (32-bit
words emulated in 16-bit halves): about 300 small kernels per call, which a
decode step pays per token. Here one kernel computes, for each ``(sequence,
position)``, the same four rounds' worth of words with 32-bit unsigned
arithmetic (``tl.umulhi`` for the high word of each product) and the same
53-bit float64, bit for bit: every step is integer arithmetic or an exact
float operation (a 27-bit and a 26-bit integer scaled by powers of two).

This module imports triton at its top: :mod:`.sampling` imports it only when a
CUDA tensor asks for a uniform number (triton ships with PyTorch's CUDA and
ROCm builds, not with the CPU build, and its import costs time that ``import
gfxgraph`` should not pay). Nothing here uses triton's own random-number
helpers (private, and their key schedule is theirs): the rounds are written out.

The draw (:func:`gumbel_max_fused`) runs the same rounds once per token of the
vocabulary, adds the Gumbel noise to the scores in float64 and keeps each
block's largest: a step pays one pass over its logits, as ``argmax`` does,
where an inverse-CDF draw pays a softmax, a float64 scan and a search.

Capture: the kernels allocate only on the caller's stream (outputs, the draw's
per-block maxima, the window kernel's tie counts, contiguous copies where a
stride asks: a capture routes them to its pool) and read nothing on the host.
A kernel's JIT compile and module load happen at its first call (the window
kernel's once per window size and per top-p on or off): call :func:`prepare`
(or run the code eagerly once, as a capture's warm-up does) before a capture.
The launches specialise on nothing that differs between a warm-up and the
capture of the same call (sizes and strides are not specialised).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["uniform_fused", "gumbel_max_fused", "window_draw_fused", "prepare"]

# Integer literals above 2**31 are uint32 in triton: the products and sums below wrap at 32 bits,
# as Philox's words do.
_M0: tl.constexpr = tl.constexpr(0xD2511F53)  # Philox4x32 multipliers
_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
_W0: tl.constexpr = tl.constexpr(0x9E3779B9)  # Weyl key increments
_W1: tl.constexpr = tl.constexpr(0xBB67AE85)
_BLOCK = 256
_VOCAB_BLOCK = 2048  # tokens per program of the Gumbel-max kernel: 16 programs a row at 32k, 63 at 128k
_ROW_BLOCK = 1024  # tokens per step of the window kernel's pass over a row (ties beyond its window)


@triton.jit
def _philox_uniform(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of the counter ``(c0, c1, c2, c3)`` under the key ``(k0, k1)`` (uint32 words), made
    into the reference's uniform number: 27 bits of word 0 and 26 of word 1, an integer below 2**53
    scaled by 2**-53 (every step exact)."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, _M0)
        lo0 = c0 * _M0
        hi1 = tl.umulhi(c2, _M1)
        lo1 = c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + _W0  # the key bump after the last round is never used
        k1 = k1 + _W1
    a = (c0 >> 5).to(tl.float64)
    b = (c1 >> 6).to(tl.float64)
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)


@triton.jit(do_not_specialize=["n", "seq_stride", "pos_stride"])
def _philox_uniform_kernel(key_ptr, seq_ptr, pos_ptr, out_ptr, n, seq_stride, pos_stride,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    seq = tl.load(seq_ptr + offs * seq_stride, mask=inside, other=0)  # int64
    pos = tl.load(pos_ptr + offs * pos_stride, mask=inside, other=0)  # int64
    # the key: the seed's two 32-bit halves, held in int64 (an int64 -> uint32 cast keeps the low word)
    k0 = tl.load(key_ptr).to(tl.uint32)
    k1 = tl.load(key_ptr + 1).to(tl.uint32)
    # the counter (position low word, sequence, position high word, lane 0), as the reference builds it
    c0 = pos.to(tl.uint32)
    u = _philox_uniform(c0, seq.to(tl.uint32), (pos >> 32).to(tl.uint32), tl.zeros_like(c0), k0, k1)
    tl.store(out_ptr + offs, u, mask=inside)


@triton.jit(do_not_specialize=["vocab", "row_stride", "seq_stride", "pos_stride", "blocks"])
def _gumbel_max_kernel(scores_ptr, key_ptr, seq_ptr, pos_ptr, best_ptr, arg_ptr, vocab, row_stride,
                       seq_stride, pos_stride, blocks, BLOCK: tl.constexpr):
    """One block of one row: the largest ``score + Gumbel noise`` (float64) and its token, ties to the
    lowest token (``torch.argmax``'s rule), written to ``best``/``arg`` at ``(row, block)``."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    s = tl.load(scores_ptr + row * row_stride + offs, mask=inside, other=float("-inf")).to(tl.float64)
    seq = tl.load(seq_ptr + row * seq_stride)
    pos = tl.load(pos_ptr + row * pos_stride)
    k0 = tl.load(key_ptr).to(tl.uint32)
    k1 = tl.load(key_ptr + 1).to(tl.uint32)
    lane = (offs + 1).to(tl.uint32)  # token v's number is lane v + 1 (lane 0: the token-level stream)
    c0 = tl.zeros_like(lane) + pos.to(tl.uint32)
    c1 = tl.zeros_like(lane) + seq.to(tl.uint32)
    c2 = tl.zeros_like(lane) + (pos >> 32).to(tl.uint32)
    u = _philox_uniform(c0, c1, c2, lane, k0, k1)
    noisy = s - tl.log(-tl.log(u))  # u = 0: -inf, never drawn (as the reference)
    noisy = tl.where(inside, noisy, float("-inf"))
    best, arg = tl.max(noisy, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + row * blocks + blk, best)
    tl.store(arg_ptr + row * blocks + blk, (blk * BLOCK + arg).to(tl.int64))


@triton.jit
def _gumbel_keys(s, token, seq, pos, k0, k1):
    """``s - log(-log(u))`` (float64) for the tokens ``token`` of one row: lane ``token + 1``."""
    lane = (token + 1).to(tl.uint32)
    c0 = tl.zeros_like(lane) + pos.to(tl.uint32)
    c1 = tl.zeros_like(lane) + seq.to(tl.uint32)
    c2 = tl.zeros_like(lane) + (pos >> 32).to(tl.uint32)
    u = _philox_uniform(c0, c1, c2, lane, k0, k1)
    return s.to(tl.float64) - tl.log(-tl.log(u))


@triton.jit(do_not_specialize=["vocab", "row_stride", "seq_stride", "pos_stride"])
def _window_draw_kernel(scores_ptr, window_ptr, index_ptr, ties_ptr, k_ptr, cut_ptr, key_ptr, seq_ptr, pos_ptr,
                        out_ptr, vocab, row_stride, seq_stride, pos_stride, WINDOW: tl.constexpr,
                        BLOCK: tl.constexpr, TOP_P: tl.constexpr):
    """One row: top-k from ``topk``'s window, then (``TOP_P``) top-p, then the Gumbel-max draw over what
    is left; :func:`.sampling._window_top_p` and :func:`.sampling.draw` in one program. ``ties``: how
    many tokens of the row equal the k-th value (counted over the vocabulary beforehand)."""
    row = tl.program_id(0)
    slot = tl.arange(0, WINDOW)
    w = tl.load(window_ptr + row * WINDOW + slot)  # descending
    ids = tl.load(index_ptr + row * WINDOW + slot)
    kk = tl.minimum(tl.maximum(tl.load(k_ptr) - 1, 0), WINDOW - 1)
    kth = tl.sum(tl.where(slot == kk, w, 0.0), axis=0)
    above = w > kth
    m = tl.load(ties_ptr + row)
    seq = tl.load(seq_ptr + row * seq_stride)
    pos = tl.load(pos_ptr + row * pos_stride)
    k0 = tl.load(key_ptr).to(tl.uint32)
    k1 = tl.load(key_ptr + 1).to(tl.uint32)
    gone = tl.zeros((), dtype=tl.int64)  # ties removed by top-p, the lowest ids first
    keep = above
    if TOP_P:
        cut = tl.load(cut_ptr)
        top = tl.max(w, axis=0)
        e = tl.where(above, tl.exp(w - top), 0.0)
        e_tie = tl.exp(kth - top)
        z = tl.sum(e, axis=0) + m.to(tl.float32) * e_tie
        p_tie = e_tie / z
        running = m.to(tl.float32) * p_tie + tl.cumsum(e / z, axis=0, reverse=True)
        keep = above & ((running > cut) | (slot == 0))
        fit = tl.minimum(tl.maximum(tl.floor(cut / p_tie), 0.0), vocab * 1.0).to(tl.int64)
        top_tied = tl.sum(tl.where(slot == 0, above.to(tl.int64), 0), axis=0) == 0
        gone = tl.maximum(tl.minimum(fit, m - top_tied.to(tl.int64)), 0)
    tied = w == kth
    inside = tl.sum(tied.to(tl.int64), axis=0)
    if WINDOW <= 128:  # every tie in the window (the usual case): their ranks by id, no pass over the row
        if inside == m:
            earlier = tl.sum((tied[None, :] & (ids[None, :] <= ids[:, None])).to(tl.int64), axis=1)
            keep = keep | (tied & (earlier > gone))
    noisy = tl.where(keep, _gumbel_keys(w, ids, seq, pos, k0, k1), float("-inf"))
    best = tl.max(noisy, axis=0)
    best_id = tl.sum(tl.where(slot == tl.argmax(noisy, axis=0, tie_break_left=True), ids, 0), axis=0)
    # ties beyond the window: ranked and drawn over the row (ties at -inf cannot be drawn: no pass)
    if ((WINDOW > 128) | (inside != m)) & (kth > float("-inf")):
        base = scores_ptr + row * row_stride
        seen = tl.zeros((), dtype=tl.int64)
        for start in tl.range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            s = tl.load(base + offs, mask=offs < vocab, other=float("-inf"))
            tie = s == kth
            n = tl.sum(tie.to(tl.int64), axis=0)
            if n > 0:  # few blocks hold a tie: the others cost a load and a compare
                rank = seen + tl.cumsum(tie.to(tl.int64), axis=0)
                noisy_tie = tl.where(tie & (rank > gone), _gumbel_keys(s, offs, seq, pos, k0, k1), float("-inf"))
                b = tl.max(noisy_tie, axis=0)
                b_id = (start + tl.argmax(noisy_tie, axis=0, tie_break_left=True)).to(tl.int64)
                better = (b > best) | ((b == best) & (b_id < best_id))
                best_id = tl.where(better, b_id, best_id)
                best = tl.where(better, b, best)
            seen += n
    tl.store(out_ptr + row, best_id)


def uniform_fused(key: torch.Tensor, sequence: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """:func:`.sampling.uniform` in one kernel: ``key`` a ``(2,)`` int64 tensor (:func:`.sampling.seed_key`),
    ``sequence`` and ``position`` int64 tensors broadcast against each other, all on one GPU.

    Cost: one kernel launch (plus a copy where a broadcast of two or more dimensions cannot be
    flattened to one stride); the output is a new float64 tensor of the broadcast shape."""
    seq, pos = torch.broadcast_tensors(sequence, position)
    out = torch.empty(seq.shape, dtype=torch.float64, device=key.device)
    n = out.numel()
    if n == 0:
        return out
    flat_seq, flat_pos = seq.reshape(-1), pos.reshape(-1)  # a view (stride 0 for a broadcast scalar) where it can be
    grid = (triton.cdiv(n, _BLOCK),)
    # triton launches on the current device's current stream (CPU tensors: triton's interpreter, TRITON_INTERPRET=1)
    with torch.cuda.device(key.device) if key.device.type == "cuda" else contextlib.nullcontext():
        _philox_uniform_kernel[grid](key, flat_seq, flat_pos, out, n, flat_seq.stride(0), flat_pos.stride(0),
                                     BLOCK=_BLOCK)
    return out


def gumbel_max_fused(scores: torch.Tensor, key: torch.Tensor, sequence: torch.Tensor,
                     position: torch.Tensor) -> torch.Tensor:
    """:func:`.sampling.draw` in one kernel and a two-op reduction: ``scores`` ``(batch, vocab)`` float32
    (removed tokens ``-inf``), ``key`` a ``(2,)`` int64 tensor, ``sequence`` and ``position`` int64
    tensors that broadcast to ``(batch,)``, all on one GPU. Long ``(batch,)``.

    Cost: one kernel over the vocabulary (``batch * ceil(vocab / 2048)`` programs), then an argmax and
    a gather over those blocks; allocates ``(batch, blocks)`` float64 and int64 (a capture's pool)."""
    b, vocab = scores.shape
    seq, pos = (t.expand(b) for t in torch.broadcast_tensors(sequence.reshape(-1), position.reshape(-1)))
    blocks = triton.cdiv(vocab, _VOCAB_BLOCK)
    best = torch.empty(b, blocks, dtype=torch.float64, device=scores.device)
    arg = torch.empty(b, blocks, dtype=torch.int64, device=scores.device)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    with torch.cuda.device(key.device) if key.device.type == "cuda" else contextlib.nullcontext():
        _gumbel_max_kernel[(b, blocks)](scores, key, seq, pos, best, arg, vocab, scores.stride(0),
                                        seq.stride(0), pos.stride(0), blocks, BLOCK=_VOCAB_BLOCK)
    return arg.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)


def window_draw_fused(scores: torch.Tensor, window: torch.Tensor, index: torch.Tensor, top_k: torch.Tensor,
                      top_p_cut: torch.Tensor, key: torch.Tensor, sequence: torch.Tensor, position: torch.Tensor,
                      *, top_p: bool) -> torch.Tensor:
    """Top-k (and, with ``top_p``, top-p) and the draw in one kernel: ``scores`` ``(batch, vocab)`` float32,
    ``window``/``index`` ``topk``'s descending values and tokens (``(batch, W)``, W a power of two), the
    settings as :func:`.sampling.filter_tensors` makes them. Long ``(batch,)``.

    The same tokens as :func:`.sampling.filter_scores` then :func:`.sampling.draw`, but where top-p's
    float32 running sums (added here in another order) lie within rounding of the cut. Cost: a
    count of the tokens tied at the k-th value (a compare and a sum over the logits), then one
    program per row over the window; only where a tie lies beyond the window (or the window is
    above 128) does that program read its row, computing random numbers for the blocks holding a tie."""
    b, vocab = scores.shape
    seq, pos = (t.expand(b) for t in torch.broadcast_tensors(sequence.reshape(-1), position.reshape(-1)))
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    window, index = window.contiguous(), index.contiguous()
    kth = window.gather(1, (top_k - 1).clamp(min=0, max=window.shape[1] - 1).view(1, 1).expand(b, 1))
    ties = (scores == kth).sum(dim=1)  # a parallel count: the kernel's one program per row reads no row
    out = torch.empty(b, dtype=torch.int64, device=scores.device)
    with torch.cuda.device(key.device) if key.device.type == "cuda" else contextlib.nullcontext():
        _window_draw_kernel[(b,)](scores, window, index, ties, top_k, top_p_cut, key, seq, pos, out, vocab,
                                  scores.stride(0), seq.stride(0), pos.stride(0), WINDOW=window.shape[1],
                                  BLOCK=_ROW_BLOCK, TOP_P=top_p)
    return out


def prepare(device: torch.device, *, k_window: int | None = None, top_p: bool = False) -> None:
    """Compile and load the kernels for ``device`` now (a first call does it; a capture must not): the
    uniform and Gumbel-max kernels, and with ``k_window`` the window kernel of that window and top-p
    setting."""
    one = torch.zeros(1, dtype=torch.int64, device=device)
    key = torch.zeros(2, dtype=torch.int64, device=device)
    uniform_fused(key, one, one)
    gumbel_max_fused(torch.zeros(1, 4, dtype=torch.float32, device=device), key, one, one)
    if k_window is not None:
        scores = torch.zeros(1, k_window + 1, dtype=torch.float32, device=device)
        window, index = scores.topk(k_window, dim=-1)
        window_draw_fused(scores, window, index, one, torch.zeros((), device=device), key, one, one, top_p=top_p)
