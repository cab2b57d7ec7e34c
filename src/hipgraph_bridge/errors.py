"""Every exception gfxgraph defines, by cause.

Bad arguments raise the built-in ``TypeError``/``ValueError`` with "expected
X, got Y"; wrong state raises ``RuntimeError`` naming the state and the fix.
The types below are for what the built-ins do not say. The graph errors are
``RuntimeError``\\ s, so code written for ``torch.cuda.CUDAGraph`` keeps
catching them; :class:`ConfigError` is a ``ValueError`` (a bad value).
"""

from __future__ import annotations

__all__ = ["ConfigError", "GraphsUnavailableError", "GraphCaptureError", "GraphRuntimeError", "StaleOutputError",
           "RankAgreementError"]


class ConfigError(ValueError):
    """An environment variable or option holds a value gfxgraph does not accept."""


class GraphsUnavailableError(RuntimeError):
    """GPU graphs cannot run in this process (no GPU build, no visible device, no runtime binding)."""


class GraphCaptureError(RuntimeError):
    """A stream capture failed. The capture was ended and its graph discarded
    before this was raised, so the stream is usable again."""


class GraphRuntimeError(RuntimeError):
    """A CUDA/HIP runtime call failed; carries the runtime's own error name and message.

    Attributes:
        call: the runtime function that failed, e.g. ``"cudaGraphInstantiate"``.
        name: the runtime's error name, e.g. ``"cudaErrorInvalidValue"``.
        code: the numeric error code.
        explanation: the runtime's error string.
    """

    def __init__(self, call: str, name: str, code: int, explanation: str) -> None:
        self.call = call
        self.name = name
        self.code = code
        self.explanation = explanation
        super().__init__(f"{call}: {name} ({code}): {explanation}")


class StaleOutputError(RuntimeError):
    """A graph's output view was used after a later call overwrote it (caught in debug mode only)."""


class RankAgreementError(RuntimeError):
    """The ranks of a process group could not agree on a pool decision, so no rank goes on alone.

    Raised on every rank that is still answering: when a peer left a call by
    raising (the message names the rank and its error), when the ranks are
    at different steps (naming each rank's), or when a peer did not answer
    within the agreement timeout. A timeout or a mismatch breaks the
    agreement for good (later calls raise at once); a peer's exception does not.
    """
