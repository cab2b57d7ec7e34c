"""When a padded replay may answer a call, and how its first answer is checked.

Padding rows are harmless only while rows do not interact. The rules, per
key of constant arguments:

* A ``stateful`` model (one that writes state it keeps, like a static KV
  cache) is never padded: padding rows could write to that state, and such a
  model cannot be run twice to check. A batch that is not a bucket gets a
  graph of exactly its size instead (the pool does that before asking here).
* A padded call whose outputs cannot be sliced back (which outputs carry the
  batch could not be learnt) runs eagerly (reason ``unknown_outputs``).
* The first padded call of every bucket is compared with an eager run on the
  caller's own arguments. If they differ beyond rounding, that key's padded
  calls run eagerly from then on (reason ``padding_changes_results``) and this
  call returns the eager result: rows interact (a batch mean, batch norm in
  training mode), or the model is random.

The check costs one eager run and a host sync, once per bucket. Under a rank
agreement (:mod:`.ranks`) every rank runs it at the same call, and padding
changed a result everywhere if it did on any rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

from .. import config, stats
from ..log import log_once
from ..validation import checked_against_eager, padding_changed
from .entry import Bucket
from .ranks import RankSession, Round, Status, describe_failures, failures

__all__ = ["PaddingGuard", "UNKNOWN_OUTPUTS"]

UNKNOWN_OUTPUTS = ("which outputs carry the batch is unknown, so a padded result cannot be sliced back; "
                   "pass batched_outputs=")


class PaddingGuard:
    """The padding rules of one pool (see the module docstring)."""

    def __init__(self, *, stateful: bool, ranks: RankSession | None = None) -> None:
        self.stateful = stateful
        self.ranks = ranks  # under a rank agreement the check's outcome is every rank's (module .ranks)
        self.row_coupled: dict[tuple[Hashable, ...], str] = {}  # constants key -> what the check saw

    def refusal(self, consts: tuple[Hashable, ...], *, outputs_known: bool) -> tuple[str, str] | None:
        """Why a padded call with these constants must run eagerly (None: it may be padded)."""
        why = self.row_coupled.get(consts)
        if why is not None:
            return "padding_changes_results", why
        if not outputs_known:
            return "unknown_outputs", UNKNOWN_OUTPUTS
        return None

    def answer(self, entry: Bucket, batch: int, out: Any, eager: Callable[[], Any], *, owner: object) -> Any:
        """What a call returns for ``out``, ``entry``'s result sliced to ``batch`` rows.

        A bucket's first padded result is compared with ``eager()`` (:meth:`check`);
        in validation mode every result is (dtype-aware tolerances, counted,
        eager returned on a mismatch), except a stateful model's, which cannot
        be run twice.
        """
        validate = config.switches.validate and not self.stateful
        first_padded = batch < entry.size and not self.stateful and not entry.padding_checked
        if not (validate or first_padded):
            return out
        if not first_padded:
            return checked_against_eager(out, eager(), owner=owner, what="ShapeBucketPool")
        out, reference = self.check(entry, batch, out, eager)
        if validate:  # the check's eager run is the reference: the model is not run a third time
            return checked_against_eager(out, reference, owner=owner, what="ShapeBucketPool")
        return out

    def check(self, entry: Bucket, batch: int, padded_out: Any, eager: Callable[[], Any]) -> tuple[Any, Any]:
        """Compare a bucket's first padded result with ``eager()``; returns (result, the eager result).

        The result is ``padded_out`` when they agree, else the eager one (and
        this key's padded calls run eagerly from now on).
        """
        if self.ranks is None:
            reference = eager()
            why = padding_changed(padded_out, reference)
        else:
            reference, why = self._agreed_check(entry, padded_out, eager, self.ranks)
        entry.padding_checked = True  # only once it is decided: a check that raised is tried again
        if not why:
            return padded_out, reference
        detail = (f"batch {batch} padded to {entry.size}: {why}; rows depend on each other (a reduction over the "
                  "batch?) or the model is random, so padded calls run eagerly from now on")
        self.row_coupled[entry.key] = detail
        log_once(("padding_changes_results", id(self)), logging.WARNING, "gfxgraph: ShapeBucketPool: %s", detail)
        stats.record_fallback("padding_changes_results", detail)
        return reference, reference

    @staticmethod
    def _agreed_check(entry: Bucket, padded_out: Any, eager: Callable[[], Any],
                      ranks: RankSession) -> tuple[Any, str]:
        """The check on every rank at once: padding changed a result if it did on any rank (named)."""
        box: list[Any] = []

        def work() -> tuple[Status, str]:
            box.append(eager())
            why = padding_changed(padded_out, box[0])
            return (Status.REFUSED, why) if why else (Status.OK, "")

        bad = failures(ranks.settle(Round.PADDING_CHECK, entry.size, work))
        return box[0], describe_failures(bad)
