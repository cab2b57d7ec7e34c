"""Who a pool makes its decisions with: alone (:class:`Decider`) or with every rank (:class:`AgreedDecider`).

A pool asks its decider at each point where ranks could part ways: the
batch size of a call, whether a key of constant arguments may be padded, a
bucket's capture and its outcome, a bucket's padding check. The plain
:class:`Decider` answers on this process alone and costs nothing; the
:class:`AgreedDecider` turns each question into a round of
:mod:`.agreement` (a host all-reduce on a gloo group), so the single-process
path carries no rank branches at all.

How the agreed outcome of a capture is combined (:meth:`AgreedDecider.capture`):
if any rank failed, every rank drops its graph, records the reason (naming
the failing ranks and their errors) and answers the call the same way, so
the model runs, and its collectives happen, as often on every rank.
Without a GPU (``simulate_padding=True``) the "capture" is the bucket's first
run on the padded buffers, and every round runs as it would with graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from ..fallbacks import Fallback, Reason
from ..graph.capturer import Captured, Capturer
from ..log import logger
from .agreement import RankAgreement, RankSession, Round, Status, Vote, describe_failures, failures, key_code

__all__ = ["Decider", "AgreedDecider", "decider_for", "combine_capture", "local_status"]


class Decider:
    """A pool's decisions, made on this process alone (see the module docstring)."""

    agreed = False
    batch_rule = "local"

    def agree_batch(self, batch: int, *, exact: bool = False) -> tuple[int, tuple[int, ...]]:
        """The batch size this call runs at, and each rank's own (empty: no other rank)."""
        return batch, ()

    def agree_padding(self, step: int, refusal: Fallback | None) -> Fallback | None:
        """Whether a key may be padded: ``refusal`` is this process's reason not to (None: it may)."""
        return refusal

    def capture(self, capturer: Capturer | None, run: Callable[[], Any], what: str, *, bucket: int, key: Hashable,
                warm: Sequence[Callable[[], Any]], stateful: bool, freeze_gc: bool = True) -> Captured:
        """Capture ``run`` (``capturer`` None: no GPU, the run on the padded buffers stands for the capture)."""
        if capturer is None:
            return _simulated(run, what)
        return capturer.capture(run, what, warm=warm, freeze_gc=freeze_gc)

    def confirm(self, bucket: int, check: Callable[[], str]) -> str:
        """A bucket's padding check: "" when padding is confirmed, else why not."""
        return check()

    def leave(self, kind: Round, step: int, exc: BaseException) -> None:
        """This process leaves a call by raising ``exc``: nobody else to tell."""

    def __repr__(self) -> str:
        return "Decider(local)"


class AgreedDecider(Decider):
    """Every decision taken with the other ranks of ``session`` (see the module docstring)."""

    agreed = True

    def __init__(self, session: RankSession) -> None:
        self.session = session
        self.batch_rule = session.batch_rule

    def agree_batch(self, batch: int, *, exact: bool = False) -> tuple[int, tuple[int, ...]]:
        return self.session.agree_batch(batch, exact=exact)

    def agree_padding(self, step: int, refusal: Fallback | None) -> Fallback | None:
        mine = (Status.REFUSED, str(refusal)) if refusal is not None else (Status.OK, "")
        bad = failures(self.session.settle(Round.ROWS, step, lambda: mine))
        if not bad:
            return None
        reason = refusal.reason if refusal is not None else Reason.ROWS_COUPLED
        return Fallback(reason, f"not padded on every rank: {describe_failures(bad)} (every rank must run the "
                        "same bucket)", refusal.level if refusal is not None else logging.WARNING)

    def capture(self, capturer: Capturer | None, run: Callable[[], Any], what: str, *, bucket: int, key: Hashable,
                warm: Sequence[Callable[[], Any]], stateful: bool, freeze_gc: bool = True) -> Captured:
        """Capture on every rank or on none; raises :class:`RankAgreementError` when a peer raised."""
        code = key_code(key)

        def admit() -> tuple[Status, str]:
            why = capturer.refusal() if capturer is not None else None
            return (Status.REFUSED, f"{what}: {why}") if why else (Status.OK, "")

        refused = failures(self.session.settle(Round.CAPTURE_BEGIN, bucket, admit, key=code, same_value=True))
        if refused:
            detail = f"{what}: {_details(refused, what)} (every rank runs it eagerly)"
            logger.warning("gfxgraph: %s", detail)
            return Captured(fallback=Fallback(Reason.VRAM_CAP, detail))
        try:
            captured = (capturer.capture(run, what, warm=warm, freeze_gc=freeze_gc, cap_checked=True)
                        if capturer is not None else _simulated(run, what))
        except BaseException as exc:
            self.session.leave(Round.CAPTURE_END, bucket, exc, key=code)
            raise
        try:
            votes = self.session.exchange(Round.CAPTURE_END, bucket, local_status(captured),
                                          "" if captured.fallback is None else captured.fallback.detail, key=code)
        except BaseException:
            if captured.graph is not None:  # never replay a graph whose peers gave up on theirs
                captured.graph.reset()
            raise
        if combine_capture(captured, votes, what, stateful=stateful):
            logger.warning("gfxgraph: %s", captured.fallback)
        return captured

    def confirm(self, bucket: int, check: Callable[[], str]) -> str:
        box: list[str] = []

        def work() -> tuple[Status, str]:
            box.append(check())
            return (Status.REFUSED, box[0]) if box[0] else (Status.OK, "")

        bad = failures(self.session.settle(Round.PADDING_CHECK, bucket, work))
        return describe_failures(bad)

    def leave(self, kind: Round, step: int, exc: BaseException) -> None:
        self.session.leave(kind, step, exc)

    def __repr__(self) -> str:
        return f"AgreedDecider({self.session!r})"


def decider_for(agreement: RankAgreement | None, what: str) -> Decider:
    """The decider of a pool: local without an agreement, else one round-running session (``what`` names it)."""
    return Decider() if agreement is None else AgreedDecider(agreement.session(what))


def _simulated(run: Callable[[], Any], what: str) -> Captured:
    """Without a GPU the bucket's first padded run stands for its capture (it also answers the call)."""
    result = Captured(stage="warm_up")
    try:
        with torch.no_grad():
            out = run()
    except Exception as exc:
        result.error = exc
        result.fallback = Fallback(Reason.CAPTURE_FAILED, f"{what}: {type(exc).__name__}: {exc}")
        return result
    result.stage, result.outputs, result.warm = "capture", out, out
    return result


def local_status(c: Captured) -> Status:
    """This rank's capture outcome, as a vote."""
    if c.fallback is None:
        return Status.OK
    if c.fallback.reason == Reason.VRAM_CAP:
        return Status.REFUSED
    return Status.WARMUP_FAILED if c.stage == "warm_up" else Status.CAPTURE_FAILED


def combine_capture(captured: Captured, votes: Sequence[Vote], what: str, *, stateful: bool) -> bool:
    """Make this rank's outcome the one every rank has (see the module docstring); True if any rank failed.

    Every rank reaches the same answer path: the failing ranks' own
    (``stage="warm_up"``: an eager run on the caller's arguments) when a
    warm-up failed anywhere, except for a stateful model, which is never run
    twice; else ``stage="capture"`` (the warm-up run, or eager).
    """
    bad = failures(votes)
    if not bad:
        return False
    if captured.graph is not None:
        captured.graph.reset()
        captured.graph = None
    captured.outputs = None
    reason = Reason.VRAM_CAP if all(v.status == Status.REFUSED for v in bad) else Reason.CAPTURE_FAILED
    captured.fallback = Fallback(reason, f"{what}: {_details(bad, what)} (every rank runs it eagerly)")
    if any(v.status == Status.WARMUP_FAILED for v in bad) and not stateful:
        captured.stage = "warm_up"
    return True


def _details(bad: Sequence[Vote], what: str) -> str:
    prefix = f"{what}: "
    return "; ".join(f"failed on rank {v.rank}: {v.message.removeprefix(prefix)}" for v in bad)

