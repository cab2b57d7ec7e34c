"""What recording one run of a model costs, per recorder PyTorch offers (a diagnostic, not a benchmark).

The pool's row analysis records its first warm-up run at the dispatcher level (a Python
``TorchDispatchMode``, :class:`hipgraph_bridge.padding.rows.RowTracer`). Issue 24 asks that this cost
at most 0.25 of one eager run. This measures, on the same model and input, interleaved, median of
``--repeats`` each, the run:

- eager;
- under a dispatch mode that only runs each op (the floor of any Python dispatcher-level record);
- under a function mode that only runs each torch call (the floor of the tracer's second mode,
  which sees the batch size read from shapes and ``tolist()``);
- under the row analysis's tracer (both modes), verdict included;
- under PyTorch's C++ ``torch.profiler.ExecutionTraceObserver``, which records every op's schema,
  tensor ids, storage ids, offsets, shapes and strides (what an offline row analysis would need),
  written to a temporary file;
- under ``torch.profiler.profile(record_shapes=True)`` (C++ op events with shapes, no tensor
  identities: not enough for the analysis, shown as the cheapest C++ record);
- under TorchScript's tracer (``torch.jit._get_trace_graph``, C++: a graph of aten nodes with their
  values and shapes, enough for an analysis). A function that closes over parameters that require
  grad is refused ("Cannot insert a Tensor that requires grad as a constant"), as the pool's users'
  closures over a model are, so the step is wrapped in a module that holds the model here.

Model: a small Llama from transformers when it is installed (``--layers``, random weights, a decode
step ``model(input_ids, position_ids)``), else a stack of Linear/LayerNorm/SiLU blocks. On the CPU
unless ``--device cuda``.

    python tools/recorder_costs.py [--device cuda] [--layers 4] [--batch 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ExecutionTraceObserver, profile

from gfxgraph.suites._common import environment
from hipgraph_bridge._torch_compat import RowDispatchMode
from hipgraph_bridge.padding.rows import RowTracer


class PassThrough(RowDispatchMode):
    """Runs each op and nothing else."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class PassThroughCalls(TorchFunctionMode):
    """Runs each torch call and nothing else; counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


class AsModule(torch.nn.Module):
    """``step`` as a module that holds the weights (TorchScript's tracer refuses closures over them)."""

    def __init__(self, step: Callable[[torch.Tensor], Any], holder: torch.nn.Module) -> None:
        super().__init__()
        self.step, self.holder = step, holder

    def forward(self, x: torch.Tensor) -> Any:
        return self.step(x)


def build(layers: int, device: str) -> tuple[Callable[[torch.Tensor], Any], str]:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        blocks = [torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 512), torch.nn.SiLU(),
                                      torch.nn.Linear(512, 256)) for _ in range(layers * 4)]
        mlp = torch.nn.Sequential(*blocks).to(device).eval()
        return (lambda x: mlp(x.float().expand(-1, 256))), f"{layers * 4} MLP blocks (transformers missing)"
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=1024)
    model = LlamaForCausalLM(cfg).to(device).eval()
    return (lambda ids: model(input_ids=ids, position_ids=ids, use_cache=False).logits[:, -1, :]), \
        f"Llama, {layers} layers, hidden 256 (transformers, random weights)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    step, what = build(args.layers, args.device)
    z = torch.zeros(args.batch, 1, dtype=torch.long, device=args.device)
    folder = tempfile.mkdtemp()
    ops = {"n": 0, "calls": 0}

    def eager() -> None:
        step(z)

    def floor() -> None:
        with PassThrough():
            step(z)

    def calls_floor() -> None:
        with PassThroughCalls() as mode:
            step(z)
        ops["calls"] = mode.calls

    def traced() -> None:
        tracer = RowTracer([(z, 0)], rows=args.batch)
        with tracer:
            y = step(z)
        tracer.verdict(y)
        ops["n"] = tracer.ops

    def execution_trace() -> None:
        obs = ExecutionTraceObserver()
        obs.register_callback(os.path.join(folder, "et.json"))
        obs.start()
        step(z)
        obs.stop()
        obs.unregister_callback()

    def profiler_shapes() -> None:
        with profile(record_shapes=True):
            step(z)

    holder = next((c for c in getattr(step, "__closure__", None) or ()
                   if isinstance(c.cell_contents, torch.nn.Module)), None)
    module = AsModule(step, holder.cell_contents) if holder is not None else None

    def jit_trace() -> None:
        torch.jit._get_trace_graph(module, (z,))

    modes = {"eager": eager, "pass-through dispatch mode": floor, "pass-through function mode": calls_floor,
             "row analysis tracer": traced,
             "ExecutionTraceObserver": execution_trace, "profiler record_shapes": profiler_shapes}
    if module is not None:
        modes["TorchScript tracer (module)"] = jit_trace
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in modes}
    with torch.no_grad():
        for fn in modes.values():
            fn()
        for _ in range(args.repeats):
            for name, fn in modes.items():
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = {k: {"ms": v, "over_eager_minus_1": v / med["eager"] - 1} for k, v in med.items()}
    print(f"{what}, batch {args.batch}, {ops['n']} aten ops, {ops['calls']} torch calls, {args.device}")
    for k, r in rows.items():
        print(f"  {k:28s} {r['ms']:8.2f} ms   {r['over_eager_minus_1']:+.2f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "recorder_costs.json"), "w") as f:
            json.dump({"environment": environment(), "model": what, "batch": args.batch, "ops": ops["n"],
                       "torch_calls": ops["calls"], "device_arg": args.device, "repeats": args.repeats, "modes": rows,
                       "target": "row analysis tracer <= 0.25 (issue 24)"}, f, indent=1)


if __name__ == "__main__":
    main()
