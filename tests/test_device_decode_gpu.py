"""DeviceDecodeLoop on the GPU: a WHILE node decodes until EOS or the budget, tokens equal to the host loop.

A small fp32 model (eager and graphed runs are the same kernels, so argmax ties cannot
differ) and a transformers Llama through StaticCacheDecoder(device_loop=K). The host
strategy (what HIP runs) is forced on CUDA in each test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _decode_steps import VOCAB, arithmetic_step, host_loop
from _tiny_llama import prompt, tiny_llama
from hipgraph_bridge.conditional.support import conditional_support
from hipgraph_bridge.generation import DeviceDecodeLoop

pytestmark = pytest.mark.gpu
V = 97


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(V, 64)
        self.pos = nn.Embedding(512, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.head = nn.Linear(64, V)

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(position)
        return self.head(h + self.mlp(h)).argmax(dim=-1)  # allocates: the body's memory goes to its pool


@pytest.fixture(scope="module")
def lm():
    return TinyLM().cuda().eval()


def _first(b, seed=0):
    return torch.randint(0, V, (b,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed + b))


def _strategy(request_strategy):
    if request_strategy == "native" and not conditional_support().while_loop:
        pytest.skip(f"no WHILE nodes here: {conditional_support().reason}")
    return request_strategy


def _eos_ending_rows_at_different_steps(want, vocab):
    rows = want.tolist()
    for v in range(vocab):
        firsts = [row.index(v) if v in row else None for row in rows]
        if None not in firsts and len(set(firsts)) == len(rows) and 0 < min(firsts) and max(firsts) < len(rows[0]) - 1:
            return v, firsts
    pytest.skip("no token ends every row at a different step in this model's output")


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_tokens_equal_the_host_loop_for_a_budget_not_a_multiple_of_the_chunk(lm, strategy):
    strategy = _strategy(strategy)
    with torch.no_grad():
        loop = DeviceDecodeLoop(lm, batch_size=3, chunk=16, strategy=strategy)
        first = _first(3)
        got = loop.generate(first, 7, max_new_tokens=37)
        want = host_loop(lm, first, 7, 37)
    assert loop.strategy == strategy, loop.strategy_reason
    assert torch.equal(got, want)
    assert loop.launches == 3  # 16 + 16 + 5


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_eos_inside_a_launch_stops_each_sequence_at_its_step(strategy):
    strategy = _strategy(strategy)
    with torch.no_grad():  # the toy step's outputs are known: an EOS id that ends each row at another step
        first = torch.tensor([1, 2, 3], device="cuda")
        plain = host_loop(arithmetic_step, first, 5, 40)
        eos, firsts = _eos_ending_rows_at_different_steps(plain, VOCAB)
        loop = DeviceDecodeLoop(arithmetic_step, batch_size=3, chunk=64, strategy=strategy)
        got = loop.generate(first, 5, max_new_tokens=40, eos_token_id=eos, pad_token_id=VOCAB)
        want = host_loop(arithmetic_step, first, 5, 40, eos=eos, pad=VOCAB)
    assert loop.strategy == strategy, loop.strategy_reason
    assert torch.equal(got, want)
    assert got.shape[1] == max(firsts) + 1 < 40  # the launch stopped on the device when the last row ended
    for r, f in enumerate(firsts):
        assert int(got[r, f]) == eos and bool(got[r, f + 1:].eq(VOCAB).all()), (r, f)
    assert loop.launches == 1


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_several_eos_ids_end_sequences_like_the_host_loop(strategy):
    """The fused WHILE step (native) and the torch body (host) compare each token with up to 8 EOS ids."""
    strategy = _strategy(strategy)
    with torch.no_grad():
        first = torch.tensor([1, 2, 3], device="cuda")
        plain = host_loop(arithmetic_step, first, 5, 40).tolist()
        eos = [plain[0][2], plain[1][5], 10_000, 10_001, 10_002, 10_003, 10_004, plain[2][7]]  # 8: every slot
        loop = DeviceDecodeLoop(arithmetic_step, batch_size=3, chunk=64, strategy=strategy)
        got = loop.generate(first, 5, max_new_tokens=40, eos_token_id=torch.tensor(eos), pad_token_id=VOCAB)
        want = host_loop(arithmetic_step, first, 5, 40, eos=eos, pad=VOCAB)
    assert loop.strategy == strategy, loop.strategy_reason
    assert torch.equal(got, want)
    assert got.shape[1] <= 8 and all(any(t in eos for t in row) for row in got.tolist())  # each ended by an id


def test_native_launch_runs_the_steps_on_the_device_and_keeps_memory_in_its_pool(lm):
    _strategy("native")
    with torch.no_grad():
        loop = DeviceDecodeLoop(lm, batch_size=2, chunk=32)
        first = _first(2)
        loop.capture()
        assert loop.strategy == "native", loop.strategy_reason
        loop.generate(first, 0, max_new_tokens=32)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(3):
            out = loop.generate(first, 0, max_new_tokens=32)
            del out
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before  # the step's tensors are the graph pool's, not new ones
        assert int(loop._loop.state[3][0]) == 32 and loop.launches == 4  # each launch ran all 32 steps


def test_a_batch_beyond_one_block_takes_the_torch_bookkeeping_on_the_native_path(lm):
    _strategy("native")
    with torch.no_grad():
        first = torch.arange(1100, device="cuda") % V
        loop = DeviceDecodeLoop(lm, batch_size=1100, chunk=8)
        got = loop.generate(first, 0, max_new_tokens=10, eos_token_id=5)
        assert not loop._fused and loop.strategy == "native", loop.strategy_reason
        assert torch.equal(got, host_loop(lm, first, 0, 10, eos=5))


@pytest.mark.parametrize("b", [33, 100, 1024])
def test_the_fused_step_over_several_warps_ends_each_sequence_at_its_eos(lm, b):
    _strategy("native")
    with torch.no_grad():
        first = torch.arange(b, device="cuda") % V
        loop = DeviceDecodeLoop(lm, batch_size=b, chunk=16)
        got = loop.generate(first, 0, max_new_tokens=40, eos_token_id=11, pad_token_id=V)
        assert loop._fused and loop.strategy == "native", loop.strategy_reason
        assert torch.equal(got, host_loop(lm, first, 0, 40, eos=11, pad=V))


class CacheLM(nn.Module):
    """A step that writes a cache at its position and reads the cache up to it (causal, like a KV cache)."""

    def __init__(self, b: int) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(64, b, dtype=torch.long))
        self.register_buffer("steps", torch.arange(64))

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, position.view(1), tokens.view(1, -1))
        seen = (self.cache * (self.steps <= position).long().view(-1, 1)).sum(0)
        return (tokens * 7 + seen + position) % V


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_a_stateful_step_captured_on_the_first_generation_keeps_its_state_right(strategy):
    strategy = _strategy(strategy)
    with torch.no_grad():
        dev, ref = CacheLM(3).cuda(), CacheLM(3).cuda()
        first = _first(3, seed=5)
        for cache in (dev.cache, ref.cache):
            cache[:4] = 9  # a prefill of 4 positions
        loop = DeviceDecodeLoop(dev, batch_size=3, chunk=8, strategy=strategy)
        got = loop.generate(first, 4, max_new_tokens=20)  # captures now: the warm-up runs the step
        assert loop.strategy == strategy, loop.strategy_reason
        assert torch.equal(got, host_loop(ref, first, 4, 20))
        assert torch.equal(dev.cache, ref.cache)


def test_streaming_chunks_concatenate_to_the_generation(lm):
    with torch.no_grad():
        loop = DeviceDecodeLoop(lm, batch_size=2, chunk=8)
        first = _first(2, seed=1)
        parts = list(loop.chunks(first, 3, max_new_tokens=20))
        assert loop.strategy in ("native", "host"), loop.strategy_reason
        assert [p.shape[1] for p in parts] == [8, 8, 4]
        assert torch.equal(torch.cat(parts, 1), host_loop(lm, first, 3, 20))


# ------------------------------------------------------------------ transformers through StaticCacheDecoder
@pytest.fixture(scope="module")
def llama():
    return tiny_llama(pytest.importorskip("transformers"))


def _prompt(b, seed=0):
    return prompt(b, 10, seed)


@pytest.mark.parametrize("strategy", ["native", "host"])
@pytest.mark.parametrize("b", [1, 3])
def test_static_cache_decoder_device_loop_equals_eager(llama, b, strategy):
    from gfxgraph.hf import StaticCacheDecoder

    strategy = _strategy(strategy)
    eager = StaticCacheDecoder(llama, max_cache_len=96, graphs=False)
    dev = StaticCacheDecoder(llama, max_cache_len=96, device_loop=16, strategy=strategy)
    for seed in (0, 1):  # the second generation re-uses the cache: its write position must start over
        ids = _prompt(b, seed)
        want = eager.generate(ids, max_new_tokens=40, eos_token_id=None)
        got = dev.generate(ids, max_new_tokens=40, eos_token_id=None)
        assert torch.equal(got, want), (b, seed)
    eos = int(want[0, 5])  # ends row 0 inside the first launch of the loop
    assert torch.equal(dev.generate(ids, max_new_tokens=40, eos_token_id=eos, pad_token_id=0),
                       eager.generate(ids, max_new_tokens=40, eos_token_id=eos, pad_token_id=0))
    assert dev._slots[b].loop.strategy == strategy


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_one_position_per_sequence_gives_the_host_loops_tokens(lm, strategy):
    """A ragged batch: each sequence at its own position (the step gets them as a (batch,) tensor), with and
    without an EOS id; the scalar generation on the same loop afterwards is unchanged."""
    strategy = _strategy(strategy)
    with torch.no_grad():
        first = _first(4)
        start = torch.tensor([3, 40, 0, 17], device="cuda")
        loop = DeviceDecodeLoop(lm, batch_size=4, chunk=16, strategy=strategy)
        want = host_loop(lm, first, start, 37)
        assert torch.equal(loop.generate(first, start, max_new_tokens=37), want)
        assert loop.strategy == strategy, loop.strategy_reason
        eos, firsts = _eos_ending_rows_at_different_steps(want, V)
        # the pad id is fed back to the model for ended rows, as generate() does: it must be a valid token
        got = loop.generate(first, start, max_new_tokens=37, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(got, host_loop(lm, first, start, 37, eos=eos, pad=0))
        assert got.shape[1] == max(firsts) + 1
        assert torch.equal(loop.generate(first, 7, max_new_tokens=20), host_loop(lm, first, 7, 20))
