"""The pool's hot-path argument check (QuickPlan): what it accepts, and that its shape table never
answers for a shape the layout does not fit."""

import torch

from hipgraph_bridge.padding.layout import QuickPlan, classify


def _plan(*args, batch_dim=0, static_args=()):
    leaves, layout, _ = classify(args, {}, static_args=set(static_args), batch_dim=batch_dim)
    assert QuickPlan.applies(layout)
    return QuickPlan(layout, leaves, batch_dim)


def test_batch_from_every_batched_argument_and_repeat_calls():
    q = _plan(torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.long))
    for n in (4, 1, 7, 4, 7):  # the second time a shape is seen it comes from the table
        got = q.match((torch.zeros(n, 3), torch.zeros(n, 2, dtype=torch.long)))
        assert got is not None and got[1] == n


def test_refuses_what_the_layout_does_not_fit_even_after_the_shapes_were_seen():
    q = _plan(torch.zeros(4, 3), torch.zeros(4, 2))
    assert q.match((torch.zeros(5, 3), torch.zeros(5, 2))) is not None
    assert q.match((torch.zeros(5, 3), torch.zeros(6, 2))) is None  # sizes disagree
    assert q.match((torch.zeros(5, 4), torch.zeros(5, 2))) is None  # a feature size changed
    assert q.match((torch.zeros(5, 3, dtype=torch.float64), torch.zeros(5, 2))) is None  # dtype
    assert q.match((torch.zeros(5, 3, requires_grad=True), torch.zeros(5, 2))) is None  # needs autograd
    assert q.match((torch.zeros(5, 3),)) is None  # argument count
    assert q.match(([0.0] * 3, torch.zeros(5, 2))) is None  # not a tensor
    assert q.match((torch.zeros(0, 3), torch.zeros(0, 2))) is None  # empty batch: the full path words it


def test_static_and_constant_arguments():
    q = _plan(torch.zeros(4, 3), torch.zeros(1, dtype=torch.long), 2, static_args=[1])
    assert q.match((torch.zeros(2, 3), torch.zeros(1, dtype=torch.long), 2))[1] == 2
    assert q.match((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 2)) is None  # static shape changed
    assert q.match((torch.zeros(2, 3), torch.zeros(1, dtype=torch.long), 2.0)) is None  # constant's type
    assert q.match((torch.zeros(2, 3), torch.zeros(1, dtype=torch.long), [2])) is None  # unhashable


def test_batch_dim_other_than_zero():
    q = _plan(torch.zeros(3, 4), batch_dim=1)
    assert q.match((torch.zeros(3, 6),))[1] == 6
    assert q.match((torch.zeros(3, 6),))[1] == 6
    assert q.match((torch.zeros(2, 6),)) is None
