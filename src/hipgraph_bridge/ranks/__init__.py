"""Rank agreement: every rank of a process group makes the same decisions at the same step."""

from __future__ import annotations

from .agreement import RankAgreement, RankSession, Round, Status, Vote, as_agreement
from .decider import AgreedDecider, Decider, decider_for

__all__ = ["RankAgreement", "RankSession", "Round", "Status", "Vote", "as_agreement", "Decider", "AgreedDecider",
           "decider_for"]
