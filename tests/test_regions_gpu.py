"""Regions on the GPU: a transformers Llama whose decoder layers are one compile region, compiled with the
gfxgraph backend (inductor) and warmed over its buckets, pads (rows proven independent inside the region),
captures a graph per bucket, and replays eager's logits at every size."""

from __future__ import annotations

import pytest
import torch

import gfxgraph
from hipgraph_bridge.compile.backend import compiled_subgraphs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                 reason="torch.compiler.nested_compile_region is missing (added in torch 2.8)")]


def test_a_llama_with_region_layers_is_graphed_padded_and_equals_eager():
    transformers = pytest.importorskip("transformers")
    from _tiny_llama import tiny_llama

    torch._dynamo.reset()
    model = tiny_llama(transformers)
    assert gfxgraph.compile_regions(model.model.layers) == 2

    def step(ids, pos):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, -1, :]

    before = set(compiled_subgraphs())
    f = torch.compile(step, backend="gfxgraph")
    ex = torch.zeros(3, 1, dtype=torch.long, device="cuda")
    with torch.no_grad():
        rep = gfxgraph.warmup(f, ex, ex, buckets=[1, 2, 4, 8], progress=False, one_frame=True)
        assert rep.graphs >= 4
        for n in (1, 3, 5, 8):
            ids = (torch.arange(n, device="cuda").view(n, 1) * 7 + 11) % 1000
            torch.testing.assert_close(f(ids, ids), step(ids, ids), rtol=1e-4, atol=1e-4)
    dynamic = [s for s in compiled_subgraphs() if s not in before and s.plan.batch_symbol is not None]
    assert dynamic and all(s.verdict is not None and s.verdict.reason is None for s in dynamic)
    torch._dynamo.reset()
