"""The row analysis (:mod:`hipgraph_bridge.padding.rows`) on CPU: which models may be padded, and why not.

Each case is a small model with the verdict it must get from one traced run:
row-independent models must stay padded (``reason is None``, every output's
``Rows`` right, and a padded run leaves the real rows unchanged, which checks
the expectation itself); coupled, unproven, random and stateful models must
be refused with the right :class:`~hipgraph_bridge.fallbacks.Reason`. Models
are built outside the traced call (building one inside writes its parameters).

Cases the analysis gets wrong today are ``xfail(strict=True)`` with the rule
at fault in the reason, so that a fix shows up as an XPASS to promote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from hipgraph_bridge.fallbacks import Reason
from hipgraph_bridge.padding.fx import trace_graph
from hipgraph_bridge.padding.rows import RowTracer, RowVerdict, Rows
from hipgraph_bridge._torch_compat import pytree

R0, R1 = Rows(0), Rows(1)


@dataclass(frozen=True)
class Call:
    """One call of a model: ``fn(*args)``, with ``batched`` (arg index -> batch dim) and static inputs."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    batched: dict[int, int] = field(default_factory=lambda: {0: 0})
    statics: tuple[torch.Tensor, ...] = ()


def trace(call: Call, names: dict[int, str] | None = None) -> RowVerdict:
    batched = [(call.args[i], d) for i, d in call.batched.items()]
    with torch.no_grad(), RowTracer(batched, call.statics, names=names) as tracer:
        out = call.fn(*call.args)
    return tracer.verdict(out)


def padded_args(call: Call, extra: int = 3) -> tuple[Any, ...]:
    """The call's arguments with ``extra`` rows appended to each batched one (other rows' data, changed)."""
    args = list(call.args)
    for i, d in call.batched.items():
        t = args[i]
        n = t.shape[d]
        fill = t.index_select(d, torch.arange(extra).remainder(n).flip(0))
        if t.is_floating_point():
            fill = fill * 3 + 1
        args[i] = torch.cat([t, fill], d)
    return tuple(args)


def assert_padding_keeps_rows(call: Call, rows: tuple[Rows | None, ...]) -> None:
    """Ground truth for an independent model: the padded run's real rows equal the unpadded run's."""
    n = next(iter(call.args[i].shape[d] for i, d in call.batched.items()))
    with torch.no_grad():
        want = pytree.tree_leaves(call.fn(*call.args))
        got = pytree.tree_leaves(call.fn(*padded_args(call)))
    assert len(want) == len(got) == len(rows)
    for k, (w, g, r) in enumerate(zip(want, got, rows)):
        if not isinstance(w, torch.Tensor):
            assert w == g, f"leaf {k}"
            continue
        if r is not None:
            g = g.narrow(r.dim, 0, n * r.inner)
        assert g.shape == w.shape, f"leaf {k}: {tuple(g.shape)} != {tuple(w.shape)}"
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=f"leaf {k}")


def padding_changes_rows(call: Call) -> bool:
    """Ground truth for a coupled model: padding changes the real rows' results (values or shape), or fails."""
    (i, d), = list(call.batched.items())[:1]
    n = call.args[i].shape[d]
    with torch.no_grad():
        want = pytree.tree_leaves(call.fn(*call.args))
        try:
            got = pytree.tree_leaves(call.fn(*padded_args(call)))
        except (RuntimeError, IndexError):
            return True
    for w, g in zip(want, got):
        if not isinstance(w, torch.Tensor):
            if w != g:
                return True
            continue
        if g.dim() > d and g.shape[d] > n:
            g = g.narrow(d, 0, n)
        if g.shape != w.shape or not torch.allclose(g.float(), w.float()):
            return True
    return False


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _bug(why: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=why)


# ------------------------------------------------------------------------------------- independent models
# Each builder returns the Call; the table pairs it with the outputs' Rows.


def mlp_gelu_silu() -> Call:
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4), nn.SiLU()).eval()
    return Call(m, (_x(5, 8),))


def sdpa_causal() -> Call:  # (B, H, L, E)
    return Call(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), (_x(5, 2, 6, 4),))


def sdpa_bool_mask() -> Call:
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(1)) > 0.4
    mask.fill_diagonal_(True)  # (L, S), the same for every row
    return Call(lambda q: F.scaled_dot_product_attention(q, q, q, attn_mask=mask), (_x(5, 2, 6, 4),))


def sdpa_key_padding_mask() -> Call:
    keep = torch.ones(5, 6, dtype=torch.bool)
    keep[1, 4:] = keep[3, 2:] = False  # (B, S): each row's own padding

    def f(q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, attn_mask=keep[:, None, None, :])

    return Call(f, (_x(5, 2, 6, 4), keep), {0: 0, 1: 0})


def mha_batch_first_eval() -> Call:
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    return Call(lambda s: mha(s, s, s, need_weights=False)[0], (_x(5, 6, 8),))


def encoder_layer_batch_first_eval() -> Call:
    enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True).eval()
    return Call(enc, (_x(5, 6, 8),))


def mha_seq_first() -> Call:  # (L, B, E): not the fast path, the batch in dim 1
    mha = nn.MultiheadAttention(8, 2).eval()
    return Call(lambda s: mha(s, s, s, need_weights=False)[0], (_x(6, 5, 8),), {0: 1})


def encoder_layer_seq_first() -> Call:
    enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1).eval()
    return Call(enc, (_x(6, 5, 8),), {0: 1})


def layer_norm() -> Call:
    return Call(nn.LayerNorm(8), (_x(5, 8),))


def rms_norm() -> Call:
    return Call(nn.RMSNorm(8), (_x(5, 8),))


def group_and_instance_norm() -> Call:
    m = nn.Sequential(nn.GroupNorm(2, 4), nn.InstanceNorm1d(4)).eval()
    return Call(m, (_x(5, 4, 6),))


def batch_norm_eval() -> Call:
    bn = nn.BatchNorm1d(8).eval()
    bn.running_mean.uniform_(-1, 1)
    return Call(bn, (_x(5, 8),))


def embedding_masked_mean() -> Call:
    emb = nn.Embedding(10, 4)
    ids = torch.randint(0, 10, (5, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(5, 6)
    mask[0, 3:] = mask[4, 1:] = 0

    def pool(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = emb(ids) * mask[..., None]  # (B, S, D)
        return h.sum(1) / mask.sum(1, keepdim=True)

    return Call(pool, (ids, mask), {0: 0, 1: 0})


def conv1d_maxpool() -> Call:
    m = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool1d(2)).eval()
    return Call(m, (_x(5, 3, 8),))


def conv2d_pool_interpolate() -> Call:
    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2), nn.AvgPool2d(2)).eval()

    def f(x: torch.Tensor) -> torch.Tensor:
        y = conv(x)  # (B, 4, 2, 2)
        return F.interpolate(y, scale_factor=2, mode="bilinear") + F.adaptive_avg_pool2d(y, 1)

    return Call(f, (_x(5, 3, 8, 8),))


def topk_sort_softmax_over_features() -> Call:
    def f(x: torch.Tensor) -> Any:
        top = x.topk(3, dim=1)
        return top.values, x.sort(dim=-1).indices, x.softmax(-1), x.max(1).values

    return Call(f, (_x(5, 8),))


def scans_over_batch() -> Call:  # row i depends on rows <= i: padding at the end keeps the real rows
    return Call(lambda x: (x.cumsum(0), x.cummax(0).values, torch.logcumsumexp(x, 0)), (_x(5, 4),))


def flat_scan_over_merged_batch() -> Call:  # flat index i*F + j still sees only rows <= i
    return Call(lambda x: x.reshape(-1).cumsum(0), (_x(5, 4),))


def gather_per_row() -> Call:
    return Call(lambda x: x.gather(1, x.argsort(1)[:, :3]) + torch.take_along_dim(x, x.argmax(1, True), 1),
                (_x(5, 8),))


def einsum_per_row() -> Call:
    w = _x(4, 3, seed=3)
    return Call(lambda q: (torch.einsum("bhld,bhmd->bhlm", q, q), torch.einsum("bhld,de->bhle", q, w)),
                (_x(5, 2, 6, 4),))


def merge_batch_then_pointwise() -> Call:  # (B, S, D) -> (B*S, D): inner = S
    return Call(lambda x: (x.reshape(-1, 4) * 2).relu(), (_x(5, 3, 4),))


def merge_and_split_back() -> Call:
    lin = nn.Linear(4, 4)
    return Call(lambda x: lin(x.flatten(0, 1)).view(x.shape[0], 3, 4).transpose(1, 2), (_x(5, 3, 4),))


def masked_assignment() -> Call:
    def f(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[x < 0] = 0
        return x

    return Call(f, (_x(5, 8),))


def preallocated_by_column_slices() -> Call:
    def f(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], 16)
        out[:, :8] = x
        out[:, 8:] = x.exp()
        return out

    return Call(f, (_x(5, 8),))


def time_major_batch_dim1() -> Call:  # (T, B, F): features per step, pooled over time
    lin = nn.Linear(4, 6)

    def f(x: torch.Tensor) -> Any:
        h = lin(x).tanh()
        return h, h.mean(0), h.softmax(-1).amax(0, keepdim=True)

    return Call(f, (_x(7, 5, 4),), {0: 1})


def cdist_to_centroids() -> Call:
    c = _x(4, 8, seed=4)
    return Call(lambda x: torch.cdist(x, c).argmin(1), (_x(5, 8),))


def per_row_outer_and_bmm() -> Call:
    return Call(lambda x: torch.bmm(x[:, :, None] * x[:, None, :], x[:, :, None]).squeeze(-1), (_x(5, 4),))


def dropout_eval() -> Call:
    return Call(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).eval(), (_x(5, 8),))


def normalize_and_cosine_over_features() -> Call:
    return Call(lambda x: F.normalize(x, dim=1) + F.cosine_similarity(x, x.flip(1), dim=1)[:, None], (_x(5, 8),))


def two_inputs_in_different_dims() -> Call:  # x (B, F), y (F, B)
    return Call(lambda x, y: (x + y.T, torch.cat([x, y.T], 1)), (_x(5, 4), _x(4, 5, seed=1)), {0: 0, 1: 1})


# over-refused or mislabelled today: the verdict each should get, with the rule at fault

def pick_per_row_by_arange() -> Call:  # h[arange(B), idx]: last-token pooling
    return Call(lambda x: x[torch.arange(x.shape[0]), x.argmax(1)], (_x(5, 8),))


def zero_rows_by_mask() -> Call:
    def f(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[x[:, 0] > 0] = 0  # a (B,) mask zeroes whole rows
        return x

    return Call(f, (_x(5, 8),))


def row_mask_fill_square() -> Call:  # the same rule with B == F: no refusal, but the wrong dim
    def f(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        out[x[:, 0] > 0] = 1.0
        return out

    return Call(f, (_x(4, 4),))


def zeros_like_output() -> Call:
    return Call(lambda x: (x * 2, torch.zeros_like(x), x.new_zeros(x.shape[0], 3)), (_x(5, 4),))


def write_through_stale_view() -> Call:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        v = y[:, :2]
        y.zero_()
        v.copy_(x[:, :2] * 2)  # y now holds x's rows again
        return y

    return Call(f, (_x(5, 4),))


def embedding_bag_per_row() -> Call:
    bag = nn.EmbeddingBag(10, 4, mode="mean")
    return Call(bag, (torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(5)),))


def prelu() -> Call:
    return Call(nn.PReLU(8), (_x(5, 8),))


def glu_over_features() -> Call:
    return Call(lambda x: F.glu(x, -1), (_x(5, 8),))


def lstm_batch_first() -> Call:
    lstm = nn.LSTM(4, 3, batch_first=True)
    return Call(lambda x: lstm(x)[0], (_x(5, 6, 4),))


def cross_entropy_per_row() -> Call:
    return Call(lambda x: F.cross_entropy(x, x.argmin(1), reduction="none"), (_x(5, 8),))


def masked_fill_tensor_value() -> Call:
    return Call(lambda x: x.masked_fill(x < 0, torch.tensor(-1.0)), (_x(5, 8),))


def _case(make: Callable[[], Call], rows: tuple[Rows | None, ...], marks: Any = ()) -> Any:
    return pytest.param(make, rows, id=make.__name__, marks=marks)


INDEPENDENT = [
    _case(mlp_gelu_silu, (R0,)),
    _case(sdpa_causal, (R0,)),
    _case(sdpa_bool_mask, (R0,)),
    _case(sdpa_key_padding_mask, (R0,)),
    _case(mha_seq_first, (R1,)),
    _case(encoder_layer_seq_first, (R1,)),
    _case(layer_norm, (R0,)),
    _case(rms_norm, (R0,)),
    _case(group_and_instance_norm, (R0,)),
    _case(batch_norm_eval, (R0,)),
    _case(embedding_masked_mean, (R0,)),
    _case(conv1d_maxpool, (R0,)),
    _case(conv2d_pool_interpolate, (R0,)),
    _case(topk_sort_softmax_over_features, (R0,) * 4),
    _case(scans_over_batch, (R0,) * 3),
    _case(flat_scan_over_merged_batch, (Rows(0, 4),)),
    _case(gather_per_row, (R0,)),
    _case(einsum_per_row, (R0, R0)),
    _case(merge_batch_then_pointwise, (Rows(0, 3),)),
    _case(merge_and_split_back, (R0,)),
    _case(masked_assignment, (R0,)),
    _case(preallocated_by_column_slices, (R0,)),
    _case(time_major_batch_dim1, (R1, R0, R1)),
    _case(cdist_to_centroids, (R0,)),
    _case(per_row_outer_and_bmm, (R0,)),
    _case(dropout_eval, (R0,)),
    _case(normalize_and_cosine_over_features, (R0,)),
    _case(two_inputs_in_different_dims, (R0, R0)),
    # found wrong once, fixed since
    _case(mha_batch_first_eval, (R0,)),
    _case(encoder_layer_batch_first_eval, (R0,)),
    _case(pick_per_row_by_arange, (R0,)),
    _case(zero_rows_by_mask, (R0,)),
    _case(row_mask_fill_square, (R0,)),
    _case(zeros_like_output, (R0, R0, R0)),
    _case(write_through_stale_view, (R0,)),
    _case(embedding_bag_per_row, (R0,), marks=_bug(
        "_embedding_bag is in _data_shaped ('result size depends on the values'): a 2-D input's bags are its "
        "rows, yet it is ROWS_COUPLED")),
    _case(prelu, (R0,)),
    _case(glu_over_features, (R0,)),
    _case(lstm_batch_first, (R0,), marks=_bug("aten.mkldnn_rnn_layer (nn.LSTM on CPU) has no rule: UNPROVEN")),
    _case(cross_entropy_per_row, (R0,)),
    _case(masked_fill_tensor_value, (R0,)),
]


@pytest.mark.parametrize("make, rows", INDEPENDENT)
def test_independent_model_stays_padded(make: Callable[[], Call], rows: tuple[Rows | None, ...]) -> None:
    call = make()
    v = trace(call)
    assert v.reason is None, f"{v.reason}: {v.detail}"
    assert v.outputs == rows
    assert not v.stateful and v.ops > 0
    assert_padding_keeps_rows(call, rows)


# ------------------------------------------------------------------------------------------ refused models


class Accumulator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum(0))  # not +=: FX's symbolic trace turns that into an out-of-place add
        return x * 2


class StepCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return x * 2


def _kv_cache_step() -> Call:
    cache = torch.zeros(8, 3, 4)  # (B_max, T, D) held by the closure

    def step(k: torch.Tensor) -> torch.Tensor:
        cache[: k.shape[0], 1] = k
        return cache[: k.shape[0], :2].sum(1)

    return Call(step, (_x(5, 4),))


def _writes_static_input() -> Call:
    pos = torch.zeros(1, dtype=torch.long)

    def step(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        pos.add_(1)
        return x + pos

    return Call(step, (_x(5, 4), pos), statics=(pos,))


def _writes_out_into_closure() -> Call:
    buf = torch.zeros(5, 4)
    return Call(lambda x: torch.mul(x, 2, out=buf), (_x(5, 4),))


def _writes_parameter() -> Call:
    lin = nn.Linear(4, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        lin.bias.mul_(0.5)
        return lin(x)

    return Call(f, (_x(5, 4),))


class _LazyCache(nn.Module):
    """Makes its cache, sized by the batch, on the first call and keeps it: state from then on."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.zeros(x.shape[0], x.shape[1])
        self.cache[:, :1] = x[:, :1]
        return x + 1


def _host_gate(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if x.min() > 0 else x


def _item_scale(x: torch.Tensor) -> torch.Tensor:
    return x / float(x.abs().max().item())


def _any_gate(x: torch.Tensor) -> torch.Tensor:
    return x.relu() if (x > 3).any() else x


def _equal_gate(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if torch.equal(x, x.abs()) else x


def _allclose_gate(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if torch.allclose(x, x.abs()) else x


def _tolist_gate(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if max(x[:, 0].tolist()) > 0 else x


def _fill_with_batch_max(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x).fill_(x.max())


def _count_masked_rows_square(x: torch.Tensor) -> torch.Tensor:  # x (B, B)
    out = torch.zeros_like(x)
    out[x[:, 0] > 0] = 1.0
    return out.sum(0)  # how many rows pass: every row's answer depends on every row


def _mean_by_batch_size(x: torch.Tensor) -> torch.Tensor:
    return x / x.shape[0]


def _segment_sum(x: torch.Tensor) -> torch.Tensor:  # rows scattered into 2 buckets
    seg = torch.tensor([0, 1, 0, 1, 0])
    return torch.zeros(2, x.shape[1]).index_add_(0, seg, x)


MM = lambda x: (x - x.min(0).values) / (x.max(0).values - x.min(0).values)  # noqa: E731
X = _x(5, 8)
COUPLED = Reason.ROWS_COUPLED


def _params(*cases: tuple) -> list[Any]:
    out = []
    for case in cases:
        name, make, reason, match, *marks = case
        out.append(pytest.param(make, reason, match, id=name, marks=marks))
    return out


def _zero_last_row(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y[-1] = 0  # a constant written into the row the batch's size picks: padded, another row
    return y


_TABLE = torch.tensor([6, 1, 4, 0, 2, 3, 5, 7, 9, 8])


def _table_rows_as_index(x: torch.Tensor) -> torch.Tensor:
    return x[_TABLE[torch.arange(x.shape[0])].remainder(x.shape[0])]  # the table's values, not arange's


def _arange_written_then_index(x: torch.Tensor) -> torch.Tensor:
    i = torch.arange(x.shape[0])
    i[-1:].fill_(0)  # written through a view: no longer each row's own index
    return x[i]


def _arange_masked_then_index(x: torch.Tensor) -> torch.Tensor:
    i = torch.arange(x.shape[0])
    i[i == 2] = x.shape[0] - 1
    return x[i]


REFUSED = _params(
    # rows coupled: (id, builder, reason, words the detail must contain)
    ("min_max_normalisation", lambda: Call(MM, (X,)), COUPLED, "reduces over the batch"),
    ("minus_batch_max", lambda: Call(lambda x: x - x.max(0).values, (X,)), COUPLED, "aten.max"),
    ("topk_over_batch", lambda: Call(lambda x: x.topk(2, dim=0).values, (X,)), COUPLED, "aten.topk"),
    ("median_over_batch", lambda: Call(lambda x: x.median(0).values, (X,)), COUPLED, "aten.median"),
    ("argmax_over_batch", lambda: Call(lambda x: x.argmax(0), (X,)), COUPLED, "aten.argmax"),
    ("sort_over_batch", lambda: Call(lambda x: x.sort(0).values, (X,)), COUPLED, "aten.sort"),
    ("batch_mean", lambda: Call(lambda x: x - x.mean(0), (X,)), COUPLED, "aten.mean"),
    ("batch_var", lambda: Call(lambda x: x / x.var(0), (X,)), COUPLED, "aten.var"),
    ("batch_norm_of_columns", lambda: Call(lambda x: F.normalize(x, dim=0), (X,)), COUPLED, "norm"),
    ("whole_tensor_sum", lambda: Call(lambda x: x / x.sum(), (X,)), COUPLED, "aten.sum"),
    ("softmax_over_batch", lambda: Call(lambda x: x.softmax(0), (X,)), COUPLED, "softmax"),
    ("gram_x_xT", lambda: Call(lambda x: x @ x.T, (X,)), COUPLED, "rows of the batch meet"),
    ("gram_xT_x", lambda: Call(lambda x: x.T @ x, (X,)), COUPLED, "contracts over the batch"),
    ("einsum_over_batch", lambda: Call(lambda x: torch.einsum("bi,bj->ij", x, x), (X,)), COUPLED, "contracts"),
    ("pairwise_across_batch", lambda: Call(lambda x: torch.cdist(x, x), (X,)), COUPLED, "meet"),
    ("batch_norm_train_untracked",
     lambda: Call(nn.BatchNorm1d(8, track_running_stats=False).train(), (X,)), COUPLED, "batch norm"),
    ("cat_along_batch", lambda: Call(lambda x: torch.cat([x, x * 2], 0), (X,)), COUPLED, "concatenates"),
    ("last_row", lambda: Call(lambda x: x * x[-1], (X,)), COUPLED, "selects one row"),
    ("permuted_rows", lambda: Call(lambda x: x[torch.arange(x.shape[0]).flip(0)], (X,)), COUPLED, "indexes the batch"),
    ("zero_last_row", lambda: Call(_zero_last_row, (X,)), COUPLED, "selects one row"),
    ("table_rows_as_index", lambda: Call(_table_rows_as_index, (X,)), COUPLED, "indexes the batch"),
    ("arange_written_then_index", lambda: Call(_arange_written_then_index, (X,)), COUPLED, "indexes the batch"),
    ("arange_masked_then_index", lambda: Call(_arange_masked_then_index, (X,)), COUPLED, "indexes the batch"),
    ("flip_batch", lambda: Call(lambda x: x.flip(0), (X,)), COUPLED, "aten.flip"),
    ("roll_batch", lambda: Call(lambda x: x.roll(1, 0), (X,)), COUPLED, "aten.roll"),
    ("diff_along_batch", lambda: Call(lambda x: x[1:] - x[:-1], (X,)), COUPLED, "slices the batch"),
    ("merged_view_softmax", lambda: Call(lambda x: x.view(-1).softmax(0), (X,)), COUPLED, "softmax"),
    ("reverse_cumsum", lambda: Call(lambda x: x.flip(0).cumsum(0).flip(0), (X,)), COUPLED, "aten.flip"),
    ("scan_out_of_order", lambda: Call(lambda x: x.T.reshape(-1).cumsum(0), (X,)), COUPLED, "repeats"),
    ("pad_along_batch", lambda: Call(lambda x: F.pad(x, (0, 0, 1, 0)), (X,)), COUPLED, "pads the batch"),
    ("nonzero", lambda: Call(lambda x: x.nonzero(), (X,)), COUPLED, "result size"),
    ("masked_select", lambda: Call(lambda x: x[x > 0], (X,)), COUPLED, "mask"),
    ("segment_sum", lambda: Call(_segment_sum, (X,)), COUPLED, "index_add"),
    ("output_repeats_batch", lambda: Call(lambda x: x.repeat(2, 1), (X,)), COUPLED, "repeats the batch"),
    ("batch_dim1_softmax_over_batch",
     lambda: Call(lambda x: x.softmax(1), (_x(7, 5, 4),), {0: 1}), COUPLED, "softmax"),
    # unproven: host reads and unknown ops
    ("gate_on_min", lambda: Call(_host_gate, (X,)), Reason.UNPROVEN, "on the host"),
    ("item_scale", lambda: Call(_item_scale, (X,)), Reason.UNPROVEN, "on the host"),
    ("any_gate", lambda: Call(_any_gate, (X,)), Reason.UNPROVEN, "on the host"),
    ("unknown_op", lambda: Call(lambda x: torch.bucketize(x, torch.linspace(-1, 1, 4)), (X,)),
     Reason.UNPROVEN, "aten.bucketize"),
    # random
    ("dropout_train", lambda: Call(nn.Dropout(0.5).train(), (X,)), Reason.RANDOM_OPS, "random"),
    ("noise", lambda: Call(lambda x: x + torch.randn_like(x), (X,)), Reason.RANDOM_OPS, "randn_like"),
    ("sdpa_dropout",
     lambda: Call(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5), (_x(5, 2, 6, 4),)),
     Reason.RANDOM_OPS, "random"),
    # stateful
    ("buffer_accumulator", lambda: Call(Accumulator(), (X,)), Reason.STATEFUL, "did not create"),
    ("step_counter", lambda: Call(StepCounter(), (X,)), Reason.STATEFUL, "did not create"),
    ("batch_norm_train", lambda: Call(nn.BatchNorm1d(8).train(), (X,)), Reason.STATEFUL, "did not create"),
    ("kv_cache_in_closure", _kv_cache_step, Reason.STATEFUL, "did not create"),
    ("writes_own_input", lambda: Call(lambda x: x.mul_(2), (X.clone(),)), Reason.STATEFUL, "call's inputs"),
    ("writes_input_view", lambda: Call(lambda x: x[:, 0].zero_(), (X.clone(),)), Reason.STATEFUL, "call's inputs"),
    ("writes_static_input", _writes_static_input, Reason.STATEFUL, "call's inputs"),
    ("out_into_closure", _writes_out_into_closure, Reason.STATEFUL, "did not create"),
    ("writes_parameter", _writes_parameter, Reason.STATEFUL, "did not create"),
    ("cache_made_on_the_first_call", lambda: Call(_LazyCache(), (X,)), Reason.STATEFUL, "keeps a tensor"),
    # found wrong once, fixed since
    ("equal_gate", lambda: Call(_equal_gate, (X,)), Reason.UNPROVEN, "on the host"),
    ("allclose_gate", lambda: Call(_allclose_gate, (X,)), Reason.UNPROVEN, "on the host"),
    ("tolist_gate", lambda: Call(_tolist_gate, (X,)), Reason.UNPROVEN, "Tensor.tolist"),
    ("fill_with_batch_max", lambda: Call(_fill_with_batch_max, (X,)), COUPLED, "aten.max"),
    ("count_masked_rows_square", lambda: Call(_count_masked_rows_square, (_x(4, 4),)), COUPLED, ""),
    ("batch_size_as_value", lambda: Call(_mean_by_batch_size, (X,)), Reason.SIZE_AS_VALUE, "batch size"),
)


@pytest.mark.parametrize("make, reason, match", REFUSED)
def test_refused_model(make: Callable[[], Call], reason: Reason, match: str) -> None:
    call = make()
    v = trace(call)
    assert v.reason is reason, f"got {v.reason}: {v.detail}"
    assert match in v.detail
    assert v.stateful is (reason is Reason.STATEFUL)
    if reason in (COUPLED, Reason.SIZE_AS_VALUE):
        assert padding_changes_rows(call)  # the expectation itself


def test_write_to_static_input_is_an_input_write_and_to_closure_a_state_write() -> None:
    v = trace(_writes_static_input())
    assert v.input_writes and not v.state_writes
    v = trace(_kv_cache_step())
    assert v.state_writes and not v.input_writes


def test_state_write_names_the_tensor() -> None:
    m = Accumulator()
    v = trace(Call(m, (X,)), names={id(m.total): "total"})
    assert v.reason is Reason.STATEFUL
    assert v.state_writes == ("aten.add_ writes 'total'",)


def test_batch_norm_train_is_both_stateful_and_coupled() -> None:
    v = trace(Call(nn.BatchNorm1d(8).train(), (X,)))
    assert v.reason is Reason.STATEFUL  # state outranks coupling
    assert v.outputs == (None,)  # the output itself is coupled: no rows to slice
    assert len(v.state_writes) == 3  # running_mean, running_var, num_batches_tracked


def test_static_input_read_only_is_independent() -> None:
    table = _x(4, 3, seed=6)
    call = Call(lambda x, t: (x @ t, t), (_x(5, 4), table), statics=(table,))
    v = trace(call)
    assert v.reason is None and v.outputs == (R0, None)


# ------------------------------------------------------------------------------------- multi-output models


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> Any:  # x (B, S, D)
        h = self.proj(x) * self.scale
        return h, self.scale, (h.reshape(-1, 4), h.reshape(x.shape[0], -1)), h.mean(1), h.transpose(0, 1), 3


def test_multi_output_rows() -> None:
    call = Call(Heads().eval(), (_x(5, 3, 4),))
    v = trace(call)
    want = (R0, None, Rows(0, 3), R0, R0, R1, None)
    assert v.reason is None and v.outputs == want
    assert_padding_keeps_rows(call, want)


def test_output_without_batch_next_to_a_coupled_one() -> None:
    w = nn.Parameter(torch.ones(3))
    v = trace(Call(lambda x: (w, x * 2, x.sum(0)), (X,)))
    assert v.reason is Reason.ROWS_COUPLED
    assert v.outputs == (None, R0, None)  # the coupled leaf has no rows either


def test_merged_outputs_with_batch_dim1() -> None:  # x (T, B, F)
    call = Call(lambda x: (x.flatten(1), x.transpose(0, 1).reshape(-1, 4)), (_x(3, 5, 4),), {0: 1})
    v = trace(call)
    want = (Rows(1, 4), Rows(0, 3))  # (T, B*F) and (B*T, F): F, then T elements per row
    assert v.reason is None and v.outputs == want
    assert_padding_keeps_rows(call, want)


def test_merge_that_repeats_the_batch_is_refused() -> None:  # (T, B, F) -> (T*B, F): the batch once per step
    v = trace(Call(lambda x: x.flatten(0, 1), (_x(3, 5, 4),), {0: 1}))
    assert v.reason is Reason.ROWS_COUPLED and "repeats the batch" in v.detail


# ---------------------------------------------------------------------- coupling that shows for some data only


def _where_big(x: torch.Tensor) -> torch.Tensor:
    top = x.max(0).values
    return torch.where(top > 10, x / top, x)


def _clamp_near_batch_mean(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(max=x.mean(0) + 100)


def _rescale_if_big(x: torch.Tensor) -> torch.Tensor:
    return x / x.abs().max() if (x.abs() > 100).any() else x


_ZEROS_IN_EVERY_COLUMN = torch.cat([torch.zeros(1, 8), _x(4, 8).abs()])  # min over the batch is 0


DATA_DEPENDENT = [
    # (model, an input on which padding with large rows changes nothing, an input on which it does, reason)
    pytest.param(lambda x: x - x.min(0).values, _ZEROS_IN_EVERY_COLUMN, X, COUPLED, id="minus_batch_min"),
    pytest.param(_where_big, _x(5, 8), X * 100, COUPLED, id="where_on_batch_max"),
    pytest.param(_clamp_near_batch_mean, _x(5, 8), X * 1000, COUPLED, id="clamp_near_batch_mean"),
    pytest.param(_rescale_if_big, _x(5, 8), X * 1000, Reason.UNPROVEN, id="host_gate"),
]


@pytest.mark.parametrize("fn, benign, hostile, reason", DATA_DEPENDENT)
def test_coupling_is_found_whatever_the_data(fn: Callable[[torch.Tensor], torch.Tensor], benign: torch.Tensor,
                                             hostile: torch.Tensor, reason: Reason) -> None:
    # padding rows that look harmless on ``benign``: a run-and-compare check would be fooled there
    harmless = torch.full((3, 8), 5.0)
    with torch.no_grad():
        padded = fn(torch.cat([benign, harmless]))[: benign.shape[0]]
    torch.testing.assert_close(padded, fn(benign))
    # the trace is not: both inputs get the same verdict
    verdicts = [trace(Call(fn, (x.clone(),))) for x in (benign, hostile)]
    assert [v.reason for v in verdicts] == [reason, reason]
    assert verdicts[0].detail == verdicts[1].detail


# ------------------------------------------------------------------------------- the FX path (compile backend)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).softmax(-1)


class MinMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MM(x)


class Attention(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(x)).flatten(1)


class CumsumAndCat(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        return x.cumsum(0), torch.cat([x, x], 1)


class CatBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x[:1]], 0)


def _zero_negatives(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[x < 0] = 0  # a proxy takes no item assignment: a leaf of the FX graph
    return x


fx.wrap("_zero_negatives")


class MaskAssign(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _zero_negatives(x) * 2


class InPlaceInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


class Dropout(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, training=True)


FX_CASES = [
    pytest.param(Mlp, (_x(5, 8),), id="mlp"),
    pytest.param(MinMax, (_x(5, 8),), id="min_max"),
    pytest.param(Attention, (_x(5, 2, 6, 4),), id="sdpa_causal"),
    pytest.param(ConvNet, (_x(5, 3, 8, 8),), id="conv"),
    pytest.param(CumsumAndCat, (_x(5, 8),), id="cumsum_and_cat_features"),
    pytest.param(CatBatch, (_x(5, 8),), id="cat_batch"),
    pytest.param(MaskAssign, (_x(5, 8),), id="masked_assignment"),
    pytest.param(Heads, (_x(5, 3, 4),), id="multi_output"),
    pytest.param(Accumulator, (_x(5, 8),), id="buffer_accumulator"),
    pytest.param(InPlaceInput, (_x(5, 8),), id="in_place_input"),
    pytest.param(Dropout, (_x(5, 8),), id="dropout"),
]


@pytest.mark.parametrize("cls, args", FX_CASES)
def test_fx_graph_gets_the_live_verdict(cls: type[nn.Module], args: tuple[torch.Tensor, ...]) -> None:
    live = trace(Call(cls().eval(), tuple(a.clone() for a in args)))
    gm = fx.symbolic_trace(cls().eval())
    v = trace_graph(gm, [a.clone() for a in args], batched={0: 0})
    assert (v.reason, v.outputs) == (live.reason, live.outputs), f"fx: {v.detail} / live: {live.detail}"
    assert v.stateful == live.stateful


def test_fx_graph_static_input_write_and_ref() -> None:
    def step(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        pos.add_(1)
        return x + pos

    gm = fx.symbolic_trace(step)
    args = [_x(5, 4), torch.zeros(1)]
    own = trace_graph(gm, args, batched={0: 0})
    assert own.reason is Reason.STATEFUL and own.input_writes and not own.state_writes
    ref = trace_graph(gm, args, batched={0: 0}, refs={1})
    assert ref.reason is Reason.STATEFUL and ref.state_writes and not ref.input_writes
