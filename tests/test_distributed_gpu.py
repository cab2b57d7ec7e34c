"""Rank agreement on two GPUs: NCCL collectives inside captured graphs, every rank agreeing.

The scenarios are those of the CPU tests (``dist_cases.py``), run by two
processes on an NCCL group, one GPU each, with real captures: each pool's
graphs hold the model's ``all_reduce``. Faults fire inside the stream capture
itself (``torch.cuda.is_current_stream_capturing()``), after the model's
collective was recorded. The launch is bounded: a hang fails, it never stalls.
NVLink multicast stays off in every process (``dist_launch.NO_MULTICAST``).
"""

from __future__ import annotations

import pytest
import torch

from dist_launch import facts, launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (kind nvidia-h200-x2)")]

# the risky ones last: a scenario that hangs takes the later ones with it
SCENARIOS = ["tensor_parallel_mlp", "agreed_max", "fault_fallback", "vram_cap_on_one_rank", "padding_disagrees",
             "raised_in_capture", "compile_backend", "out_of_step", "peer_stops_calling"]


@pytest.fixture(scope="module")
def two_gpus():
    return launch(2, SCENARIOS, device="cuda", timeout=400)


def test_the_two_gpu_launch_never_hangs(two_gpus):
    assert two_gpus["hung"] == [] and two_gpus["returncodes"] == [0, 0], two_gpus["logs"]


def test_a_tensor_parallel_mlp_in_graphs_equals_the_single_gpu_mlp_at_every_size(two_gpus):
    got = facts(two_gpus, "tensor_parallel_mlp")
    for g in got:
        assert g["sizes"] == 64 and g["max_err"] < 1e-3, g
        assert g["failed"] == {} and g["row_coupled"] == []
        assert g["captured"] == [1, 2, 4, 8, 16, 24, 32, 48, 64]  # every call replayed a graph with the all_reduce


def test_ranks_with_different_batch_sizes_replay_the_same_graphs(two_gpus):
    got = facts(two_gpus, "agreed_max")
    assert all(g["max_err"] < 1e-3 for g in got)
    assert got[0]["buckets"] == got[1]["buckets"] == [2, 8] and got[0]["runs"] == got[1]["runs"]
    assert got[0]["failed"] == got[1]["failed"] == {}


def test_a_capture_fault_on_one_rank_leaves_both_running_and_agreeing(two_gpus):
    got = facts(two_gpus, "fault_fallback")
    assert got[1]["fired"] and not got[0]["fired"]
    for g in got:
        assert g["max_err"] < 1e-3
        assert list(g["failed"]) == ["8"] and "failed on rank 1: RuntimeError: injected capture fault" in g["failed"]["8"]
        assert g["captured"] == [2, 4]  # rank 0 dropped its good graph of bucket 8: nobody replays it alone
    assert got[0]["runs"] == got[1]["runs"]


def test_a_vram_cap_refusal_on_one_rank_makes_every_rank_run_eagerly(two_gpus):
    for g in facts(two_gpus, "vram_cap_on_one_rank"):
        assert g["captured"] == [] and sorted(g["failed"]) == ["2", "4"] and g["max_err"] < 1e-3
        assert all(r.startswith("vram_cap:") and "failed on rank 1" in r for r in g["failed"].values())


def test_padding_that_changes_results_on_one_rank_stops_padding_on_both(two_gpus):
    for g in facts(two_gpus, "padding_disagrees"):
        assert len(g["row_coupled"]) == 1 and "rank 1:" in g["row_coupled"][0] and g["max_err"] < 1e-5


def test_a_rank_interrupted_inside_a_capture_makes_the_other_raise_at_once(two_gpus):
    got = facts(two_gpus, "raised_in_capture")
    assert got[1]["outcome"] == "KeyboardInterrupt: injected interrupt"
    assert got[0]["outcome"].startswith("RankAgreementError") and "rank 1: KeyboardInterrupt" in got[0]["outcome"]
    for g in got:
        assert g["elapsed"] < 5 and g["err_after"] < 1e-3 and g["captured"] == [4]  # the retry captured


def test_the_compile_backend_graphs_a_frame_with_an_all_reduce_with_a_process_group(two_gpus):
    for g in facts(two_gpus, "compile_backend"):
        assert g["without"]["max_err"] < 1e-3 and g["with"]["max_err"] < 1e-3
        assert ("ungraphed", "collectives") in map(tuple, g["without"]["states"])
        assert ("graphed", "") in map(tuple, g["with"]["states"])


def test_a_gpu_rank_that_stops_calling_makes_the_other_raise_after_the_timeout(two_gpus):
    g = facts(two_gpus, "peer_stops_calling")[0]
    assert "no answer from every rank within 1.5 s" in g["first"] and g["first_elapsed"] < g["timeout"] + 3
