"""What this process can do with native conditional graph nodes: one cached probe, one strategy rule.

Every choice between a native strategy (CUDA conditional nodes) and its
emulation (dispatch, supergraph, host loop) reads :func:`conditional_support`
through :func:`choose_strategy`. Which versions have which nodes is the
capability table's answer (:mod:`hipgraph_bridge.runtime.capabilities`); the
probe adds what the table cannot know: the binding, the driver and NVRTC.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..log import logger
from ..platform import probe
from ..runtime import Version, capabilities_for, current_capabilities, first_version, get_runtime
from .kernels import nvrtc_unavailable_reason

__all__ = ["ConditionalSupport", "conditional_support", "choose_strategy"]


def _version_text(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "unknown"


def _threshold(capability: str) -> str:
    v = first_version("cuda", capability)
    return f"{v.major}.{v.minor}" if v is not None else "an unreleased version"


@dataclass(frozen=True)
class ConditionalSupport:
    """What this process can do with native conditional nodes (one cached probe).

    ``while_loop``: WHILE and single-body IF (CUDA >= 12.4 driver and runtime).
    ``if_else``/``switch``: two-body IF and SWITCH (CUDA >= 12.8).
    ``reason`` says what is missing (None when everything is there).
    """

    while_loop: bool
    if_else: bool
    switch: bool
    driver_version: int
    runtime_version: int
    reason: str | None

    @property
    def branches(self) -> bool:
        """Whether device-selected branches (IF/ELSE and SWITCH) are native."""
        return self.if_else and self.switch


@functools.lru_cache(maxsize=1)
def conditional_support() -> ConditionalSupport:
    """Probe once: backend, cuda-bindings, driver/runtime versions, NVRTC. Logged at debug."""
    support = _probe_support()
    logger.debug("gfxgraph: conditional nodes: while=%s if_else=%s switch=%s (driver %s, runtime %s)%s",
                 support.while_loop, support.if_else, support.switch,
                 _version_text(support.driver_version), _version_text(support.runtime_version),
                 f": {support.reason}" if support.reason else "")
    return support


def _probe_support() -> ConditionalSupport:
    def none(reason: str, drv: int = 0, rtv: int = 0) -> ConditionalSupport:
        return ConditionalSupport(False, False, False, drv, rtv, reason)

    plat = probe()
    if plat.backend is None:
        return none(plat.reason or "no GPU")
    built = current_capabilities()  # the table's row for this process (PyTorch's build)
    backend = built.backend if built is not None else plat.backend
    if first_version(backend, "conditional_while") is None \
            and first_version(backend, "conditional_branches") is None:  # HIP: no version has them
        return none(capabilities_for(backend, None).rule("conditional_branches").note)
    try:
        rt = get_runtime("cuda-bindings")
    except Exception as exc:  # missing binding: the message names the extra to install
        return none(f"native conditional nodes need cuda-bindings: {exc}")
    missing = rt.conditional_nodes_reason()
    drv, rtv = rt.capabilities.driver_version, rt.capabilities.runtime_version
    if missing:
        return none(missing, drv, rtv)
    why = nvrtc_unavailable_reason()
    if why:
        return none(f"the value-setter kernels need NVRTC: {why}", drv, rtv)
    # Both the driver and the runtime must have a node type: the table is read at the lower version.
    caps = capabilities_for("cuda", Version.from_cuda_int(min(drv, rtv)))
    while_ok = caps.conditional_while
    branch_ok = caps.conditional_branches and rt.binds_switch_nodes()
    reason = None
    if not branch_ok:
        reason = (f"IF/ELSE and SWITCH nodes need CUDA >= {_threshold('conditional_branches')} in both the "
                  f"driver ({_version_text(drv)}) and the runtime ({_version_text(rtv)})")
        if not while_ok:
            reason += f"; WHILE needs >= {_threshold('conditional_while')}"
    return ConditionalSupport(while_ok, branch_ok, branch_ok, drv, rtv, reason)


def choose_strategy(requested: str, strategies: tuple[str, ...], *, native_supported: Callable[[Any], bool],
                    nodes: str, supported_nodes: str, fallback: str, fallback_what: str) -> tuple[str, str]:
    """Shared strategy rule of ConditionalGraph and DeviceWhileLoop: (strategy, why).

    No GPU: ``"eager"``. A non-native strategy asked for by name: that one. Otherwise
    ``"native"`` when ``native_supported(conditional_support())``, else ``fallback``
    (or RuntimeError when ``"native"`` was forced).
    """
    if requested not in strategies:
        raise ValueError(f"strategy: expected one of {', '.join(strategies)}, got {requested!r}")
    plat = probe()
    if not plat.graphs_available:
        return "eager", plat.reason or "no GPU"
    if requested not in ("auto", "native"):
        return requested, f"strategy={requested!r} was requested"
    support = conditional_support()
    if native_supported(support):
        return "native", f"the driver and cuda-bindings support {supported_nodes}"
    if requested == "native":
        raise RuntimeError(f"strategy='native' needs CUDA {nodes}: {support.reason}; "
                           f"use strategy='auto' to fall back to {fallback_what}")
    return fallback, f"native {nodes} unavailable: {support.reason}"
