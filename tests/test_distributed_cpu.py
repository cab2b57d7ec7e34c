"""Rank agreement on CPU: gloo groups of 2 and 3 processes, and the parts that need no peers.

The multi-process scenarios live in ``dist_cases.py``; each group of processes
is started once per module (``two_ranks``, ``three_ranks``, both groups at
once) and runs its scenarios one after another, so the start-up is paid once
per process, not per test (and torch is imported once: every rank is forked
from a warm interpreter, see ``_warm_python``). Every launch
is killed after a bound: a hang fails the test instead of stalling the run.
Without a GPU the pools run ``simulate_padding=True``: each bucket's first run
on the padded buffers stands for its capture, and every agreement round runs as
it would on GPUs.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from dist_launch import facts, launch_groups
from hipgraph_bridge import RankAgreement, ShapeBucketPool
from hipgraph_bridge.bucketing.pool import _pad_rows as pad_rows
from hipgraph_bridge.fallbacks import Fallback, Reason
from hipgraph_bridge.graph.capturer import Captured
from hipgraph_bridge.padding.layout import classify
from hipgraph_bridge.ranks.agreement import Status, Vote, as_agreement, key_code
from hipgraph_bridge.ranks.decider import combine_capture
from hipgraph_bridge.compile import BackendOptions
from hipgraph_bridge.errors import ConfigError

TWO = ["agreed_max", "strict_mismatch", "fault_fallback", "padding_disagrees", "raised_in_capture",
       "tensor_parallel_mlp", "compile_backend", "out_of_step", "peer_stops_calling"]
THREE = ["agreed_max", "fault_fallback", "raised_in_capture", "tensor_parallel_mlp"]


@pytest.fixture(scope="module")
def _groups():
    """Both groups started together, every rank forked from a warm interpreter (torch imported once): one
    group's waits (a peer's timeout, a barrier) overlap the other's work. Every rank is killed after the bound."""
    return launch_groups([(2, TWO), (3, THREE)], timeout=90)


@pytest.fixture(scope="module")
def two_ranks(_groups):
    return _groups[0]


@pytest.fixture(scope="module")
def three_ranks(_groups):
    return _groups[1]


def test_the_launches_never_hang(two_ranks, three_ranks):
    for run in (two_ranks, three_ranks):
        assert run["hung"] == [] and run["returncodes"] == [0] * len(run["ranks"]), run["logs"]


@pytest.mark.parametrize("ranks", ["two_ranks", "three_ranks"])
def test_every_rank_runs_the_agreed_bucket_with_different_batch_sizes(ranks, request):
    got = facts(request.getfixturevalue(ranks), "agreed_max")
    assert all(g["max_err"] < 1e-5 for g in got)  # each rank's rows, summed over the ranks' padded rows
    assert len({tuple(g["buckets"]) for g in got}) == 1 and len({g["runs"] for g in got}) == 1
    plan = {0: [3, 5, 1, 7, 2], 1: [5, 2, 1, 8, 2], 2: [1, 6, 1, 3, 4]}
    assert [[s[0] for s in g["shapes"]] for g in got] == [plan[r] for r in range(len(got))]  # cut back per rank


def test_strict_batch_sizes_raise_naming_each_rank_and_the_pool_goes_on(two_ranks):
    got = facts(two_ranks, "strict_mismatch")
    for g in got:
        assert "rank 0: 3, rank 1: 5" in g["message"] and "batch='max'" in g["message"]
        assert g["err_after"] < 1e-5
    assert got[0]["runs"] == got[1]["runs"] == 1  # the refused call never ran the model (nor its all_reduce)


@pytest.mark.parametrize("ranks", ["two_ranks", "three_ranks"])
def test_a_capture_fault_on_one_rank_makes_every_rank_fall_back_for_that_bucket(ranks, request):
    got = facts(request.getfixturevalue(ranks), "fault_fallback")
    faulty = len(got) - 1
    for g in got:
        assert g["max_err"] < 1e-5  # every call right, the eager ones included
        assert list(g["failed"]) == ["8"]
        assert f"failed on rank {faulty}: RuntimeError: injected capture fault" in g["failed"]["8"]
        assert g["buckets"] == [2, 4, 8]  # the other buckets still run padded, agreed
    assert len({g["runs"] for g in got}) == 1  # as many model runs (all_reduces) on every rank


def test_padding_that_changes_results_on_one_rank_stops_padding_on_all(two_ranks):
    got = facts(two_ranks, "padding_disagrees")
    for g in got:
        assert len(g["row_coupled"]) == 1 and "rank 1: rows_coupled: aten.mean reduces over the batch" \
            in g["row_coupled"][0]
        assert g["max_err"] < 1e-5


@pytest.mark.parametrize("ranks", ["two_ranks", "three_ranks"])
def test_a_rank_that_raises_in_a_capture_makes_the_others_raise_at_once(ranks, request):
    got = facts(request.getfixturevalue(ranks), "raised_in_capture")
    assert got[1]["outcome"] == "KeyboardInterrupt: injected interrupt"
    for r, g in enumerate(got):
        if r != 1:
            assert g["outcome"].startswith("RankAgreementError") and "rank 1: KeyboardInterrupt: injected interrupt" \
                in g["outcome"]
        assert g["elapsed"] < 5  # the agreement timeout is 20 s: nobody waited for it
        assert g["err_after"] < 1e-5 and g["captured_or_simulated"] == [4] and g["failed"] == {}


@pytest.mark.parametrize("ranks", ["two_ranks", "three_ranks"])
def test_a_tensor_parallel_mlp_through_agreed_pools_equals_the_full_mlp(ranks, request):
    for g in facts(request.getfixturevalue(ranks), "tensor_parallel_mlp"):
        assert g["max_err"] < 1e-4 and g["failed"] == {} and g["row_coupled"] == []


def test_the_compile_backend_graphs_collectives_only_with_a_process_group(two_ranks):
    for g in facts(two_ranks, "compile_backend"):
        assert g["without"]["max_err"] < 1e-5 and g["with"]["max_err"] < 1e-5
        assert ("ungraphed", "collectives") in map(tuple, g["without"]["states"])
        assert "_c10d_functional.all_reduce" in g["without"]["details"][0]
        assert "process_group" in g["without"]["details"][0]
        assert ("graphed", "") in map(tuple, g["with"]["states"])
        assert not any(reason for _, reason in g["with"]["states"])


def test_ranks_at_different_steps_raise_naming_each_ranks_step(two_ranks):
    for g in facts(two_ranks, "out_of_step"):
        assert "the ranks are at different steps" in g["message"]
        assert "rank 0: pool 0 step 1 (batch 2)" in g["message"] and "rank 1: pool 1 step 1 (batch 2)" in g["message"]
        assert g["elapsed"] < 5


def test_a_peer_that_stops_calling_makes_the_pool_raise_after_the_timeout(two_ranks):
    g = facts(two_ranks, "peer_stops_calling")[0]
    assert "no answer from every rank within 1.5 s" in g["first"]
    assert g["timeout"] <= g["first_elapsed"] < g["timeout"] + 3
    assert "broke earlier" in g["later"] and g["later_elapsed"] < 0.5


def test_the_multi_process_runs_stay_short(two_ranks, three_ranks):
    assert two_ranks["seconds"] + three_ranks["seconds"] < 50


# ------------------------------------------------------------- no peers needed


@pytest.fixture
def one_rank():
    """A gloo group of this process alone (torch.distributed torn down afterwards)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=10))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_an_agreement_needs_torch_distributed_initialised():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        RankAgreement()


def test_bad_agreement_options_name_what_was_expected(one_rank):
    with pytest.raises(ValueError, match="batch: expected one of 'equal', 'max', 'trusted', got 'min'"):
        RankAgreement(batch="min")
    with pytest.raises(ValueError, match="timeout: expected a positive number"):
        RankAgreement(timeout=0)
    with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup"):
        RankAgreement("world")
    with pytest.raises(TypeError, match="process_group: expected a torch.distributed ProcessGroup, a RankAgreement"):
        ShapeBucketPool(lambda x: x, [1, 2], process_group="world")
    assert as_agreement(None) is None and as_agreement(one_rank).batch == "equal"


def test_a_pool_of_one_rank_gives_the_plain_pools_results(one_rank):
    w = torch.randn(4, 4)

    def model(x):
        return x @ w

    plain = ShapeBucketPool(model, [2, 4, 8], simulate_padding=True, progress=False)
    agreed = ShapeBucketPool(model, [2, 4, 8], simulate_padding=True, progress=False,
                             process_group=RankAgreement(batch="max", timeout=5))
    for n in (1, 3, 8, 5, 2, 7):
        x = torch.randn(n, 4)
        torch.testing.assert_close(agreed(x), plain(x))
    io = agreed.static_io(3)
    io.args[0].copy_(torch.ones(3, 4))
    torch.testing.assert_close(io.run(), torch.ones(3, 4) @ w)
    assert agreed.failed_buckets == {} and agreed.row_coupled == {}


def test_the_compile_backend_takes_a_process_group_but_not_batch_max(one_rank):
    opts = BackendOptions.from_mapping({"process_group": one_rank})
    assert isinstance(opts.process_group, RankAgreement) and "process_group" in BackendOptions.known()
    with pytest.raises(ConfigError, match=r"batch='max'\) is not supported by the compile backend"):
        BackendOptions.from_mapping({"process_group": RankAgreement(batch="max")})
    with pytest.raises(ConfigError, match=r"options\['process_group'\]: expected a torch.distributed ProcessGroup"):
        BackendOptions.from_mapping({"process_group": 3})


def _vote(rank: int, status: Status, message: str = "") -> Vote:
    return Vote(rank, 0, 4, 1, 8, 0, status, message)


class _Graph:
    def __init__(self) -> None:
        self.released = False

    def reset(self) -> None:
        self.released = True


def test_combining_outcomes_gives_every_rank_the_same_answer_path():
    ok = [_vote(0, Status.OK), _vote(1, Status.OK)]
    mine = Captured(graph=_Graph(), outputs=[1], warm=[1], stage="capture")  # type: ignore[arg-type]
    assert combine_capture(mine, ok, "bucket 8", stateful=False) is False and mine.graph is not None

    graph = _Graph()
    mine = Captured(graph=graph, outputs=[1], warm=[1], stage="capture")  # type: ignore[arg-type]
    peer_capture = [_vote(0, Status.OK), _vote(1, Status.CAPTURE_FAILED, "bucket 8: RuntimeError: x")]
    assert combine_capture(mine, peer_capture, "bucket 8", stateful=False)
    assert graph.released and mine.graph is None and mine.outputs is None and mine.warm == [1]
    assert mine.stage == "capture" and mine.fallback.reason == "capture_failed"  # answered by its warm-up
    assert mine.fallback.detail == "bucket 8: failed on rank 1: RuntimeError: x (every rank runs it eagerly)"

    peer_warm = [_vote(0, Status.OK), _vote(1, Status.WARMUP_FAILED, "bucket 8: ValueError: y")]
    mine = Captured(graph=_Graph(), outputs=[1], warm=[1], stage="capture")  # type: ignore[arg-type]
    combine_capture(mine, peer_warm, "bucket 8", stateful=False)
    assert mine.stage == "warm_up" and mine.error is None  # an eager run on the caller's arguments, as the peer
    mine = Captured(graph=_Graph(), outputs=[1], warm=[1], stage="capture")  # type: ignore[arg-type]
    combine_capture(mine, peer_warm, "bucket 8", stateful=True)
    assert mine.stage == "capture"  # a stateful model is never run twice

    vram = [_vote(0, Status.REFUSED, "bucket 8: over the cap"), _vote(1, Status.OK)]
    mine = Captured(graph=_Graph(), outputs=[1], stage="capture")  # type: ignore[arg-type]
    combine_capture(mine, vram, "bucket 8", stateful=False)
    assert mine.fallback == Fallback(Reason.VRAM_CAP, mine.fallback.detail)
    assert "failed on rank 0: over the cap" in mine.fallback.detail


def test_growing_rows():
    x, m = torch.arange(6.0).reshape(3, 2), torch.ones(3, 1)
    leaves, layout, _ = classify((x,), {"m": m}, batch_dim=0, static_args=())
    grown = pad_rows(layout, leaves, 5, batch_dim=0, pad_value=-1)
    assert grown[0].shape == (5, 2) and grown[0][3:].eq(-1).all() and torch.equal(grown[0][:3], x)
    assert grown[1].shape == (5, 1) and torch.equal(grown[1][:3], m)


def test_batch_max_refuses_a_stateful_model(one_rank):
    with pytest.raises(ValueError, match="batch='max' and stateful=True"):
        ShapeBucketPool(lambda x: x, [2, 4], stateful=True, process_group=RankAgreement(batch="max", timeout=5))


def test_constant_keys_are_coded_by_value_alone():
    assert key_code((3, "mode", None, torch.float16, (1.5, True))) == key_code((3, "mode", None, torch.float16,
                                                                                (1.5, True)))
    assert key_code((3,)) != key_code((4,))
    with pytest.raises(ValueError, match="has no value that is the same in every process"):
        key_code((lambda x: x,))
