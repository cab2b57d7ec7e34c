"""Rank agreement: every rank of a process group makes the same pool decisions, at the same step.

A model that calls torch.distributed collectives (a tensor-parallel layer's
all-reduce) must run the same collectives, of the same shapes, in the same
order on every rank: a rank that replays bucket 8's graph while its peer
replays bucket 16's, or runs eagerly, waits forever inside NCCL (the hang
serving stacks report). A pool built with ``process_group=`` therefore
settles every decision that could differ between ranks in a *round*: each
rank writes one row of a table, every rank reads every row.

The rounds (:class:`Round`), one per decision point of a pool:

* ``batch``: each call's batch size. ``batch="equal"`` (the default) requires
  it identical on every rank and raises ``ValueError`` naming each rank's
  size; ``"max"`` pads every rank to the largest (as vLLM pads data-parallel
  ranks); ``"trusted"`` skips the round: the caller guarantees identical
  sizes (tensor parallelism does), and the capture rounds still check the bucket.
* ``capture_begin``: before a bucket's capture: the same bucket and constant
  arguments on every rank (else :class:`RankAgreementError`), and the VRAM
  cap: a rank that refuses makes every rank run that bucket eagerly.
* ``capture_end``: a warm-up or capture that failed on any rank makes every
  rank drop its graph and run that bucket eagerly, the reason naming the
  rank and its error.
* ``rows``: whether a key of constant arguments may be padded (each rank's row
  analysis; any rank that refuses makes every rank run exact sizes).
* ``padding_check``: a bucket's padding check (the poisoned replays).
* ``subgraph``: the compile backend's choice to graph a subgraph or not.

A rank that leaves a call by raising inside one of these steps first casts
a ``raised`` vote, so its peers raise :class:`RankAgreementError` naming it
at once. A rank that never arrives (it raised elsewhere, stopped calling the
pool, hangs in a collective of the model) makes its peers raise after
``timeout`` seconds. Every round is the same collective (a SUM all-reduce of
an int64 table on a dedicated gloo group), so ranks at different steps never
hang: the round completes and the mismatch is reported.

Cost: one round per call (a small CPU all-reduce: tens of microseconds
between processes of one host; none with ``batch="trusted"``), and a few on
each bucket's first call. Rounds run on the host, never inside a capture.

What it will not do: bound the model's own collectives (that is its process
group's ``timeout``), or agree pools driven from several threads of a
process (one thread drives the pools of a group, in the same order on every rank).
"""

from __future__ import annotations

import datetime
import enum
import threading
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..errors import RankAgreementError
from ..log import logger

__all__ = ["RankAgreement", "RankSession", "Round", "Status", "Vote", "as_agreement", "failures",
           "describe_failures", "key_code", "BATCH_RULES", "DEFAULT_TIMEOUT_S"]

BatchRule = Literal["equal", "max", "trusted"]
BATCH_RULES = ("equal", "max", "trusted")
DEFAULT_TIMEOUT_S = 300.0


class Round(enum.IntEnum):
    BATCH = 1
    STATIC_IO = 2
    CAPTURE_BEGIN = 3
    CAPTURE_END = 4
    PADDING_CHECK = 5
    ROWS = 6
    SUBGRAPH = 7


class Status(enum.IntEnum):
    OK = 0
    REFUSED = 1  # this rank will not (the VRAM cap, padding it cannot prove), or saw padding change a result
    CAPTURE_FAILED = 2  # the warm-up ran, the capture failed
    WARMUP_FAILED = 3  # the model raised before its capture
    RAISED = 4  # this rank leaves the call with an exception


_HEAD = 6  # words per row: pool, round, step, value, key, status
_MSG_BYTES = 384
_WORDS = _HEAD + _MSG_BYTES // 8


@dataclass(frozen=True)
class Vote:
    """One rank's row of a round."""

    rank: int
    pool: int
    kind: int
    step: int
    value: int
    key: int
    status: Status
    message: str

    def where(self) -> str:
        try:
            name = Round(self.kind).name.lower()
        except ValueError:
            name = f"round {self.kind}"
        return f"pool {self.pool} step {self.step} ({name} {self.value})"


_PLAIN = (int, float, bool, str, bytes, type(None))


def _stable(value: Any) -> str:
    """A text for ``value`` that is the same in every process, or ``ValueError``: a default ``repr``
    holds a memory address, which differs between processes."""
    if isinstance(value, _PLAIN) or isinstance(value, (torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (tuple, list, frozenset)):
        items = sorted(map(_stable, value)) if isinstance(value, frozenset) else map(_stable, value)
        return f"{type(value).__name__}({','.join(items)})"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    raise ValueError(f"a constant argument of type {type(value).__qualname__} under process_group: expected "
                     "numbers, strings, None, enums, dtypes, devices or tuples of them (the ranks compare "
                     "constant arguments by value, and this one has no value that is the same in every process)")


def key_code(key: Hashable) -> int:
    """A code for a key of constant arguments that is the same in every process (``hash`` is salted)."""
    return zlib.crc32(_stable(key).encode("utf-8", "replace"))


def failures(votes: Sequence[Vote]) -> list[Vote]:
    """The votes that are not OK."""
    return [v for v in votes if v.status != Status.OK]


def describe_failures(votes: Sequence[Vote]) -> str:
    """``"rank 1: RuntimeError: boom; rank 3: ..."``."""
    return "; ".join(f"rank {v.rank}: {v.message}" for v in votes)


class _Channel:
    """The gloo group the rounds run on, shared by every pool that agrees over the same ranks."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.pools = 0
        self.broken: str | None = None

    def next_pool(self) -> int:
        with self.lock:
            self.pools += 1
            return self.pools - 1

    def exchange(self, row: torch.Tensor, where: str) -> torch.Tensor:
        """Every rank's row (a SUM all-reduce of a table holding only this rank's row)."""
        with self.lock:
            if self.broken is not None:
                raise RankAgreementError(f"{where}: the rank agreement of this group broke earlier and is not "
                                         f"used again ({self.broken}); build the pools with a new RankAgreement")
            table = torch.zeros(self.world, _WORDS, dtype=torch.int64)
            table[self.rank] = row
            try:
                dist.all_reduce(table, group=self.group)
            except Exception as exc:  # gloo: a timeout, or a peer that closed its connection
                self.broken = f"{where}: {type(exc).__name__}: {exc}"
                raise RankAgreementError(
                    f"{where}: no answer from every rank within {self.timeout_s:g} s (a rank raised outside "
                    "the pool, stopped calling it, died, or is stuck in a collective of the model); "
                    f"{type(exc).__name__}: {exc}") from exc
            except BaseException:
                self.broken = f"{where}: interrupted"
                raise
        return table


_channels: dict[tuple[Any, ...], _Channel] = {}
_channels_lock = threading.Lock()


def _channel_for(agreement: RankAgreement) -> _Channel:
    """The agreement group of these ranks and timeout, created once (a collective of the group's ranks)."""
    ranks = tuple(dist.get_process_group_ranks(agreement.group))
    given = agreement.agreement_group
    # keyed by the objects themselves (held here): a re-initialised world gets new groups, never stale ones
    key: tuple[Any, ...] = (given,) if given is not None else (dist.group.WORLD, ranks, agreement.timeout_s)
    with _channels_lock:
        ch = _channels.get(key)
        if ch is not None and ch.broken is None:
            return ch
        if given is not None:
            group = given
        else:  # gloo on the host: rounds never touch a GPU stream, and its timeout bounds every round
            group = dist.new_group(ranks=list(ranks), backend="gloo",
                                   timeout=datetime.timedelta(seconds=agreement.timeout_s),
                                   use_local_synchronization=True)
        ch = _channels[key] = _Channel(group, agreement.timeout_s)
        return ch


class RankAgreement:
    """How pools agree with the other ranks of a process group: pass it, or the group, as ``process_group=``.

    Args:
        group: the ranks that run the model's collectives together (default: the world).
        batch: ``"equal"`` (default): every rank's batch size must be the same,
            checked each call (``ValueError`` naming each rank's size); ``"max"``:
            every rank is padded to the largest (rows of ``pad_value``, sliced
            off again), eager fallbacks included; ``"trusted"``: no per-call
            round, the caller guarantees identical sizes (checked at each capture).
        timeout: seconds (or a ``timedelta``) a round waits for the other ranks
            before every waiting rank raises :class:`RankAgreementError` (default 300).
        agreement_group: a gloo group over the same ranks to run the rounds on;
            default: one created for these ranks and timeout, once per process.

    Needs ``torch.distributed`` initialised. The first pool of a group and
    timeout creates the agreement group: a collective of the group's ranks,
    so build pools in the same order on every rank (as SPMD code does).
    """

    def __init__(self, group: Any = None, *, batch: BatchRule = "equal",
                 timeout: float | datetime.timedelta = DEFAULT_TIMEOUT_S, agreement_group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("RankAgreement: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group() on every rank first")
        for name, g in (("group", group), ("agreement_group", agreement_group)):
            if g is not None and not isinstance(g, dist.ProcessGroup):
                raise TypeError(f"{name}: expected a torch.distributed ProcessGroup or None, got {type(g).__name__}")
        if batch not in BATCH_RULES:
            raise ValueError(f"batch: expected one of {', '.join(map(repr, BATCH_RULES))}, got {batch!r}")
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"timeout: expected a positive number of seconds or a timedelta, got {timeout!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.batch: BatchRule = batch
        self.timeout_s = float(seconds)
        self.agreement_group = agreement_group
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError(f"group: expected a group this process belongs to, got one of the ranks "
                             f"{dist.get_process_group_ranks(self.group)} (this is global rank {dist.get_rank()})")
        self.world_size = dist.get_world_size(self.group)

    def session(self, what: str) -> RankSession:
        """The rounds of one pool (named ``what`` in messages); may create the agreement group."""
        channel = _channel_for(self)
        return RankSession(channel, channel.next_pool(), self.batch, what)

    def __repr__(self) -> str:
        return (f"RankAgreement(rank {self.rank} of {self.world_size}, batch={self.batch!r}, "
                f"timeout={self.timeout_s:g} s)")


def as_agreement(value: Any, *, name: str = "process_group") -> RankAgreement | None:
    """``value`` as a :class:`RankAgreement` (a bare group gets the defaults), or None."""
    if value is None or isinstance(value, RankAgreement):
        return value
    if dist.is_available() and isinstance(value, dist.ProcessGroup):
        return RankAgreement(value)
    raise TypeError(f"{name}: expected a torch.distributed ProcessGroup, a RankAgreement or None, "
                    f"got {type(value).__name__}")


class RankSession:
    """The rounds of one pool (see the module docstring); every rank's pool holds one."""

    def __init__(self, channel: _Channel, pool: int, batch: BatchRule, what: str) -> None:
        self._channel = channel
        self.pool = pool
        self.batch_rule: BatchRule = batch
        self.what = what
        self.rank = channel.rank
        self.world = channel.world
        self._step = 0

    def exchange(self, kind: Round, value: int, status: Status = Status.OK, message: str = "", *,
                 key: int = 0, same_value: bool = False, leaving: bool = False) -> list[Vote]:
        """One round: this rank's vote in, every rank's out (by rank).

        Raises :class:`RankAgreementError` when a peer voted ``raised``
        (unless this rank is ``leaving`` too), when the ranks are at different
        steps, or (``same_value``) when their values or keys differ.
        """
        self._step += 1
        where = f"{self.what}: rank {self.rank}, pool {self.pool} step {self._step} ({kind.name.lower()} {value})"
        row = torch.zeros(_WORDS, dtype=torch.int64)
        row[:_HEAD] = torch.tensor([self.pool, int(kind), self._step, value, key, int(status)])
        if message:
            data = message.encode("utf-8", "replace")[:_MSG_BYTES]
            row[_HEAD:] = torch.tensor(list(data.ljust(_MSG_BYTES, b"\0")), dtype=torch.uint8).view(torch.int64)
        votes = _decode(self._channel.exchange(row, where))
        self._check(votes, where, same_value=same_value, leaving=leaving)
        return votes

    def _check(self, votes: list[Vote], where: str, *, same_value: bool, leaving: bool) -> None:
        raised = [v for v in votes if v.status == Status.RAISED and v.rank != self.rank]
        if raised and not leaving:
            who = describe_failures(raised)
            raise RankAgreementError(f"{self.what}: {who} (raised at {raised[0].where()}); this rank raises too "
                                     "rather than go on without it")
        mine = votes[self.rank]
        if any((v.pool, v.kind, v.step) != (mine.pool, mine.kind, mine.step) for v in votes) and not leaving:
            self._channel.broken = f"ranks at different steps at {where}"
            raise RankAgreementError(f"{self.what}: the ranks are at different steps: "
                                     + "; ".join(f"rank {v.rank}: {v.where()}" for v in votes)
                                     + " (every rank must make the same pool calls in the same order)")
        if same_value and any((v.value, v.key) != (mine.value, mine.key) for v in votes):
            self._channel.broken = f"ranks at different buckets at {where}"
            raise RankAgreementError(f"{self.what}: the ranks are about to capture different buckets: "
                                     + "; ".join(f"rank {v.rank}: bucket {v.value} (key {v.key:#x})" for v in votes)
                                     + " (the batch sizes or constant arguments differ between ranks)")

    def settle(self, kind: Round, value: int, work: Callable[[], tuple[Status, str]], *, key: int = 0,
               same_value: bool = False) -> list[Vote]:
        """Run this rank's ``work`` (its status and why), then the round.

        A ``BaseException`` from ``work`` casts a ``raised`` vote and propagates.
        """
        try:
            status, message = work()
        except BaseException as exc:
            self.leave(kind, value, exc, key=key)
            raise
        return self.exchange(kind, value, status, message, key=key, same_value=same_value)

    def leave(self, kind: Round, value: int, exc: BaseException, *, key: int = 0) -> None:
        """Cast this rank's ``raised`` vote before its exception propagates; never raises itself."""
        try:
            self.exchange(kind, value, Status.RAISED, f"{type(exc).__name__}: {exc}", key=key, leaving=True)
        except Exception as err:  # the peers are gone too: this rank's own error is what the caller needs
            logger.warning("gfxgraph: could not tell the other ranks that rank %d raised: %s", self.rank, err)

    def agree_batch(self, batch: int, *, exact: bool = False) -> tuple[int, tuple[int, ...]]:
        """The batch size every rank runs this call at, and each rank's own (empty when trusted).

        Raises ``ValueError`` naming each rank's size when they differ and the
        rule is ``"equal"`` or ``exact`` (a zero-copy call: its views have fixed rows).
        """
        if self.batch_rule == "trusted":
            return batch, ()
        votes = self.exchange(Round.STATIC_IO if exact else Round.BATCH, batch)
        sizes = tuple(v.value for v in votes)
        if min(sizes) != max(sizes) and (exact or self.batch_rule == "equal"):
            each = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
            hint = ("static_io() views have fixed rows" if exact else
                    "or build the pool with RankAgreement(group, batch='max') to pad every rank to the largest")
            raise ValueError(f"{self.what}: the batch sizes differ between ranks ({each}); expected the same "
                             f"batch size on every rank ({hint})")
        return max(sizes), sizes

    def __repr__(self) -> str:
        return f"RankSession(rank {self.rank} of {self.world}, pool {self.pool}, step {self._step})"


def _decode(table: torch.Tensor) -> list[Vote]:
    votes = []
    for r in range(table.shape[0]):
        head = table[r, :_HEAD].tolist()
        try:
            status = Status(head[5])
        except ValueError:  # not a row this code wrote: treat the rank as gone
            status = Status.RAISED
        message = ""
        if status != Status.OK:  # only failures carry a message: the per-call round decodes none
            data = bytes(table[r, _HEAD:].contiguous().view(torch.uint8).tolist()).rstrip(b"\0")
            message = data.decode("utf-8", "replace")
        votes.append(Vote(r, head[0], head[1], head[2], head[3], head[4], status, message))
    return votes
