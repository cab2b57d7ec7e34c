"""One cached probe of what this process can do with GPU graphs.

Everything that branches on CUDA vs HIP vs no GPU asks :func:`probe` instead
of repeating version checks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Platform", "probe", "require_gpu", "GraphsUnavailableError"]

Backend = Literal["cuda", "hip"]


class GraphsUnavailableError(RuntimeError):
    """GPU graphs cannot run in this process (no GPU build, no visible device)."""


@dataclass(frozen=True)
class Platform:
    """What the installed PyTorch and device offer.

    ``backend`` is None when graphs cannot run; ``reason`` then says why.
    """

    backend: Backend | None
    torch_version: str
    runtime_version: str | None  # torch.version.cuda or torch.version.hip
    device_count: int
    device_name: str | None
    arch: str | None  # "sm_90" on CUDA, gcnArchName (e.g. "gfx1030") on ROCm
    reason: str | None

    @property
    def graphs_available(self) -> bool:
        return self.backend is not None


@functools.lru_cache(maxsize=1)
def probe() -> Platform:
    """Inspect PyTorch and device 0 once per process (cached)."""
    hip = getattr(torch.version, "hip", None)
    cuda = getattr(torch.version, "cuda", None)
    runtime_version = hip or cuda
    build: Backend | None = "hip" if hip else ("cuda" if cuda else None)
    if build is None:
        return Platform(
            None, torch.__version__, None, 0, None, None,
            f"PyTorch {torch.__version__} is a CPU-only build (torch.version.cuda and "
            "torch.version.hip are None); GPU graphs are unavailable and every graph "
            "path runs eagerly",
        )
    try:
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    except Exception as exc:  # a broken driver must not break import
        return Platform(None, torch.__version__, runtime_version, 0, None, None,
                        f"the {build.upper()} runtime failed to initialise: {exc}")
    if not available or count == 0:
        return Platform(
            None, torch.__version__, runtime_version, 0, None, None,
            f"PyTorch is built for {build.upper()} {runtime_version} but no GPU is visible "
            "(check the driver and CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)",
        )
    props = torch.cuda.get_device_properties(0)
    if build == "hip":
        arch = (getattr(props, "gcnArchName", "") or "").split(":")[0] or None
    else:
        arch = f"sm_{props.major}{props.minor}"
    return Platform(build, torch.__version__, runtime_version, count, props.name, arch, None)


def require_gpu(what: str) -> Platform:
    """Return the platform, or raise :class:`GraphsUnavailableError` naming ``what`` and why."""
    p = probe()
    if p.backend is None:
        raise GraphsUnavailableError(f"{what} needs a CUDA or ROCm GPU: {p.reason}")
    return p
