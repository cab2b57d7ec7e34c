"""The greedy token choice's Triton kernel on a GPU (``sampling.greedy``): torch.argmax's tokens bit for bit
(ties to the first, NaN as the largest, -inf rows, odd vocabularies, strided rows, three dtypes), in and out of a
captured graph; a capture that would have to load it gets torch's argmax; the device loop's greedy body runs it
and decodes the host loop's tokens."""

from __future__ import annotations

import pytest
import torch

from hipgraph_bridge.generation import DeviceDecodeLoop, sampling
from hipgraph_bridge.generation.sampling import greedy

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _triton():
    why = sampling.fused_unavailable_reason()
    if why is not None:
        pytest.skip(f"the greedy kernel cannot run here: {why}")


def _same(logits: torch.Tensor) -> None:
    got = greedy(logits, fused=True)
    want = logits.argmax(dim=-1)
    assert got.dtype == torch.long and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 2047, 2048, 2049, 32000, 128256, 152064, 300_001])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_the_kernel_gives_argmax_tokens(dtype, vocab, batch):
    g = torch.Generator("cuda").manual_seed(vocab + batch)
    _same(torch.randn(batch, vocab, device="cuda", generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_first_token_across_programs(dtype):
    vocab = 128256  # 63 programs of 2048 tokens
    x = torch.zeros(6, vocab, device="cuda", dtype=dtype)
    x[1, [5, 100_000]] = 3  # two programs hold the maximum: the first wins
    x[2, [100_000, 127_000]] = 3
    x[3, [2047, 2048]] = 1  # either side of a program's edge
    x[4] = -float("inf")  # every token removed: token 0, as torch says
    x[5] = -1
    x[5, [4096, 9000]] = torch.tensor([-0.0, 0.0], dtype=dtype, device="cuda")  # -0.0 == 0.0: the first
    _same(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_is_the_largest_and_the_first_nan_wins(dtype):
    vocab = 128256
    x = torch.randn(5, vocab, device="cuda").to(dtype)
    x[0, 70_000] = float("nan")
    x[1, [90_000, 3]] = float("nan")  # the lower one, in another program
    x[2, 10] = float("inf")
    x[2, 60_000] = float("nan")  # above +inf
    x[3] = float("nan")
    x[4, 5] = float("inf")  # no NaN: +inf wins
    _same(x)


def test_strided_rows_and_a_last_stride_that_is_not_one():
    wide = torch.randn(4, 40_000, device="cuda")
    _same(wide[:, :32_000])  # rows 40,000 apart
    _same(wide[:, ::2])  # copied to contiguous
    _same(torch.randn(3, 1, 32_000, device="cuda", dtype=torch.bfloat16)[:, -1, :])  # a decode step's slice
    _same(wide[:, 1:32_001])  # 4 bytes off 16-byte alignment: its own compiled kernel


def test_torch_argmax_where_the_kernel_does_not_apply():
    x = torch.randn(2, 100, device="cuda", dtype=torch.float64)
    assert torch.equal(greedy(x), x.argmax(-1))  # fused=None: torch for float64
    with pytest.raises(RuntimeError, match=r"greedy\(fused=True\).*float64"):
        greedy(x, fused=True)
    assert greedy(torch.empty(0, 5, device="cuda")).shape == (0,)
    with pytest.raises((IndexError, RuntimeError), match="argmax"):  # torch's own error passes through
        greedy(torch.empty(2, 0, device="cuda"))


def test_the_kernel_replays_in_a_captured_graph():
    x = torch.randn(4, 128256, device="cuda", dtype=torch.bfloat16)
    greedy(x)  # the eager call loads the kernel
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = greedy(x, fused=True)
    for seed in range(5):
        x.copy_(torch.randn(4, 128256, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        x[seed % 4, 99_999] = 100  # the answer moves
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x.argmax(-1))


def _recording(monkeypatch) -> list[bool]:
    """Calls of the kernel from here on, each as whether it ran inside a capture."""
    module, calls = sampling._fused_module(), []
    real = module.argmax_fused
    monkeypatch.setattr(module, "argmax_fused",
                        lambda x: calls.append(torch.cuda.is_current_stream_capturing()) or real(x))
    return calls


def test_a_capture_that_would_load_the_kernel_gets_torch_argmax(monkeypatch):
    monkeypatch.setattr(sampling._fused_module(), "_argmax_loaded", set())  # as if no eager call had run
    calls = _recording(monkeypatch)
    x = torch.randn(2, 5000, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        with pytest.raises(RuntimeError, match="a capture cannot load it"):
            greedy(x, fused=True)
        out = greedy(x)  # fused=None: torch's argmax, no module load inside the capture
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.argmax(-1))
    assert calls == []
    greedy(x)  # eager: loads it
    assert calls == [False] and sampling._fused_module().argmax_ready(x)


def test_the_greedy_body_runs_the_kernel_and_decodes_the_host_loops_tokens(monkeypatch):
    vocab, batch = 50_000, 3
    table = torch.randn(vocab, vocab // 100, device="cuda")
    proj = torch.randn(vocab // 100, vocab, device="cuda")

    def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return (table[tokens] + position.float()) @ proj

    calls = _recording(monkeypatch)
    first = torch.tensor([1, 2, 3], device="cuda")
    tok, want = first, []
    for i in range(20):
        tok = step(tok, torch.tensor(4 + i, device="cuda")).argmax(-1)
        want.append(tok)
    for strategy in ("native", "host"):
        loop = DeviceDecodeLoop(step, batch_size=batch, chunk=8, strategy=strategy)
        calls.clear()
        got = loop.generate(first, 4, max_new_tokens=20)
        assert loop.strategy == strategy
        assert True in calls, "the captured greedy body chose with torch's argmax"
        assert torch.equal(got, torch.stack(want, dim=1))
        loop.close()
