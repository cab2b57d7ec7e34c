"""One cached probe of what this process can do with GPU graphs.

Everything that branches on CUDA vs HIP vs no GPU asks :func:`probe` (or, for
the build alone, :func:`torch_build_version`) instead of repeating version checks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from .errors import GraphsUnavailableError

__all__ = ["Platform", "Backend", "probe", "require_gpu", "torch_build_version", "torch_rocm_version"]

Backend = Literal["cuda", "hip"]


def torch_build_version() -> tuple[Backend | None, str | None]:
    """The GPU API the installed PyTorch was built for, and its version (None, None: CPU-only).

    Read on each call (cheap), unlike :func:`probe`, so that tests can change ``torch.version``.
    """
    hip = getattr(torch.version, "hip", None)
    if hip:
        return "hip", str(hip)
    cuda = getattr(torch.version, "cuda", None)
    if cuda:
        return "cuda", str(cuda)
    return None, None


def torch_rocm_version() -> str | None:
    """``torch.version.rocm``: the ROCm release PyTorch was built for, distinct from HIP's own
    version since pytorch#168097 (None on older PyTorch and on non-ROCm builds). Read on each call."""
    rocm = getattr(torch.version, "rocm", None)
    return str(rocm) if rocm else None


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
    build, runtime_version = torch_build_version()
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
