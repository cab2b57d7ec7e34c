"""Models for the piecewise tests (CPU and GPU): a small attention LM, a static-cache attention, custom ops.

The custom ops are registered once per process here (``gfxtest::attn``, a splitting
op that records the shapes it sees; ``gfxtest::rowmix``, an op that mixes rows where
no graph can show it, which the row analysis does not know; ``gfxtest::rowmix_pointwise``, the
same op tagged pointwise, which the analysis believes and the padding check catches).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from hipgraph_bridge import compile as cb

SEEN: list[tuple[int, ...]] = []  # the shapes the custom attention op was called with


@torch.library.custom_op("gfxtest::attn", mutates_args=())
def _attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    SEEN.append(tuple(q.shape))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@_attn.register_fake
def _(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the real op's layout, on fake tensors


@torch.library.custom_op("gfxtest::rowmix", mutates_args=())
def _rowmix(x: torch.Tensor) -> torch.Tensor:
    return x + x.sum(dim=1, keepdim=True)  # mixes the rows: invisible to the static guard


@_rowmix.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("gfxtest::rowmix_pointwise", mutates_args=(), tags=(torch.Tag.pointwise,))
def _rowmix_pointwise(x: torch.Tensor) -> torch.Tensor:
    return x + x.sum(dim=1, keepdim=True)  # tagged pointwise, but mixes the rows: the trace believes the tag


@_rowmix_pointwise.register_fake
def _(x):
    return torch.empty_like(x)


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, d: int, heads: int, attn: str, extra: str) -> None:
        super().__init__()
        self.heads, self.attn, self.extra = heads, attn, extra
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape  # (B, S, D)
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = torch.ops.gfxtest.attn(q, k, v) if self.attn == "custom" else F.scaled_dot_product_attention(
            q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        h = self.down(F.silu(self.up(self.norm2(x))))
        if self.extra == "seq_mean":
            h = h - h.mean(dim=1, keepdim=True)  # a reduction over the sequence: padding would change it
        elif self.extra == "rowmix":
            h = torch.ops.gfxtest.rowmix(h)
        elif self.extra == "rowmix_pointwise":
            h = torch.ops.gfxtest.rowmix_pointwise(h)
        return x + h


class TinyLM(nn.Module):
    """Embedding, ``layers`` attention blocks (rotary from the given positions), a head."""

    def __init__(self, *, d: int = 32, heads: int = 4, layers: int = 2, vocab: int = 64, attn: str = "sdpa",
                 extra: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, attn, extra if i == layers - 1 else "") for i in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d // heads, 2).float() / (d // heads))))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, S, D)
        freqs = positions[..., None].float() * self.inv_freq  # (B, S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, S, hd)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))


class CachedAttention(nn.Module):
    """Writes k and v into a static cache at the given positions; attends over the cache with a mask.

    ``forward(x (1, S, D), pos (S,))`` serves a prefill (``pos = 0..S-1``) and a
    decode step (``S == 1``) alike; the cache buffers are marked static, as a
    serving stack's are, so the graphs write them in place.
    """

    def __init__(self, d: int = 16, max_len: int = 64, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.to(device=device, dtype=dtype)
        self.register_buffer("k_cache", torch.zeros(1, 2, max_len, d // 2, device=device, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(1, 2, max_len, d // 2, device=device, dtype=dtype))
        torch._dynamo.mark_static_address(self.k_cache)
        torch._dynamo.mark_static_address(self.v_cache)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, 2, d // 2).transpose(1, 2) for t in self.qkv(x).split(d, -1))
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        slots = torch.arange(self.k_cache.shape[2], device=x.device)
        mask = slots[None, :] <= pos[:, None]  # (S, max_len): each query sees the cache up to its position
        a = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return x + self.o(a.transpose(1, 2).reshape(b, s, d))


# ------------------------------------------------------------------ the tests' dynamo hygiene
BEFORE: weakref.WeakSet = weakref.WeakSet()  # subgraphs compiled before the running test


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts from a reset dynamo and sees only the subgraphs it compiled."""
    torch._dynamo.reset()
    gc.collect()
    gc.freeze()  # the survivors (fake-tensor dispatch caches dynamo's reset keeps, ...): out of later collections' way
    BEFORE.clear()
    BEFORE.update(cb.compiled_subgraphs())
    SEEN.clear()
    yield
    torch._dynamo.reset()


def frames() -> list:
    """The piecewise frames the running test compiled."""
    return [s for s in cb.compiled_subgraphs() if s not in BEFORE and isinstance(s, cb.PiecewiseSubgraph)]
