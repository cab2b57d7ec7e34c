"""Decode steps for the DeviceDecodeLoop tests, and the host loop they are checked against."""

from __future__ import annotations

import torch

VOCAB = 50


def arithmetic_step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """A deterministic toy 'model': the next token from the last one and the position."""
    return (tokens * 7 + position + 3) % VOCAB


def host_loop(step, tokens, position, n, *, eos=None, pad=None, unfinished=None):
    """Greedy decoding as generate(do_sample=False) does it, one host check per token (``eos``: an id or a list;
    ``position``: an int, or a (batch,) tensor of per-row positions)."""
    ids = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), device=tokens.device)
    pad = (None if eos is None else int(ids[0])) if pad is None else pad
    tok = tokens.clone()
    alive = torch.ones_like(tok, dtype=torch.bool) if unfinished is None else unfinished.clone()
    out = []
    for i in range(n):
        if eos is not None and not bool(alive.any()):
            break
        pos = position + i if isinstance(position, torch.Tensor) else torch.tensor(position + i, device=tok.device)
        nxt = step(tok, pos).long()
        if eos is not None:
            nxt = torch.where(alive, nxt, pad)
            alive &= ~torch.isin(nxt, ids)
        out.append(nxt)
        tok = nxt
    return torch.stack(out, 1) if out else torch.empty(tok.shape[0], 0, dtype=torch.long, device=tok.device)
