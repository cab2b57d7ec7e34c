"""What the device loop adds per iteration: the WHILE loop against the same body replayed in a plain graph.

A diagnostic for issue 26 (not a suite: no targets). For bodies of ``n`` kernels, tiny ones (an in-place
add on 1024 floats) and heavy ones (bf16 2048x2048 linear layers on one row and a scale, two kernels
each, as a decode step's are), a ``DeviceDecodeLoop`` over a step that runs the body and returns ``tokens + 1`` decodes 256 tokens in one
launch (CUDA events, the median of 5 runs), and the same step plus the token's copy, captured in a plain
graph, is replayed 256 times back to back behind a GPU sleep (the GPU's time, not the host's launches).
The difference per iteration is what the loop costs: the conditional node, the bookkeeping kernel, and
whatever a kernel costs more inside a conditional body than in a top-level graph.

The 1.2B model's loop profile (``tools/loop_profile.py``) put the loop's extra time in the model's small
kernels, most in those whose arguments are large (``CatArrayBatchedCopy``'s tensor table, ``reduce_kernel``'s
ReduceOp, TensorIterator's offset calculators for strided operands) and least in cuBLAS's and in contiguous
elementwise kernels (``tiny`` here, which shows no per-kernel cost). So three more small-kernel bodies with
large arguments: ``cat`` (``torch.cat`` of four small tensors), ``mean`` (a row mean) and ``strided`` (an add
on strided views), each at 64 and 256 kernels; ``mixed``, five different small kernels in turn (each body above
repeats one kernel; a model's alternates); ``block``, an RMS norm and a two-projection 2048-wide MLP repeated (the
1.2B model's kinds of kernel, not its sizes), once with one pair of weights (in L2) and once, ``block-stream``,
with each block's own (streamed from memory, as a model's weights are); ``llama-nocache``, the 1.2B model's
forward on one token without a KV cache (the model's kernels, no cache writes), and its parts: the decoder
layers alone (``llama-layers``; their attention halves, ``llama-attention``, and MLP halves, ``llama-mlp``)
and the embedding, final norm and output layer alone (``llama-head``); the MLP's three projections alone,
at the model's width and at 2048 (``proj-8192``, ``proj-2048``); and,
for every body, the plain graph instantiated for device launch (``cudaGraphInstantiateFlagDeviceLaunch``,
launched from the host as usual): if a body's kernels cost more there too, the cost comes with a graph the
device may launch, not with the conditional node.

    python tools/loop_costs.py --out bench-out      # a GPU: JSON and a table
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from gfxgraph.suites._common import capture_graph, gpu_ms_per_replay, write_diagnostic
from gfxgraph.suites.llm_decode import build_model
from hipgraph_bridge.compose.device_launch import instantiate_for_device
from hipgraph_bridge.generation.device_loop import DeviceDecodeLoop
from hipgraph_bridge.graph import SafeCUDAGraph
from hipgraph_bridge.runtime import Graph

TOKENS = 256


def body(kind: str, n: int) -> Callable[[], None]:
    """``n`` kernels of ``kind`` ("tiny": an add on 1024 floats; "cat": four (1, 256) bf16 rows concatenated;
    "mean": a (1, 2048) float row's mean; "strided": an add of two strided (8, 128) float views; "mixed": five
    different small kernels in turn on one row (an add, a row mean, a broadcast subtraction of it, a cat of the
    row's halves, a scale), as a model alternates kernels; "block": ``n // 13`` blocks of an RMS norm and a
    two-projection MLP at hidden 2048 in bf16 (2048 by 2048 projections, ``silu(g) * g``, no gate projection;
    13 kernels each: the 1.2B model's kinds of kernel, not its sizes), one pair of weights for all (in L2);
    "block-stream": the same, each block its own weights (read from memory); "linear": a linear layer and a
    scale, two kernels each, on a (1, 2048) bf16 row; "llama-nocache": the 1.2B model's forward on one token
    without a cache, ``n`` ignored (its difference is per forward, not per kernel); "llama-layers": its 16
    decoder layers alone on one token; "llama-head": its embedding, final norm and output layer alone;
    "llama-attention" / "llama-mlp": each layer's norm and attention / norm and MLP; "proj-8192" /
    "proj-2048": ``n // 3`` layers of three bf16 projections alone on one row, a Llama MLP's gate, up and down
    at the 1.2B model's width (2048 to 8192 and back) / at 2048, each layer its own weights)."""
    if kind == "tiny":
        buf = torch.zeros(1024, device="cuda")

        def tiny() -> None:
            for _ in range(n):
                buf.add_(1.0)
        return tiny
    if kind == "cat":
        parts = [torch.randn(1, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        joined = torch.empty(1, 1024, device="cuda", dtype=torch.bfloat16)

        def cat() -> None:
            for _ in range(n):
                torch.cat(parts, dim=-1, out=joined)
        return cat
    if kind == "mean":
        row, m = torch.randn(1, 2048, device="cuda"), torch.empty(1, 1, device="cuda")

        def mean() -> None:
            for _ in range(n):
                torch.mean(row, dim=-1, keepdim=True, out=m)
        return mean
    if kind == "strided":
        a, b = torch.randn(8, 256, device="cuda"), torch.randn(8, 256, device="cuda")
        out = torch.empty(8, 128, device="cuda")

        def strided() -> None:
            for _ in range(n):
                torch.add(a[:, ::2], b[:, 1::2], out=out)
        return strided
    if kind == "mixed":
        a, m = torch.randn(1, 2048, device="cuda"), torch.empty(1, 1, device="cuda")
        halves = torch.empty(2, 1024, device="cuda")
        kernels = (lambda: a.add_(1e-3), lambda: torch.mean(a, dim=-1, keepdim=True, out=m), lambda: a.sub_(m),
                   lambda: torch.cat((a[:, :1024], a[:, 1024:]), dim=0, out=halves), lambda: a.mul_(0.5))

        def mixed() -> None:
            for i in range(n):
                kernels[i % len(kernels)]()
        return mixed
    if kind == "llama-nocache":
        model = build_model("llama-1.2b")
        ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")

        def forward() -> None:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
        return forward
    if kind in ("llama-layers", "llama-head", "llama-attention", "llama-mlp"):
        model = build_model("llama-1.2b")
        inner, ids = model.model, torch.zeros(1, 1, dtype=torch.long, device="cuda")
        with torch.no_grad():
            h0 = inner.embed_tokens(ids)
            rope = inner.rotary_emb(h0, torch.zeros(1, 1, dtype=torch.long, device="cuda"))

        def layers() -> None:  # the decoder layers alone, on one token (no mask is needed for one)
            with torch.no_grad():
                h = h0
                for layer in inner.layers:
                    out = layer(h, attention_mask=None, position_embeddings=rope)
                    h = out[0] if isinstance(out, tuple) else out

        def head() -> None:  # the embedding, the final norm and the output layer
            with torch.no_grad():
                model.lm_head(inner.norm(inner.embed_tokens(ids)))

        def attention() -> None:  # each layer's norm and attention (its projections, rotary, SDPA), no MLP
            with torch.no_grad():
                h = h0
                for layer in inner.layers:
                    h = h + layer.self_attn(layer.input_layernorm(h), attention_mask=None,
                                            position_embeddings=rope)[0]

        def mlp() -> None:  # each layer's norm and MLP, no attention
            with torch.no_grad():
                h = h0
                for layer in inner.layers:
                    h = h + layer.mlp(layer.post_attention_layernorm(h))
        return {"llama-layers": layers, "llama-head": head, "llama-attention": attention, "llama-mlp": mlp}[kind]
    if kind in ("proj-8192", "proj-2048"):
        wide = 8192 if kind == "proj-8192" else 2048
        h = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
        mid = torch.empty(1, wide, device="cuda", dtype=torch.bfloat16)
        layers = [tuple(torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02
                        for shape in ((wide, 2048), (wide, 2048), (2048, wide))) for _ in range(max(1, n // 3))]

        def projections() -> None:  # three projections a layer, as a Llama MLP's, and nothing else
            for gate, up, down in layers:
                torch.nn.functional.linear(h, gate, out=mid)
                torch.nn.functional.linear(h, up, out=mid)
                torch.nn.functional.linear(mid, down, out=h)
        return projections
    if kind in ("block", "block-stream"):
        h = torch.randn(1, 1, 2048, device="cuda", dtype=torch.bfloat16)
        norm_w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
        blocks = max(1, n // 13)
        # "block" reuses one pair of weights (16 MiB, in L2); "block-stream" gives each block its own, read
        # from memory as a model's are
        pairs = [tuple(torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2))
                 for _ in range(blocks if kind == "block-stream" else 1)]

        def block() -> None:  # 13 kernels a block: an RMS norm, a 2048-wide MLP and its residual, bf16
            for i in range(blocks):
                up, down = pairs[i % len(pairs)]
                x = h.float()
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
                x = norm_w * x.to(torch.bfloat16)
                g = torch.nn.functional.linear(x, up)
                h.add_(torch.nn.functional.linear(torch.nn.functional.silu(g) * g, down))
        return block
    ws = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(n // 2)]
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)

    def linears() -> None:
        h = x
        for w in ws:
            h = torch.nn.functional.linear(h, w) * 0.01
        x.copy_(h)
    return linears


def loop_us(run: Callable[[], None]) -> float:
    """Microseconds per token of a loop over ``run``, 256 tokens in one launch."""
    def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        run()
        return tokens + 1

    loop = DeviceDecodeLoop(step, batch_size=1, chunk=TOKENS)
    tok, pos = torch.zeros(1, dtype=torch.long, device="cuda"), torch.zeros((), dtype=torch.long, device="cuda")
    loop.generate(tok, pos, max_new_tokens=4)  # captured
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loop.generate(tok, pos, max_new_tokens=TOKENS)
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / TOKENS)
    loop.close()
    return statistics.median(runs)


def graph_us(run: Callable[[], None]) -> float:
    """Microseconds per replay of ``run`` and a token copy in a plain graph, replayed behind a GPU sleep."""
    tok = torch.zeros(1, dtype=torch.long, device="cuda")
    g = capture_graph(lambda: (run(), tok.add_(1)))
    return statistics.median(gpu_ms_per_replay(g.replay, TOKENS) * 1e3 for _ in range(5))


def device_launchable_graph_us(run: Callable[[], None]) -> float:
    """As :func:`graph_us`, the graph instantiated for device launch (and launched from the host)."""
    tok = torch.zeros(1, dtype=torch.long, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = SafeCUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        run()
        tok.add_(1)
    stream = torch.cuda.current_stream()
    exe = instantiate_for_device(Graph.from_torch(g), stream=stream, track_completion=False)
    handle = stream.cuda_stream
    return statistics.median(gpu_ms_per_replay(lambda: exe.launch(handle), TOKENS) * 1e3 for _ in range(5))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out")
    p.add_argument("--kinds", default="", help="comma-separated bodies to run (default: all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("loop_costs: needs a GPU")
    results = {}
    kinds = (("tiny", (1, 16, 64, 256)), ("cat", (64, 256)), ("mean", (64, 256)), ("strided", (64, 256)),
             ("mixed", (64, 256)), ("block", (65, 260)),
             ("block-stream", (65, 260)), ("linear", (16, 64)),
             ("llama-nocache", (1,)), ("llama-layers", (1,)), ("llama-head", (1,)),
             ("llama-attention", (1,)), ("llama-mlp", (1,)), ("proj-8192", (48,)), ("proj-2048", (48,)))
    wanted = set(args.kinds.split(",")) if args.kinds else {k for k, _ in kinds}
    for kind, sizes in (k for k in kinds if k[0] in wanted):
        for n in sizes:
            run = body(kind, n)
            lp, gr = loop_us(run), graph_us(run)
            try:
                dl: float | None = device_launchable_graph_us(run)
            except Exception as exc:  # a diagnostic: say why and go on
                dl, why = None, f"{type(exc).__name__}: {exc}"
            results[f"{n} {kind} kernels"] = {"loop_us_per_iteration": lp, "graph_us_per_replay": gr,
                                              "difference_us": lp - gr,
                                              "difference_us_per_kernel": (lp - gr) / n,
                                              "device_launchable_graph_us_per_replay": dl}
            if dl is None:
                results[f"{n} {kind} kernels"]["device_launchable_graph_error"] = why
            print(f"{n} {kind} kernels: loop {lp:.2f} us/iteration, plain graph {gr:.2f} us/replay, "
                  f"difference {lp - gr:.2f} us ({(lp - gr) / n:.3f} per kernel); device-launchable graph "
                  f"{'-' if dl is None else f'{dl:.2f}'} us/replay", flush=True)
    write_diagnostic(args.out, "loop_costs", {"method": __doc__, "results": results})


if __name__ == "__main__":
    main()
