"""_torch_compat: which path each private PyTorch API takes on the installed torch (CPU part)."""

from __future__ import annotations

import pytest
import torch

from conftest import GPU_SKIP_REASON
from hipgraph_bridge import _torch_compat as tc


def test_describe_names_every_path():
    paths = tc.describe()
    assert set(paths) == {"torch", "replay", "check_input_liveness", "graph_exit_frame", "pool_release",
                          "weak_outputs", "raw_stream", "pointer_check", "saved_frames", "input_copies"}
    assert paths["torch"] == torch.__version__
    assert paths["saved_frames"] == ("aot_compile" if tc.has_aot_precompile else "unavailable (torch < 2.10)")
    assert paths["graph_exit_frame"] is True  # torch.cuda.graph.__exit__(self, *args) on every supported torch
    assert paths["input_copies"] == "torch._foreach_copy_"  # every supported torch (2.6+) has it


@pytest.mark.parametrize("copy", [tc.copy_all, tc._copy_each])
def test_copy_all_copies_each_pair_whatever_its_dtype(copy):
    dsts = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.long), torch.zeros(()), torch.zeros(5, 2)[1:3]]
    srcs = [torch.randn(2, 3), torch.arange(4), torch.tensor(7.0), torch.randn(2, 2)]
    views = [d for d in dsts]
    copy(dsts, srcs)
    for d, v, s in zip(dsts, views, srcs):
        assert d is v and torch.equal(d, s.to(d.dtype))


@pytest.mark.skipif(GPU_SKIP_REASON is None, reason="the CPU build's paths")
def test_cpu_build_paths():
    paths = tc.describe()
    assert paths["raw_stream"] is False and paths["pointer_check"] == "Python"
    major_minor = tuple(int(v) for v in torch.__version__.split(".")[:2])
    if major_minor >= (2, 13):  # the Python replay checks input liveness: it is kept
        assert paths["check_input_liveness"] is True
        assert paths["replay"] == "CUDAGraph.replay (Python)"
    assert tc.current_raw_stream() is None


def test_graph_context_exception_outside_the_context_is_none():
    assert tc.graph_context_exception(depth=1) == (False, None)


def test_pointer_check_python_fallback():
    a, b = torch.zeros(2), torch.zeros(3)
    ptrs = [a.data_ptr(), None, b.data_ptr()]
    assert tc.pointers_equal([a, 1, b], ptrs, [0, 2])
    assert not tc.pointers_equal([b, 1, a], ptrs, [0, 2])


def test_symbolic_helpers_on_plain_values():
    assert tc.sym_expr(3) is None and tc.sym_hint(3) == 3 and tc.sym_hint(True) is None
    assert tc.sym_range(None, None) == (2, None)  # no shape env: dynamo's usual 0/1 specialisation


def test_gpu_sleep_says_false_where_torch_has_no_sleep_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(cycles), raising=False)
    assert tc.gpu_sleep(12.7) is True and calls == [12]
    monkeypatch.delattr(torch.cuda, "_sleep")
    assert tc.gpu_sleep(100) is False and calls == [12]
