"""Dtype-aware comparison of graph and eager outputs."""

from __future__ import annotations

import torch

from hipgraph_bridge.validation import outputs_match, tolerance_for


def test_tolerances_by_dtype():
    assert tolerance_for(torch.int64).rtol == 0.0 and tolerance_for(torch.bool).atol == 0.0
    assert tolerance_for(torch.float32).rtol < tolerance_for(torch.float16).rtol < tolerance_for(torch.bfloat16).rtol


def test_match_and_mismatch():
    a = torch.randn(8, 8)
    assert outputs_match(a, a.clone())[0]
    assert outputs_match(a, a * (1 + 1e-6))[0]
    ok, why = outputs_match(a, a + 1)
    assert not ok and "max abs difference" in why
    b = a.bfloat16()
    assert outputs_match(b, (a * (1 + 1e-3)).bfloat16())[0]


def test_integer_outputs_must_be_exact():
    x = torch.arange(10)
    assert outputs_match(x, x.clone())[0]
    assert not outputs_match(x, x + (torch.arange(10) == 3))[0]


def test_structure_shape_and_dtype_mismatches():
    a = torch.randn(3)
    assert not outputs_match((a, a), [a, a])[0]
    ok, why = outputs_match(a, a[:2])
    assert not ok and "(3,)" in why and "(2,)" in why
    ok, why = outputs_match({"y": a}, {"y": a.double()})
    assert not ok and "float64" in why
    assert not outputs_match((a, 1), (a, 2))[0]
