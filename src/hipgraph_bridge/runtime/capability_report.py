"""The capability table as rows and text: what ``gfxgraph doctor`` prints for this machine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..platform import probe
from ._base import NODE_GRAPH, NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET, Runtime
from ._select import current_runtime
from .capabilities import CAPABILITIES, Capabilities, capabilities_for, capabilities_of, current_capabilities

__all__ = ["capability_rows", "issue_warnings", "capability_lines", "capability_report", "machine_capabilities"]

_NODE_NAMES = {NODE_KERNEL: "kernel", NODE_MEMCPY: "memcpy", NODE_MEMSET: "memset", NODE_GRAPH: "child graph"}


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Sequence) and not isinstance(value, str):
        return ", ".join(_NODE_NAMES.get(v, str(v)) for v in value)
    return str(value)


def capability_rows(caps: Capabilities) -> list[dict[str, str]]:
    """One row per capability: ``capability``, ``meaning``, ``value``, ``note``, ``source``."""
    return [{"capability": r.capability, "meaning": CAPABILITIES[r.capability], "value": _value_text(r.value),
             "note": r.note, "source": r.source or "-"} for r in caps.rules]


def issue_warnings(caps: Capabilities) -> list[str]:
    """One warning per known issue that applies (or may: patch level or architecture unknown)."""
    out = []
    for issue, certain in caps.issues:
        where = f" on {issue.arch}" if issue.arch else ""
        maybe = "" if certain else " (may apply: the patch level or the architecture is not known)"
        out.append(f"{caps.label}{where}: {issue.summary}{maybe}. Advice: {issue.advice} ({issue.source})")
    return out


def capability_lines(caps: Capabilities | None) -> list[str]:
    """The table for ``caps`` as text: a heading, one line per capability, then the warnings."""
    if caps is None:
        return ["capabilities: none (CPU-only PyTorch: every graph path runs eagerly)"]
    arch = f", {caps.arch}" if caps.arch else ""
    lines = [f"capabilities for {caps.label}{arch} (version from {caps.version_source}):"]
    width = max(len(c) for c in CAPABILITIES)
    for row in capability_rows(caps):
        lines.append(f"  {row['capability']:{width}s}  {row['value']:22s}  {row['note']}")
        if row["source"] != "-":
            lines.append(f"  {'':{width}s}  {'':22s}  source: {row['source']}")
    lines.extend(f"WARNING: {w}" for w in issue_warnings(caps))
    return lines


def machine_capabilities(runtime: Runtime | None = None) -> Capabilities | None:
    """This machine's row: through ``runtime`` (None: the current binding, when one loads; else
    PyTorch's build), with device 0's architecture. None on a CPU-only PyTorch."""
    arch = probe().arch
    rt = runtime
    if rt is None:
        try:
            rt = current_runtime()
        except Exception:  # no binding: PyTorch's build still names the backend and version
            rt = None
    caps = capabilities_of(rt, arch=arch) if rt is not None else current_capabilities()
    if caps is not None and caps.arch != arch:
        caps = capabilities_for(caps.backend, caps.version, arch=arch, version_source=caps.version_source)
    return caps


def capability_report(caps: Capabilities | None = None) -> dict[str, Any]:
    """``caps`` (None: :func:`machine_capabilities`) as a JSON-friendly dict: ``backend``,
    ``version``, ``version_source``, ``arch``, ``rows``, ``warnings`` and ``lines`` (the text
    ``gfxgraph doctor`` prints). Cost: loads the runtime binding once, when ``caps`` is None."""
    caps = machine_capabilities() if caps is None else caps
    lines = capability_lines(caps)
    if caps is None:
        return {"backend": None, "version": None, "version_source": None, "arch": None, "rows": [],
                "warnings": [], "lines": lines}
    return {"backend": caps.backend, "version": None if caps.version is None else str(caps.version),
            "version_source": caps.version_source, "arch": caps.arch, "rows": capability_rows(caps),
            "warnings": issue_warnings(caps), "lines": lines}
