"""A pool's steps under a rank agreement (:mod:`.ranks`): capture rounds, simulated capture, agreed padding.

A bucket's capture becomes three steps on every rank: the ``capture_begin``
round (same bucket, the VRAM cap), the warm-up and capture, and the
``capture_end`` round. :func:`combine_capture` then turns each rank's own
outcome into the same one everywhere: if any rank failed, every rank drops
its graph, learns nothing from its outputs, records the reason (naming the
failing ranks and their errors) and answers the call the same way: on the
caller's own arguments when a warm-up failed anywhere, else with its
warm-up run (a batch that fills the bucket) or an eager run. So the model
runs, and its collectives happen, the same number of times on every rank.

Without a GPU (``simulate_padding=True``) the capture step is the model's run
on the padded buffers (:func:`simulate_capture`): every round above runs, so
the agreement is exercised on CPU processes over gloo.

Under ``batch="max"`` a rank with fewer rows is grown to the agreed batch with
rows of ``pad_value`` (:func:`pad_rows`) before the pool sees the call, so
every decision after it is made on the same sizes everywhere, and its
outputs are sliced back (:func:`slice_rows`) by the learnt batched-output flags.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from .. import stats
from .._torch_compat import pytree
from ..log import logger
from ..platform import probe
from .capture import BucketCapturer, Captured
from .layout import BATCHED, CallLayout
from .ranks import RankSession, Round, Status, Vote, describe_failures, failures, key_code

__all__ = ["agreed_capture", "combine_capture", "simulate_capture", "agreed_probe", "pad_rows", "narrow_rows",
           "slice_rows", "local_status"]


def local_status(c: Captured) -> Status:
    """This rank's capture outcome, as a vote."""
    if c.failed is None:
        return Status.OK
    if c.reason == "vram_cap":
        return Status.REFUSED
    return Status.WARMUP_FAILED if c.stage == "warm_up" else Status.CAPTURE_FAILED


def simulate_capture(run: Callable[[], Any], bucket: int, *, keep_warm: bool) -> Captured:
    """The simulated path's capture: one run of the model on the padded buffers (its warm-up and its answer)."""
    result = Captured(stage="warm_up")
    stats.record_fallback("no_gpu", probe().reason or "")
    try:
        with torch.no_grad():
            out = run()
    except Exception as exc:
        result.error = exc
        result.reason, result.failed = "capture_failed", f"bucket {bucket}: {type(exc).__name__}: {exc}"
        return result
    result.stage = "capture"
    result.outputs = out
    result.warm = out if keep_warm else None
    return result


def agreed_capture(ranks: RankSession, capturer: BucketCapturer | None, run: Callable[[], Any], bucket: int,
                   key: Hashable, *, keep_warm: bool, freeze_gc: bool, stateful: bool) -> Captured:
    """Capture ``bucket`` on every rank or on none (``capturer`` None: the simulated capture).

    Raises :class:`~hipgraph_bridge.errors.RankAgreementError` when a peer
    raised (this rank's graph is dropped first), and this rank's own
    ``BaseException`` after telling the peers.
    """
    code = key_code(key)

    def admit() -> tuple[Status, str]:
        why = capturer.refusal(bucket) if capturer is not None else None
        return (Status.REFUSED, f"bucket {bucket}: {why}") if why else (Status.OK, "")

    refused = failures(ranks.settle(Round.CAPTURE_BEGIN, bucket, admit, key=code, same_value=True))
    if refused:
        failed = f"bucket {bucket}: {_details(refused, bucket)} (every rank runs it eagerly)"
        logger.warning("gfxgraph: %s", failed)
        return Captured(reason="vram_cap", failed=failed)
    try:
        captured = (capturer.capture(run, bucket, keep_warm=keep_warm, freeze_gc=freeze_gc, cap_checked=True)
                    if capturer is not None else simulate_capture(run, bucket, keep_warm=keep_warm))
    except BaseException as exc:
        ranks.leave(Round.CAPTURE_END, bucket, exc, key=code)
        raise
    try:
        votes = ranks.exchange(Round.CAPTURE_END, bucket, local_status(captured), captured.failed or "", key=code)
    except BaseException:
        if captured.graph is not None:  # never replay a graph whose peers gave up on theirs
            captured.graph.reset()
        raise
    if combine_capture(captured, votes, bucket, stateful=stateful):
        logger.warning("gfxgraph: %s", captured.failed)
    return captured


def combine_capture(captured: Captured, votes: Sequence[Vote], bucket: int, *, stateful: bool) -> bool:
    """Make this rank's outcome the one every rank has (see the module docstring); True if any rank failed.

    Every rank reaches the same answer path of the pool's first call: the
    failing ranks' own (``stage="warm_up"``: an eager run on the caller's
    arguments) when a warm-up failed anywhere, except for a stateful model,
    which is never run twice; else ``stage="capture"`` (the warm-up run, or eager).
    """
    bad = failures(votes)
    if not bad:
        return False
    if captured.graph is not None:
        captured.graph.reset()
        captured.graph = None
    captured.outputs = None  # no rank learns the outputs' layout (or runs a probe) from this capture
    captured.reason = "vram_cap" if all(v.status == Status.REFUSED for v in bad) else "capture_failed"
    captured.failed = f"bucket {bucket}: {_details(bad, bucket)} (every rank runs it eagerly)"
    if any(v.status == Status.WARMUP_FAILED for v in bad) and not stateful:
        captured.stage = "warm_up"
    return True


def _details(bad: Sequence[Vote], bucket: int) -> str:
    prefix = f"bucket {bucket}: "
    return "; ".join(f"failed on rank {v.rank}: {v.message.removeprefix(prefix)}" for v in bad)


def agreed_probe(ranks: RankSession, run_at: Callable[[int], Any], sizes: Sequence[int]) -> tuple[int, list[Any]] | None:
    """:func:`~.outputs.probe_other_size` on every rank at once: a size counts only if it ran everywhere."""
    for size in sizes:
        box: list[list[Any]] = []

        def work(size: int = size) -> tuple[Status, str]:
            try:
                with torch.no_grad():
                    box.append(pytree.tree_leaves(run_at(size)))
            except Exception as exc:
                logger.debug("gfxgraph: output probe at batch %d failed: %s", size, exc)
                return Status.REFUSED, f"{type(exc).__name__}: {exc}"
            return Status.OK, ""

        bad = failures(ranks.settle(Round.PROBE, size, work))
        if not bad:
            return size, box[0]
        logger.debug("gfxgraph: output probe at batch %d failed on %s", size, describe_failures(bad))
    return None


def pad_rows(layout: CallLayout, leaves: list[Any], rows: int, *, batch_dim: int,
             pad_value: float | int | bool | None) -> list[Any]:
    """The leaves with every batched tensor grown to ``rows`` (new rows hold ``pad_value``; 0 for None)."""
    out = []
    for leaf, kind in zip(leaves, layout.kinds):
        if kind == BATCHED and leaf.shape[batch_dim] < rows:
            shape = list(leaf.shape)
            shape[batch_dim] = rows
            grown = leaf.new_full(shape, 0 if pad_value is None else pad_value)
            grown.narrow(batch_dim, 0, leaf.shape[batch_dim]).copy_(leaf)
            leaf = grown
        out.append(leaf)
    return out


def narrow_rows(layout: CallLayout, leaves: list[Any], rows: int, *, batch_dim: int) -> list[Any]:
    """The leaves with every batched tensor cut to its first ``rows``."""
    return [leaf.narrow(batch_dim, 0, rows) if kind == BATCHED else leaf for leaf, kind in zip(leaves, layout.kinds)]


def slice_rows(out: Any, flags: Sequence[bool], rows: int, *, batch_dim: int) -> Any:
    """``out`` with the leaves flagged as batched cut to their first ``rows``."""
    leaves, spec = pytree.tree_flatten(out)
    return pytree.tree_unflatten([o.narrow(batch_dim, 0, rows) if f else o for o, f in zip(leaves, flags)], spec)
