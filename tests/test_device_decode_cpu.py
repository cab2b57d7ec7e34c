"""DeviceDecodeLoop's logic on CPU (the eager strategy runs the same body): tokens, EOS, budgets, chunks, checks."""

from __future__ import annotations

import pytest
import torch

from _decode_steps import arithmetic_step, host_loop
from _tiny_llama import tiny_llama
from gfxgraph.hf import StaticCacheDecoder
from hipgraph_bridge.generation import DeviceDecodeLoop

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; the GPU file covers a GPU")

FIRST = torch.tensor([1, 2, 3])


def _loop(chunk=4, batch=3):
    return DeviceDecodeLoop(arithmetic_step, batch_size=batch, chunk=chunk, device="cpu")


@pytest.mark.parametrize("budget", [1, 4, 10, 12, 13])
def test_tokens_equal_the_host_loop_for_any_budget(budget):
    loop = _loop(chunk=4)
    got = loop.generate(FIRST, 5, max_new_tokens=budget)
    assert torch.equal(got, host_loop(arithmetic_step, FIRST, 5, budget))
    assert loop.launches == -(-budget // 4)  # ceil: a budget not a multiple of the chunk ends in a short launch


def test_eos_in_the_middle_of_a_launch_stops_that_sequence_only():
    want = host_loop(arithmetic_step, FIRST, 5, 12)
    eos = int(want[0, 2])  # row 0 ends at its third token, inside the first launch of 4
    assert all(eos not in row[:3] for row in want[1:].tolist())  # precondition: the other rows go on past it
    got = _loop(chunk=4).generate(FIRST, 5, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    ref = host_loop(arithmetic_step, FIRST, 5, 12, eos=eos, pad=0)
    assert torch.equal(got, ref)
    assert got[0, :3].tolist() == want[0, :3].tolist() and got[0, 3:].eq(0).all()


def test_a_batch_whose_sequences_end_at_different_steps_stops_when_the_last_ends():
    want = host_loop(arithmetic_step, FIRST, 5, 40).tolist()
    firsts = {v: [row.index(v) if v in row else None for row in want] for v in range(50)}
    eos, ends = next((v, f) for v, f in firsts.items() if None not in f and len(set(f)) == 3)
    got = _loop(chunk=4).generate(FIRST, 5, max_new_tokens=40, eos_token_id=eos)
    ref = host_loop(arithmetic_step, FIRST, 5, 40, eos=eos)
    assert torch.equal(got, ref)
    assert got.shape[1] == max(ends) + 1 < 40  # stopped on the device at the last sequence's EOS


def test_several_eos_ids_any_of_which_ends_a_sequence():
    want = host_loop(arithmetic_step, FIRST, 5, 40).tolist()
    a, b = want[0][2], want[1][5]  # row 0 ends by a at its third token, row 1 by b (or a) by its sixth
    ref = host_loop(arithmetic_step, FIRST, 5, 40, eos=[a, b], pad=0)
    for eos in ([a, b], (a, b), torch.tensor([a, b])):
        got = _loop(chunk=4).generate(FIRST, 5, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(got, ref), eos
    assert got[0, 3:].eq(0).all() and got[1, 6:].eq(0).all()
    assert not torch.equal(ref, host_loop(arithmetic_step, FIRST, 5, 40, eos=a, pad=0))  # b matters
    with pytest.raises(ValueError, match="at most 8 ids"):
        _loop().generate(FIRST, 5, max_new_tokens=4, eos_token_id=list(range(9)))


def test_chunks_stream_one_tensor_per_launch():
    loop = _loop(chunk=4)
    parts = list(loop.chunks(FIRST, 0, max_new_tokens=10))
    assert [p.shape[1] for p in parts] == [4, 4, 2]
    assert torch.equal(torch.cat(parts, 1), host_loop(arithmetic_step, FIRST, 0, 10))


def test_sequences_ended_on_entry_run_no_step():
    loop = _loop()
    got = loop.generate(FIRST, 0, max_new_tokens=8, eos_token_id=1, unfinished=torch.zeros(3, dtype=torch.bool))
    assert got.shape == (3, 0) and loop.launches == 1
    some = torch.tensor([True, False, True])
    got = loop.generate(FIRST, 0, max_new_tokens=8, eos_token_id=1, pad_token_id=9, unfinished=some)
    assert torch.equal(got, host_loop(arithmetic_step, FIRST, 0, 8, eos=1, pad=9, unfinished=some))
    assert got[1].eq(9).all()


def test_a_second_generation_does_not_see_the_first():
    loop = _loop()
    loop.generate(FIRST, 5, max_new_tokens=7, eos_token_id=8)
    other = torch.tensor([4, 0, 9])
    assert torch.equal(loop.generate(other, 11, max_new_tokens=9), host_loop(arithmetic_step, other, 11, 9))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(batch_size=0), ValueError, "batch_size: expected an int >= 1"),
    (dict(batch_size=2, chunk=0), ValueError, "chunk: expected an int >= 1"),
    (dict(batch_size=2, strategy="fast"), ValueError, "strategy: expected one of auto, native, host"),
])
def test_constructor_checks(kwargs, error, match):
    with pytest.raises(error, match=match):
        DeviceDecodeLoop(arithmetic_step, device="cpu", **kwargs)


def test_step_must_be_callable():
    with pytest.raises(TypeError, match="step: expected a callable"):
        DeviceDecodeLoop("model", batch_size=1)


@pytest.mark.parametrize("tokens,kw,match", [
    (torch.tensor([1.0, 2.0, 3.0]), {}, "tokens: expected 3 integer token ids"),
    (torch.tensor([1, 2]), {}, "tokens: expected 3 integer token ids"),
    (FIRST, dict(eos_token_id=1, unfinished=torch.ones(3)), "unfinished: expected 3 bools"),
    (FIRST, dict(pad_token_id=0), "pad_token_id: expected together with eos_token_id"),
    (FIRST, dict(unfinished=torch.ones(3, dtype=torch.bool)), "unfinished: expected together with eos_token_id"),
    (FIRST, dict(eos_token_id=-2), "eos_token_id: expected an int >= 0"),
])
def test_generation_checks(tokens, kw, match):
    with pytest.raises(ValueError, match=match):
        _loop().generate(tokens, 0, max_new_tokens=4, **kw)


def test_a_step_that_returns_no_token_ids_is_named():
    loop = DeviceDecodeLoop(lambda t, p: t.float(), batch_size=3, chunk=2, device="cpu")
    with pytest.raises(TypeError, match="step: expected 3 integer token ids"):
        loop.generate(FIRST, 0, max_new_tokens=2)


@pytest.mark.parametrize("kw,match", [(dict(device_loop=0), "device_loop: expected None or an int >= 1"),
                                      (dict(device_loop=8, graphs=False), "device_loop: expected graphs=True"),
                                      (dict(strategy="x"), "strategy: expected one of")])
def test_decoder_device_loop_options_checked(kw, match):
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=match):
        StaticCacheDecoder(tiny_llama(transformers, device="cpu"), max_cache_len=8, **kw)


def test_arguments_are_checked_when_chunks_is_called_not_at_the_first_next():
    with pytest.raises(ValueError, match="tokens: expected 3 integer token ids"):
        _loop().chunks(torch.tensor([1, 2]), 0, max_new_tokens=4)


def test_a_later_generation_supersedes_an_unfinished_iterator_instead_of_hanging():
    loop = _loop(chunk=2)
    it = loop.chunks(FIRST, 0, max_new_tokens=8)
    first = next(it)
    other = torch.tensor([4, 0, 9])
    assert torch.equal(loop.generate(other, 3, max_new_tokens=5), host_loop(arithmetic_step, other, 3, 5))
    with pytest.raises(RuntimeError, match="superseded by a later generation"):
        next(it)
    assert torch.equal(first, host_loop(arithmetic_step, FIRST, 0, 2))


def test_an_abandoned_iterator_blocks_nothing():
    loop = _loop(chunk=2)
    it = loop.chunks(FIRST, 0, max_new_tokens=8)
    next(it)
    assert torch.equal(loop.generate(FIRST, 0, max_new_tokens=3), host_loop(arithmetic_step, FIRST, 0, 3))
    del it


# ------------------------------------------------------------------ ragged batches: one position per sequence
ROWS = torch.tensor([5, 0, 17])  # left-padded prompts of different lengths continue at different positions


@pytest.mark.parametrize("chunk", [1, 4, 16])
@pytest.mark.parametrize("budget", [1, 7, 12])
def test_per_sequence_positions_give_the_host_loops_tokens(chunk, budget):
    seen = []

    def step(tokens, position):
        seen.append(tuple(position.shape))
        return arithmetic_step(tokens, position)

    loop = DeviceDecodeLoop(step, batch_size=3, chunk=chunk, device="cpu")
    got = loop.generate(FIRST, ROWS, max_new_tokens=budget)
    assert torch.equal(got, host_loop(arithmetic_step, FIRST, ROWS, budget))
    assert set(seen) == {(3,)}  # the step gets one position per sequence
    assert loop.body_kind.ragged


def test_per_sequence_positions_with_eos_end_each_row_as_the_host_loop_does():
    want = host_loop(arithmetic_step, FIRST, ROWS, 40).tolist()
    firsts = {v: [row.index(v) if v in row else None for row in want] for v in range(50)}
    eos = next(v for v, f in firsts.items() if None not in f and len(set(f)) == 3)
    got = _loop(chunk=4).generate(FIRST, ROWS, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, host_loop(arithmetic_step, FIRST, ROWS, 40, eos=eos, pad=0))
    assert got.shape[1] < 40


def test_scalar_and_per_sequence_generations_alternate_on_one_loop():
    loop = _loop(chunk=4)
    same = torch.full((3,), 5)
    ragged = loop.generate(FIRST, ROWS, max_new_tokens=9)
    scalar = loop.generate(FIRST, 5, max_new_tokens=9)  # another body: captured again
    assert not loop.body_kind.ragged
    assert torch.equal(loop.generate(FIRST, same, max_new_tokens=9), scalar)  # equal rows: the scalar's tokens
    assert torch.equal(loop.generate(FIRST, torch.tensor(5), max_new_tokens=9), scalar)  # a 0-dim tensor
    assert torch.equal(ragged, host_loop(arithmetic_step, FIRST, ROWS, 9))
    assert loop.captured_for(False, ragged=False) and not loop.captured_for(False, ragged=True)


@pytest.mark.parametrize("position", [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 2]), torch.zeros(3, 1).long(),
                                      torch.ones(3, dtype=torch.bool), -1, 2.0])
def test_bad_positions_are_named(position):
    with pytest.raises(ValueError, match="position: expected an int >= 0"):
        _loop().generate(FIRST, position, max_new_tokens=2)
