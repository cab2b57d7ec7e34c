"""Why work ran without a graph, or without padding: one closed set of reasons, and the value that carries one.

Every eager fallback, every bucket that runs eagerly, every refusal to pad
and every subgraph or piece that runs without graphs is described by a
:class:`Fallback`: a :class:`Reason` (the key in ``gfxgraph.stats()["fallback_reasons"]``)
and a detail for people. :class:`Reason` is a ``str`` enum, so a reason compares
equal to its name (``Reason.OVERSIZE == "oversize"``) and prints as it.
The README's table of reasons is checked against this enum by a test.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

__all__ = ["Reason", "Fallback", "FallsBack"]


class Reason(str, enum.Enum):
    """The closed set of fallback reasons (README: "Fallback reasons")."""

    # nothing can be graphed here
    NO_GPU = "no_gpu"
    GRAPHS_OFF = "graphs_off"
    CPU_INPUTS = "cpu_inputs"
    GRAD = "grad"
    TRAINING = "training"
    # a size no graph serves
    OVERSIZE = "oversize"
    MAX_VARIANTS = "max_variants"
    # a capture that was refused or failed
    VRAM_CAP = "vram_cap"
    WARMUP_FAILED = "warmup_failed"
    CAPTURE_FAILED = "capture_failed"
    REPLAY_FAILED = "replay_failed"
    PADDED_RUN_FAILED = "padded_run_failed"
    COMPILE_FAILED = "compile_failed"
    RECAPTURE = "recapture"
    # padding refused: the call runs in an exact-size graph, or unpadded
    ROWS_COUPLED = "rows_coupled"
    PADDING_CHANGES_RESULTS = "padding_changes_results"
    UNPROVEN = "unproven"
    STATEFUL = "stateful"
    RANDOM_OPS = "random_ops"
    TRAINING_LAYERS = "training_layers"
    UNKNOWN_OUTPUTS = "unknown_outputs"
    # the compile backend: a subgraph or piece that graphs cannot serve as traced
    BATCH_VALUE = "batch_value"
    SIZE_AS_VALUE = "size_as_value"
    SIZE_EXPRESSION = "size_expression"
    OUTPUT_SHAPE = "output_shape"
    INT_OUTPUT = "int_output"
    NO_BATCH_INPUT = "no_batch_input"
    UNSUPPORTED_INPUT = "unsupported_input"
    INPUT_MUTATION = "input_mutation"
    STRIDED_INPUT = "strided_input"
    BATCH_MISMATCH = "batch_mismatch"
    STATIC_SHAPE_WARMUP = "static_shape_warmup"
    COLLECTIVES = "collectives"
    RANK_DISAGREES = "rank_disagrees"
    # the high-level API and conditional graphs
    EAGER = "eager"

    def __str__(self) -> str:
        return self.value

    @property
    def refuses_padding(self) -> bool:
        """Whether this reason stops padding (calls then run in exact-size graphs or unpadded), not graphs."""
        return self in _PADDING


_PADDING = frozenset({Reason.ROWS_COUPLED, Reason.PADDING_CHANGES_RESULTS, Reason.UNPROVEN, Reason.STATEFUL,
                      Reason.RANDOM_OPS, Reason.TRAINING_LAYERS, Reason.UNKNOWN_OUTPUTS, Reason.PADDED_RUN_FAILED,
                      Reason.SIZE_AS_VALUE, Reason.SIZE_EXPRESSION})


@dataclass(frozen=True)
class Fallback:
    """One cause of running without a graph (or without padding): its reason and what happened.

    ``level`` is how loudly its first occurrence is logged (WARNING for what a
    user should fix or know about, INFO or DEBUG for expected causes).
    """

    reason: Reason
    detail: str = ""
    level: int = logging.WARNING

    def __post_init__(self) -> None:
        if not isinstance(self.reason, Reason):
            object.__setattr__(self, "reason", Reason(self.reason))  # a reason's name: ValueError if unknown

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


class FallsBack:
    """Work that may run without graphs: ``fallback`` says why (None while it runs graphed)."""

    fallback: Fallback | None = None

    @property
    def reason(self) -> Reason | None:
        """The fallback reason while ungraphed (a :class:`Reason`, a str)."""
        return None if self.fallback is None else self.fallback.reason

    @property
    def detail(self) -> str:
        return "" if self.fallback is None else self.fallback.detail
