"""Exception types, by cause.

Bad arguments raise the built-in ``TypeError``/``ValueError`` with "expected
X, got Y"; wrong state raises ``RuntimeError`` naming the state and the fix.
Failures of the graph runtime itself raise these, all ``RuntimeError``s so
code written for ``torch.cuda.CUDAGraph`` keeps catching them.
"""

from __future__ import annotations

from .env import ConfigError
from .platform import GraphsUnavailableError

__all__ = [
    "ConfigError",
    "GraphsUnavailableError",
    "GraphCaptureError",
    "GraphRuntimeError",
]


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
