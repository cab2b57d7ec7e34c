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

Capture: the kernels allocate only on the caller's stream (outputs, the
programs' results or lists, a zeroed per-row counter, contiguous copies where a
stride asks: a capture routes them to its pool) and read nothing on the host.
A kernel's JIT compile and module load happen at its first call, once per
logits dtype (and for the top-k kernel per window and top-p on or off): call
:func:`prepare` (or run the code eagerly once, as a capture's warm-up does)
before a capture. The launches specialise on nothing that differs between a
warm-up and the capture of the same call (sizes and strides are not
specialised; pointers are, on 16-byte alignment, as triton does).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["uniform_fused", "gumbel_max_fused", "topk_draw_fused", "argmax_fused", "argmax_ready", "prepare"]

# Integer literals above 2**31 are uint32 in triton: the products and sums below wrap at 32 bits,
# as Philox's words do.
_M0: tl.constexpr = tl.constexpr(0xD2511F53)  # Philox4x32 multipliers
_M1: tl.constexpr = tl.constexpr(0xCD9E8D57)
_W0: tl.constexpr = tl.constexpr(0x9E3779B9)  # Weyl key increments
_W1: tl.constexpr = tl.constexpr(0xBB67AE85)
_BLOCK = 256
_VOCAB_BLOCK = 2048  # tokens per step of a Gumbel-max program
_DRAW_PROGRAMS = 64  # at most, per row: 16 at 32k, 63 at 128k; a larger vocabulary gives each program more
_TOPK_SUB = 512  # tokens per step of a top-k program (a bitonic top-k of that many keys)
_TOPK_PROGRAMS = 32  # at most, per row: 32 at 32k (1024 each), 32 at 128k (4096 each)
# Eight warps and 512-key steps: a quarter of the keys per thread of four warps and 1024-key steps, about
# half the unrolled code. In the decode loop, where the step's weights pass through L2 between draws, the
# four-warp kernel's draw cost 20 / 63 us more over the temperature draw's than it does alone (32k / 128k
# vocabularies, batch 1, H200), this one 2 / 9 (benchmarks/results/device_generate.json and
# diagnostics/sampling_costs.json, against the _eeadc77 files of both).
_TOPK_WARPS = 8
_ROW_BLOCK = 1024  # tokens per step of the pass over a row (ties beyond the window)
_NO_NAN: tl.constexpr = tl.constexpr(2**31 - 1)  # the argmax kernel's "no NaN seen" (a vocabulary is below 2**31)
_argmax_loaded: set[tuple[int, torch.dtype, bool]] = set()  # (device, dtype, 16-byte aligned) launched eagerly


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


@triton.jit
def _scaled(x, t):
    """``logits.float() / temperature`` as torch computes it: an exact cast, then float32 division rounded
    to nearest (``tl.div_rn``; triton's ``/`` may round otherwise), so that ties and scores agree bit for bit."""
    return tl.div_rn(x.to(tl.float32), t.to(tl.float32))


@triton.jit
def _gumbel_keys(s, token, seq, pos, k0, k1):
    """``s - log(-log(u))`` (float64) for the tokens ``token`` of one row: lane ``token + 1``."""
    lane = (token + 1).to(tl.uint32)
    c0 = tl.zeros_like(lane) + pos.to(tl.uint32)
    c1 = tl.zeros_like(lane) + seq.to(tl.uint32)
    c2 = tl.zeros_like(lane) + (pos >> 32).to(tl.uint32)
    u = _philox_uniform(c0, c1, c2, lane, k0, k1)
    return s.to(tl.float64) - tl.log(-tl.log(u))  # u = 0: -inf, never drawn (as the reference)


@triton.jit
def _last_of_row(count_ptr, row, nblocks):
    """Whether this program is the last of its row to finish: the row's other programs' stores are then
    visible to it (a barrier, then an acquire-release count; their results are read with ``.cg`` loads,
    from L2). The counter is a fresh zero per launch (no state between launches or streams)."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu") == nblocks - 1


@triton.jit(do_not_specialize=["vocab", "chunk", "nblocks", "row_stride", "seq_stride", "pos_stride"])
def _gumbel_max_kernel(logits_ptr, t_ptr, key_ptr, seq_ptr, pos_ptr, best_ptr, arg_ptr, count_ptr, out_ptr, vocab,
                       chunk, nblocks, row_stride, seq_stride, pos_stride, SUB: tl.constexpr, NB_MAX: tl.constexpr,
                       SCALE: tl.constexpr):
    """Program ``(row, blk)``: the largest ``score + Gumbel noise`` (float64) over tokens ``[blk * chunk,
    (blk + 1) * chunk)`` and its token, ties to the lowest token (``torch.argmax``'s rule); the row's last
    program to finish picks the row's token among the programs' and writes it to ``out``. ``SCALE``: the
    score is the logit divided by the temperature at ``t_ptr`` (:func:`_scaled`), else the logit."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    seq = tl.load(seq_ptr + row * seq_stride)
    pos = tl.load(pos_ptr + row * pos_stride)
    k0 = tl.load(key_ptr).to(tl.uint32)
    k1 = tl.load(key_ptr + 1).to(tl.uint32)
    start = blk * chunk
    stop = tl.minimum(start + chunk, vocab)
    best = tl.full((), float("-inf"), tl.float64)
    arg = start.to(tl.int64)
    for off in tl.range(start, stop, SUB):
        offs = off + tl.arange(0, SUB)
        inside = offs < stop
        s = tl.load(logits_ptr + row * row_stride + offs, mask=inside, other=float("-inf"))
        if SCALE:
            s = _scaled(s, tl.load(t_ptr))
        noisy = tl.where(inside, _gumbel_keys(s, offs, seq, pos, k0, k1), float("-inf"))
        b, a = tl.max(noisy, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = b > best  # an earlier block keeps a tie
        arg = tl.where(better, (off + a).to(tl.int64), arg)
        best = tl.where(better, b, best)
    tl.store(best_ptr + row * NB_MAX + blk, best)
    tl.store(arg_ptr + row * NB_MAX + blk, arg)
    if _last_of_row(count_ptr, row, nblocks):
        i = tl.arange(0, NB_MAX)
        bests = tl.load(best_ptr + row * NB_MAX + i, mask=i < nblocks, other=float("-inf"), cache_modifier=".cg")
        args = tl.load(arg_ptr + row * NB_MAX + i, mask=i < nblocks, other=0, cache_modifier=".cg")
        j = tl.argmax(bests, axis=0, tie_break_left=True)
        tl.store(out_ptr + row, tl.sum(tl.where(i == j, args, 0), axis=0))


@triton.jit(do_not_specialize=["vocab", "chunk", "nblocks", "row_stride"])
def _argmax_kernel(logits_ptr, best_ptr, arg_ptr, nan_ptr, count_ptr, out_ptr, vocab, chunk, nblocks, row_stride,
                   SUB: tl.constexpr, NB_MAX: tl.constexpr):
    """Program ``(row, blk)``: the largest logit over tokens ``[blk * chunk, (blk + 1) * chunk)`` (compared
    in float32: an exact widening), its lowest token, and the lowest token holding a NaN; the row's last
    program to finish writes ``torch.argmax``'s answer to ``out``: the first NaN if there is one, else the
    first of the largest values."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * row_stride
    start = blk * chunk
    stop = tl.minimum(start + chunk, vocab)
    best = tl.full((), float("-inf"), tl.float32)
    arg = start.to(tl.int64)
    first_nan = tl.full((), _NO_NAN, tl.int32)
    for off in tl.range(start, stop, SUB):
        offs = off + tl.arange(0, SUB)
        inside = offs < stop
        s = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
        nan = s != s
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, offs, _NO_NAN), axis=0))
        b, a = tl.max(tl.where(nan, float("-inf"), s), axis=0, return_indices=True,
                      return_indices_tie_break_left=True)
        better = b > best  # an earlier step keeps a tie
        arg = tl.where(better, (off + a).to(tl.int64), arg)
        best = tl.where(better, b, best)
    tl.store(best_ptr + row * NB_MAX + blk, best)
    tl.store(arg_ptr + row * NB_MAX + blk, arg)
    tl.store(nan_ptr + row * NB_MAX + blk, first_nan)
    if _last_of_row(count_ptr, row, nblocks):
        i = tl.arange(0, NB_MAX)
        mine = i < nblocks
        bests = tl.load(best_ptr + row * NB_MAX + i, mask=mine, other=float("-inf"), cache_modifier=".cg")
        args = tl.load(arg_ptr + row * NB_MAX + i, mask=mine, other=0, cache_modifier=".cg")
        nans = tl.load(nan_ptr + row * NB_MAX + i, mask=mine, other=_NO_NAN, cache_modifier=".cg")
        j = tl.argmax(bests, axis=0, tie_break_left=True)
        top = tl.sum(tl.where(i == j, args, 0), axis=0)
        nan_at = tl.min(nans, axis=0)
        tl.store(out_ptr + row, tl.where(nan_at < _NO_NAN, nan_at.to(tl.int64), top))


@triton.jit
def _pack(s, token):
    """One int64 per token that orders as (score, then id): the float32's bits made monotone (negative
    values' magnitude bits flipped) above, the token below, so a descending list holds equal scores
    highest id first (top-p then removes the lowest id of them first, as it removes the tokens tied at
    the k-th value). -0.0 is packed as 0.0: the two compare equal (tied), so they must not order apart."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | token.to(tl.int64)


@triton.jit
def _unpack(key):
    """:func:`_pack`'s score (float32) and token (int64)."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True), key - ((key >> 32) << 32)


@triton.jit
def _merge_pairs(lists, LOG_ROWS: tl.constexpr):
    """The top ``W`` of ``2**LOG_ROWS`` sorted lists (``(rows, W)``, even rows descending, odd rows
    ascending), as a ``(1, W)`` descending list: ``LOG_ROWS`` rounds of pairing each even row with the next
    (their elementwise max is the pair's top ``W`` in bitonic order) and a bitonic merge; no full sort."""
    for _ in tl.static_range(LOG_ROWS):
        pairs = tl.reshape(lists, [lists.shape[0] // 2, 2, lists.shape[1]])
        lists = tl.bitonic_merge(tl.max(pairs, axis=1), descending=True)
        if lists.shape[0] > 1:
            odd = (tl.arange(0, lists.shape[0]) % 2 == 1)[:, None]
            lists = tl.where(odd, tl.flip(lists, 1), lists)
    return lists


@triton.jit(do_not_specialize=["vocab", "chunk", "nblocks", "row_stride", "seq_stride", "pos_stride"])
def _topk_draw_kernel(logits_ptr, t_ptr, k_ptr, cut_ptr, key_ptr, seq_ptr, pos_ptr, cand_ptr, count_ptr, out_ptr,
                      vocab, chunk, nblocks, row_stride, seq_stride, pos_stride, WINDOW: tl.constexpr,
                      SUB: tl.constexpr, NB_MAX: tl.constexpr, LOG_NB: tl.constexpr, ROW_BLOCK: tl.constexpr,
                      TOP_P: tl.constexpr):
    """Program ``(row, blk)``: the ``WINDOW`` largest scores (logits / temperature) of tokens ``[blk * chunk,
    (blk + 1) * chunk)``, by a bitonic top-k over :func:`_pack`'s keys (equal scores: the higher id first). The row's
    last program to finish takes the row's window from the programs' and applies top-k, then (``TOP_P``)
    top-p, then the Gumbel-max draw over what is left: :func:`.sampling._window_top_p` and
    :func:`.sampling.draw` in one program."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    t = tl.load(t_ptr)
    base = logits_ptr + row * row_stride
    start = blk * chunk
    stop = tl.minimum(start + chunk, vocab)
    cur = tl.full((WINDOW,), -9223372036854775808, tl.int64)
    for off in tl.range(start, stop, SUB):
        offs = off + tl.arange(0, SUB)
        inside = offs < stop
        s = _scaled(tl.load(base + offs, mask=inside, other=float("-inf")), t)
        new = tl.topk(tl.where(inside, _pack(s, offs), -9223372036854775808), WINDOW)
        # two sorted lists, one reversed: their elementwise max is the top of both, in bitonic order
        cur = tl.bitonic_merge(tl.maximum(cur, tl.flip(new, 0)), descending=True)
    slot = tl.arange(0, WINDOW)
    if blk % 2 == 1:  # odd programs store ascending: the merge below pairs each with its even neighbour
        cur = tl.flip(cur, 0)
    tl.store(cand_ptr + (row * NB_MAX + blk) * WINDOW + slot, cur)
    if _last_of_row(count_ptr, row, nblocks):
        r = tl.arange(0, NB_MAX)
        cand = tl.load(cand_ptr + (row * NB_MAX + r[:, None]) * WINDOW + slot[None, :],
                       mask=(r < nblocks)[:, None], other=-9223372036854775808, cache_modifier=".cg")
        w, ids = _unpack(tl.reshape(_merge_pairs(cand, LOG_NB), [WINDOW]))  # descending (vocab > WINDOW)
        kk = tl.minimum(tl.maximum(tl.load(k_ptr) - 1, 0), WINDOW - 1)
        kth = tl.sum(tl.where(slot == kk, w, 0.0), axis=0)
        above = w > kth
        tied = w == kth
        inside = tl.sum(tied.to(tl.int64), axis=0)
        # the tokens tied at the k-th value, counted per program's list (the programs' shares are in id order): a list
        # whose smallest is the k-th value may not hold all of its share's ties; only that share is read
        real = cand != -9223372036854775808
        cw, cids = _unpack(cand)
        tie_c = real & (cw == kth)
        counts = tl.sum(tie_c.to(tl.int64), axis=1)
        low = tl.min(cand, axis=1)
        low_w, _ = _unpack(low)
        hidden = (r < nblocks) & (low != -9223372036854775808) & (low_w == kth) & (low_w > float("-inf"))
        any_hidden = tl.sum(hidden.to(tl.int32), axis=0) > 0
        if any_hidden:
            for b in tl.range(0, nblocks):
                if tl.sum(tl.where(r == b, hidden.to(tl.int32), 0), axis=0) > 0:
                    n = tl.zeros((), dtype=tl.int64)
                    for off in tl.range(b * chunk, tl.minimum(b * chunk + chunk, vocab), ROW_BLOCK):
                        offs = off + tl.arange(0, ROW_BLOCK)
                        s = _scaled(tl.load(base + offs, mask=offs < vocab, other=float("-inf")), t)
                        n += tl.sum(((s == kth) & (offs < b * chunk + chunk)).to(tl.int64), axis=0)
                    counts = tl.where(r == b, n, counts)
        m = tl.sum(counts, axis=0)
        if kth == float("-inf"):  # ties at -inf cannot be drawn and weigh nothing
            m = inside
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
        if inside == m:  # every tie in the window (the usual case), highest id first: ranked from the end
            keep = keep | (tied & (tl.cumsum(tied.to(tl.int64), axis=0, reverse=True) > gone))
        noisy = tl.where(keep, _gumbel_keys(w, ids, seq, pos, k0, k1), float("-inf"))
        best = tl.max(noisy, axis=0)
        best_id = tl.min(tl.where(noisy == best, ids, 9223372036854775807), axis=0)  # argmax's rule: lowest id
        if inside != m:  # ties beyond the window: ranked by id over the row, drawn from the lists
            offset = tl.cumsum(counts, axis=0) - counts  # ties in the shares before each
            odd = (r % 2 == 1)[:, None]  # ascending lists hold ties in id order, descending ones the reverse
            ties = tie_c.to(tl.int64)
            rank = offset[:, None] + tl.where(odd, tl.cumsum(ties, axis=1), tl.cumsum(ties, axis=1, reverse=True))
            ok = tie_c & (rank > gone) & ~hidden[:, None]
            keys = tl.where(ok, _gumbel_keys(cw, cids, seq, pos, k0, k1), float("-inf"))
            b_best = tl.max(tl.max(keys, axis=1), axis=0)
            b_id = tl.min(tl.min(tl.where(ok & (keys == b_best), cids, 9223372036854775807), axis=1), axis=0)
            better = (b_best > best) | ((b_best == best) & (b_id < best_id))
            best_id = tl.where(better, b_id, best_id)
            best = tl.where(better, b_best, best)
            if any_hidden:  # (rare) the shares whose lists may miss ties: read again, drawn in id order
                for b in tl.range(0, nblocks):
                    if tl.sum(tl.where(r == b, hidden.to(tl.int32), 0), axis=0) > 0:
                        seen = tl.sum(tl.where(r == b, offset, 0), axis=0)
                        for off in tl.range(b * chunk, tl.minimum(b * chunk + chunk, vocab), ROW_BLOCK):
                            offs = off + tl.arange(0, ROW_BLOCK)
                            s = _scaled(tl.load(base + offs, mask=offs < vocab, other=float("-inf")), t)
                            tie = (s == kth) & (offs < b * chunk + chunk)
                            rank_s = seen + tl.cumsum(tie.to(tl.int64), axis=0)
                            noisy_tie = tl.where(tie & (rank_s > gone), _gumbel_keys(s, offs, seq, pos, k0, k1),
                                                 float("-inf"))
                            nb = tl.max(noisy_tie, axis=0)
                            nb_id = (off + tl.argmax(noisy_tie, axis=0, tie_break_left=True)).to(tl.int64)
                            better = (nb > best) | ((nb == best) & (nb_id < best_id))
                            best_id = tl.where(better, nb_id, best_id)
                            best = tl.where(better, nb, best)
                            seen += tl.sum(tie.to(tl.int64), axis=0)
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


def _split(vocab: int, sub: int, most: int) -> tuple[int, int]:
    """``(programs, tokens per program)`` for a row of ``vocab`` tokens read ``sub`` at a time by at most
    ``most`` programs, none of them empty."""
    steps = triton.cdiv(vocab, sub)
    per = triton.cdiv(steps, most)
    return triton.cdiv(steps, per), per * sub


def _rows(b: int, sequence: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.expand(b) for t in torch.broadcast_tensors(sequence.reshape(-1), position.reshape(-1)))


def gumbel_max_fused(logits: torch.Tensor, key: torch.Tensor, sequence: torch.Tensor, position: torch.Tensor, *,
                     temperature: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`.sampling.draw` in one kernel: ``logits`` ``(batch, vocab)`` (any float dtype; removed tokens
    ``-inf``), ``key`` a ``(2,)`` int64 tensor, ``sequence`` and ``position`` int64 tensors that broadcast
    to ``(batch,)``, all on one GPU. Long ``(batch,)``. With ``temperature`` (a 0-dim float32 tensor) the
    scores are ``logits.float() / temperature``, divided in the kernel (the same float32 values); without
    it, the logits as they are.

    Cost: one launch of ``batch * min(64, ceil(vocab / 2048))`` programs, one pass over the logits (the
    row's last program picks its token), after zeroing a ``(batch,)`` counter; allocates ``(batch, 64)``
    float64 and int64 (a capture's pool)."""
    b, vocab = logits.shape
    seq, pos = _rows(b, sequence, position)
    nblocks, chunk = _split(vocab, _VOCAB_BLOCK, _DRAW_PROGRAMS)
    best = torch.empty(b, _DRAW_PROGRAMS, dtype=torch.float64, device=logits.device)
    arg = torch.empty(b, _DRAW_PROGRAMS, dtype=torch.int64, device=logits.device)
    count = torch.zeros(b, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    t = key if temperature is None else temperature  # unread without SCALE
    with torch.cuda.device(key.device) if key.device.type == "cuda" else contextlib.nullcontext():
        _gumbel_max_kernel[(b, nblocks)](logits, t, key, seq, pos, best, arg, count, out, vocab, chunk, nblocks,
                                         logits.stride(0), seq.stride(0), pos.stride(0), SUB=_VOCAB_BLOCK,
                                         NB_MAX=_DRAW_PROGRAMS, SCALE=temperature is not None)
    return out


def topk_draw_fused(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p_cut: torch.Tensor,
                    key: torch.Tensor, sequence: torch.Tensor, position: torch.Tensor, *, window: int,
                    top_p: bool) -> torch.Tensor:
    """Temperature, top-k (and, with ``top_p``, top-p) and the draw in one kernel: ``logits`` ``(batch,
    vocab)`` (any float dtype, vocab > ``window``), ``window`` a power of two >= k (:func:`.sampling.
    top_k_window`), the settings as :func:`.sampling.filter_tensors` makes them. Long ``(batch,)``.

    The same tokens as :func:`.sampling.filter_scores` then :func:`.sampling.draw`, but where top-p's
    float32 running sums (added here in another order) lie within rounding of the cut. Cost: a
    ``(batch,)`` counter zeroed, then one launch of at most ``batch * 32`` programs (eight warps each),
    each a bitonic top-``window`` of its share of the row; the row's last program merges their lists
    (five pairwise bitonic merges, no sort) and filters and draws on the window. Tokens tied at the
    k-th score outside the window are counted and drawn from the programs' lists; only a share whose
    own list ends at the k-th score (it may hold more ties) is read again, to count and to draw."""
    b, vocab = logits.shape
    seq, pos = _rows(b, sequence, position)
    nblocks, chunk = _split(vocab, _TOPK_SUB, _TOPK_PROGRAMS)
    cand = torch.empty(b, _TOPK_PROGRAMS * window, dtype=torch.int64, device=logits.device)
    count = torch.zeros(b, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    with torch.cuda.device(key.device) if key.device.type == "cuda" else contextlib.nullcontext():
        _topk_draw_kernel[(b, nblocks)](logits, temperature, top_k, top_p_cut, key, seq, pos, cand, count, out,
                                        vocab, chunk, nblocks, logits.stride(0), seq.stride(0), pos.stride(0),
                                        WINDOW=window, SUB=_TOPK_SUB, NB_MAX=_TOPK_PROGRAMS,
                                        LOG_NB=_TOPK_PROGRAMS.bit_length() - 1, ROW_BLOCK=_ROW_BLOCK, TOP_P=top_p,
                                        num_warps=_TOPK_WARPS)
    return out


def argmax_fused(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` in one kernel over its programs' shares of each row: ``logits`` ``(batch,
    vocab)`` float32, bf16 or fp16 on one GPU, ``vocab >= 1``. The same tokens, bit for bit: the first of
    the largest values, or the first NaN where a row holds one. Long ``(batch,)``.

    Cost: a ``(batch,)`` counter zeroed, then one launch of ``batch * min(64, ceil(vocab / 2048))``
    programs, one pass over the logits (the row's last program picks its token); allocates ``(batch, 64)``
    float32, int64 and int32 (a capture's pool). torch's argmax reduces a row of a large vocabulary with
    few blocks; this spreads it over up to 64."""
    b, vocab = logits.shape
    key = _argmax_key(logits)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    nblocks, chunk = _split(vocab, _VOCAB_BLOCK, _DRAW_PROGRAMS)
    best = torch.empty(b, _DRAW_PROGRAMS, dtype=torch.float32, device=logits.device)
    arg = torch.empty(b, _DRAW_PROGRAMS, dtype=torch.int64, device=logits.device)
    nan = torch.empty(b, _DRAW_PROGRAMS, dtype=torch.int32, device=logits.device)
    count = torch.zeros(b, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    with torch.cuda.device(logits.device) if logits.device.type == "cuda" else contextlib.nullcontext():
        _argmax_kernel[(b, nblocks)](logits, best, arg, nan, count, out, vocab, chunk, nblocks, logits.stride(0),
                                     SUB=_VOCAB_BLOCK, NB_MAX=_DRAW_PROGRAMS)
    if not torch.cuda.is_current_stream_capturing():
        _argmax_loaded.add(key)
    return out


def _argmax_key(logits: torch.Tensor) -> tuple[int, torch.dtype, bool]:
    """What selects the compiled kernel: the device, the dtype, and whether the pointer is 16-byte aligned
    (triton specialises pointers on it; a copy, made where the last stride is not 1, is aligned)."""
    aligned = logits.stride(-1) != 1 or logits.data_ptr() % 16 == 0
    return logits.device.index or 0, logits.dtype, aligned


def argmax_ready(logits: torch.Tensor) -> bool:
    """Whether :func:`argmax_fused` has run eagerly on logits like these (:func:`_argmax_key`): its kernel is
    then compiled and loaded, so a capture may launch it (a capture must not load a module)."""
    return _argmax_key(logits) in _argmax_loaded


def prepare(device: torch.device, *, k_window: int | None = None, top_p: bool = False,
            dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)) -> None:
    """Compile and load the kernels for ``device`` now (a first call does it; a capture must not): the
    uniform and Gumbel-max kernels, the latter for logits of each of ``dtypes`` (a kernel is compiled per
    dtype of its inputs), and with ``k_window`` the window kernel of that window and top-p setting."""
    one = torch.zeros(1, dtype=torch.int64, device=device)
    key = torch.zeros(2, dtype=torch.int64, device=device)
    t = torch.ones((), dtype=torch.float32, device=device)
    uniform_fused(key, one, one)
    gumbel_max_fused(torch.zeros(1, 4, dtype=torch.float32, device=device), key, one, one)  # draw()'s scores
    for dtype in dtypes:
        logits = torch.zeros(1, (k_window or 3) + 1, dtype=dtype, device=device)  # sizes are not specialised
        gumbel_max_fused(logits, key, one, one, temperature=t)
        if k_window is not None:
            topk_draw_fused(logits, t, one, torch.zeros((), dtype=torch.float32, device=device), key, one, one,
                            window=k_window, top_p=top_p)
