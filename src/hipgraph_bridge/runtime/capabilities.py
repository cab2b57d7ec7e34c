"""What each runtime version can be trusted to do with graphs: one table, every entry with its source.

Every strategy choice that depends on the backend (CUDA or HIP) or its version
reads :data:`TABLE` through one of three calls, and nothing else compares versions:

* :func:`capabilities_for` (backend, version): the pure lookup, cached;
* :func:`capabilities_of` (a runtime binding): the backend the binding reaches
  and the version it reports (CUDA: the lower of driver and runtime; HIP: the
  ROCm version of the loaded ``libamdhip64``, see :func:`detect_rocm_version`);
* :func:`current_capabilities`: this process, from what PyTorch was built for,
  without loading a binding (cached).

Each row says for which backend and version range a capability holds, a
one-line note, and where that is documented or reported. A capability whose
version is partly unknown (``torch.version.hip`` carries no ROCm patch level)
takes the first row that certainly applies, so rows are ordered specific
first, conservative catch-all last. :data:`ISSUES` lists known defects that
no strategy avoids; ``gfxgraph doctor`` warns about them.

No AMD GPU was available to this project: the HIP rows rest on ROCm's and
PyTorch's public trackers and documentation, and the HIP strategies they pick
are exercised by forcing them on CUDA (strategy arguments, or by substituting
:func:`identify` in tests).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from ..platform import torch_build_version, torch_rocm_version
from ._base import DEVICE_LAUNCH_REASON, NODE_GRAPH, NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET, Runtime
from ._library import LIBRARY_STEMS, _loaded_libraries

__all__ = ["Version", "Rule", "KnownIssue", "Capabilities", "CAPABILITIES", "TABLE", "ISSUES",
           "capabilities_for", "capabilities_of", "current_capabilities", "identify", "detect_rocm_version",
           "rocm_version_from_library", "first_version", "forget_detected_versions"]

Backend = Literal["cuda", "hip"]
_Key = tuple[int, int, int]


@dataclass(frozen=True)
class Version:
    """A runtime version; ``patch`` None when unknown (HIP's own version carries no ROCm patch level)."""

    major: int
    minor: int
    patch: int | None = None

    @classmethod
    def parse(cls, text: str) -> Version:
        """``"7.2.2"``, ``"12.8"``, ``"6.2.41133-dd7f95766"`` (a third field of 100 or more is a
        build number, not a patch level: patch None).

        Raises:
            ValueError: not ``MAJOR.MINOR[.PATCH]``.
        """
        m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
        if m is None:
            raise ValueError(f"version: expected 'MAJOR.MINOR[.PATCH]', got {text!r}")
        third = None if m.group(3) is None else int(m.group(3))
        return cls(int(m.group(1)), int(m.group(2)), third if third is not None and third < 100 else None)

    @classmethod
    def from_cuda_int(cls, value: int) -> Version:
        """CUDA's encoding, 1000 * major + 10 * minor (12080 is 12.8)."""
        return cls(value // 1000, (value % 1000) // 10)

    def bounds(self) -> tuple[_Key, _Key]:
        """The lowest and highest version this one can be (they differ when the patch is unknown)."""
        if self.patch is None:
            return (self.major, self.minor, 0), (self.major, self.minor, 10**6)
        key = (self.major, self.minor, self.patch)
        return key, key

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}" + ("" if self.patch is None else f".{self.patch}")


def _within(version: Version | None, since: _Key | None, before: _Key | None) -> bool | None:
    """Whether ``version`` is in [since, before): True, False, or None (cannot tell)."""
    if since is None and before is None:
        return True
    if version is None:
        return None
    low, high = version.bounds()
    inside = (since is None or low >= since) and (before is None or high < before)
    outside = (since is not None and high < since) or (before is not None and low >= before)
    return True if inside else False if outside else None


@dataclass(frozen=True)
class Rule:
    """One row of :data:`TABLE`: ``capability`` is ``value`` on ``backend`` in [since, before)."""

    capability: str
    backend: Backend
    since: _Key | None
    before: _Key | None
    value: Any
    note: str
    source: str  # where it is documented or reported; "" when it is gfxgraph's own choice

    def applies(self, backend: str, version: Version | None) -> bool | None:
        return None if backend != self.backend else _within(version, self.since, self.before)


@dataclass(frozen=True)
class KnownIssue:
    """A reported defect of a runtime version that no strategy avoids (``gfxgraph doctor`` warns)."""

    backend: Backend
    since: _Key | None
    before: _Key | None
    arch: str | None  # only on this architecture (None: any)
    summary: str
    advice: str
    source: str


# Sources (each verified in the public tracker or documentation it names).
_NV_CONDITIONAL = "https://developer.nvidia.com/blog/dynamic-control-flow-in-cuda-graphs-with-conditional-nodes/"
_NV_DEVICE_LAUNCH = "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#device-graph-launch"
_NV_DEVICE_GRAPH = "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#device-graph-requirements"
_HIP_3905 = "https://github.com/ROCm/hip/issues/3905"
_ROCM_6398 = "https://github.com/ROCm/legacy-rocm-build/issues/6398"
_RS_10021 = "https://github.com/ROCm/rocm-systems/issues/10021"
_RS_10714 = "https://github.com/ROCm/rocm-systems/pull/10714"
_RS_10713 = "https://github.com/ROCm/rocm-systems/issues/10713"
_RS_11434 = "https://github.com/ROCm/rocm-systems/pull/11434"
_RS_11069 = "https://github.com/ROCm/rocm-systems/pull/11069"
_RS_8776 = "https://github.com/ROCm/rocm-systems/pull/8776"
_PT_187110 = "https://github.com/pytorch/pytorch/pull/187110"
_PT_155684 = "https://github.com/pytorch/pytorch/issues/155684"
_PT_158165 = "https://github.com/pytorch/pytorch/pull/158165"
_HIP_3160 = "https://github.com/ROCm/hip/issues/3160"
_HIP_SET_ENABLED = ("https://rocm.docs.amd.com/projects/hipfort/en/latest/doxygen/html/"
                    "interfacehipfort_1_1hipgraphnodesetenabled.html")
_CUDA_SET_ENABLED = ("https://nvidia.github.io/cuda-python/pr-preview/pr-3095/cuda-bindings/latest/module/"
                     "generated/driver_v2/cuda.bindings._v2.driver.graph_node_set_enabled.html")
_CLR_279 = "https://github.com/ROCm/clr/issues/279"
_SGL_24011 = "https://github.com/sgl-project/sglang/issues/24011"

_TOGGLED = (NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET)

#: What each capability means (the table's keys, in the order reports list them).
CAPABILITIES: dict[str, str] = {
    "conditional_while": "native WHILE and one-body IF nodes (else: host-driven loop)",
    "conditional_branches": "native IF/ELSE and SWITCH nodes (else: per-branch dispatch or supergraph)",
    "exec_update": "GraphExecUpdate in place (else: re-instantiate)",
    "child_graph_update": "hot swap of a child graph in place (else: rebuild and re-instantiate)",
    "capture_errors_raised": "the runtime raises at capture-unsafe calls (else: gfxgraph checks capture status)",
    "toggle_node_types": "node types GraphNodeSetEnabled can disable (supergraph)",
    "toggle_in_flight": "node enable/disable leaves launches in flight alone (else: wait for the last one)",
    "device_launch": "device-side graph launch (else: host launch pipeline)",
    "device_graph_node_types": "node types a graph launched from the device may hold",
    "device_graph_relaunch": "a device graph may be launched from the device while a launch of it runs",
    "device_graph_tail_launches": "tail launches one graph may have pending",
    "device_graph_fire_and_forget": "fire-and-forget launches per execution of one graph",
}

TABLE: tuple[Rule, ...] = (
    Rule("conditional_while", "cuda", (12, 4, 0), None, True,
         "IF and WHILE conditional nodes since CUDA 12.4", _NV_CONDITIONAL),
    Rule("conditional_while", "cuda", None, None, False, "conditional nodes need CUDA 12.4", _NV_CONDITIONAL),
    Rule("conditional_branches", "cuda", (12, 8, 0), None, True,
         "IF with an else body and SWITCH nodes since CUDA 12.8", _NV_CONDITIONAL),
    Rule("conditional_branches", "cuda", None, None, False, "IF/ELSE and SWITCH need CUDA 12.8", _NV_CONDITIONAL),
    Rule("conditional_while", "hip", None, None, False,
         "HIP has no conditional graph nodes up to ROCm 7.2: a loop runs as the host-driven loop (one step "
         "graph replayed, one host read per iteration)", f"{_HIP_3905} {_ROCM_6398}"),
    Rule("conditional_branches", "hip", None, None, False,
         "HIP has no conditional graph nodes up to ROCm 7.2: a device-selected branch runs by per-branch "
         "dispatch after one host read (strategy='supergraph': one graph, node enable/disable)",
         f"{_HIP_3905} {_ROCM_6398}"),
    Rule("exec_update", "cuda", None, None, True, "cudaGraphExecUpdate, no reported defect", ""),
    # When a ROCm release carries rocm-systems#10714, #11434 and #11069, add a row
    # ("exec_update", "hip", since=that release, value=True) above this one.
    Rule("exec_update", "hip", None, None, False,
         "hipGraphExecUpdate can report success and keep the stale kernel packet (rocm-systems#10714, behind "
         "#10021), takes new kernel-argument space on every update (~354 MiB per 2000 updates of a 32-node "
         "graph on MI300X, #10713/#11434) and costs time quadratic in the node count (#11069); no ROCm "
         "release is known to carry the fixes", f"{_RS_10714} {_RS_10021} {_RS_11434} {_RS_11069}"),
    Rule("child_graph_update", "cuda", None, None, True, "cudaGraphExecChildGraphNodeSetParams, no reported "
         "defect", ""),
    Rule("child_graph_update", "hip", None, None, False,
         "hipGraphExec*NodeSetParams re-capture the node's kernel packet (rocm-systems#8776), which takes new "
         "kernel-argument space that is never reclaimed before the executable is destroyed (#11434)",
         f"{_RS_11434} {_RS_8776}"),
    Rule("capture_errors_raised", "cuda", None, None, True,
         "CUDA raises 'operation not permitted when stream is capturing' at capture-unsafe calls", _PT_155684),
    Rule("capture_errors_raised", "hip", (7, 14, 0), None, True,
         "from ROCm 7.14 HIP reports errors during stream capture", _PT_187110),
    Rule("capture_errors_raised", "hip", None, None, False,
         "before ROCm 7.14 HIP does not report errors during stream capture (PyTorch checks the capture "
         "status itself; pytorch#187110, fixing #180232; #155684, #158165)",
         f"{_PT_187110} {_PT_155684} {_PT_158165}"),
    Rule("toggle_node_types", "cuda", None, None, _TOGGLED,
         "cudaGraphNodeSetEnabled: only kernel, memset and memcpy nodes", _CUDA_SET_ENABLED),
    Rule("toggle_node_types", "hip", None, None, _TOGGLED,
         "hipGraphNodeSetEnabled: only kernel, memset and memcpy nodes", _HIP_SET_ENABLED),
    Rule("toggle_in_flight", "cuda", None, None, True,
         "enqueued or running launches are not affected by cudaGraphNodeSetEnabled", _CUDA_SET_ENABLED),
    Rule("toggle_in_flight", "hip", None, None, False,
         "hipGraphNodeSetEnabled's documentation does not say launches in flight are unaffected",
         _HIP_SET_ENABLED),
    Rule("device_launch", "cuda", (12, 0, 0), None, True,
         "since CUDA 12.0: a graph instantiated with cudaGraphInstantiateFlagDeviceLaunch and uploaded is "
         "launched by a kernel inside another graph (tail, fire-and-forget or sibling launch); gfxgraph links its "
         "launcher kernels against libcudadevrt.a at run time (doctor says when it is absent)", _NV_DEVICE_LAUNCH),
    Rule("device_launch", "cuda", None, None, False, DEVICE_LAUNCH_REASON, _NV_DEVICE_LAUNCH),
    Rule("device_graph_node_types", "cuda", (12, 0, 0), None, (NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET, NODE_GRAPH),
         "kernels (no dynamic parallelism), copies between device memory or pinned device-mapped host memory, "
         "memsets and child graphs, all on one device", _NV_DEVICE_GRAPH),
    Rule("device_graph_node_types", "cuda", None, None, (), DEVICE_LAUNCH_REASON, _NV_DEVICE_LAUNCH),
    Rule("device_graph_relaunch", "cuda", (12, 0, 0), None, False,
         "launching a device graph from the device while a launch of it is running returns "
         "cudaErrorInvalidValue; launching it from host and device at once is undefined", _NV_DEVICE_LAUNCH),
    Rule("device_graph_relaunch", "cuda", None, None, False, DEVICE_LAUNCH_REASON, _NV_DEVICE_LAUNCH),
    Rule("device_graph_tail_launches", "cuda", (12, 0, 0), None, 255,
         "a graph may have up to 255 pending tail launches (they run in the order queued)", _NV_DEVICE_LAUNCH),
    Rule("device_graph_tail_launches", "cuda", None, None, 0, DEVICE_LAUNCH_REASON, _NV_DEVICE_LAUNCH),
    Rule("device_graph_fire_and_forget", "cuda", (12, 0, 0), None, 120,
         "a graph may launch up to 120 fire-and-forget graphs during one execution (the count resets per "
         "launch of the parent)", _NV_DEVICE_LAUNCH),
    Rule("device_graph_fire_and_forget", "cuda", None, None, 0, DEVICE_LAUNCH_REASON, _NV_DEVICE_LAUNCH),
    Rule("device_launch", "hip", None, None, False,
         "no device-side graph launch in HIP (requested in ROCm/hip#3160; AMD pointed to host hipGraphLaunch)",
         _HIP_3160),
    *(Rule(c, "hip", None, None, v, "no device-side graph launch in HIP (ROCm/hip#3160)", _HIP_3160)
      for c, v in (("device_graph_node_types", ()), ("device_graph_relaunch", False),
                   ("device_graph_tail_launches", 0), ("device_graph_fire_and_forget", 0))),
)

ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue("hip", (7, 2, 0), (7, 2, 4), "gfx942",
               "HIP graph replays can silently corrupt outputs on MI300X under ROCm 7.2.0-7.2.3 (about one "
               "process in five; eager is correct; ROCm 7.0 and 7.13 are not affected)",
               "use gfxgraph.enable(validate=True) (GFXGRAPH=validate) to compare replays with eager, or "
               "change the ROCm version", _CLR_279),
    KnownIssue("hip", None, (7, 2, 2), None,
               "graph capture can fail with hipErrorCapturedEvent ('operation not permitted on an event last "
               "recorded in a capturing stream'); reported on ROCm <= 7.2.0, fixed in 7.2.2",
               "upgrade to ROCm 7.2.2 or later", _SGL_24011),
)


def first_version(backend: str, capability: str) -> Version | None:
    """The lowest version from which ``capability`` is True on ``backend`` (None: never)."""
    for rule in TABLE:
        if rule.backend == backend and rule.capability == capability and rule.value is True:
            return Version(*rule.since) if rule.since else Version(0, 0, 0)
    return None


def _decide(capability: str, backend: str, version: Version | None) -> Rule:
    """The first row that certainly applies, else the first that may (rows: specific first)."""
    maybe: Rule | None = None
    for rule in TABLE:
        if rule.capability != capability:
            continue
        applies = rule.applies(backend, version)
        if applies:
            return rule
        if applies is None and maybe is None:
            maybe = rule
    if maybe is None:
        raise LookupError(f"the capability table has no row for {capability!r} on {backend!r}")
    return maybe


@dataclass(frozen=True)
class Capabilities:
    """What one backend and version get, each capability with the :class:`Rule` that decided it.

    ``issues`` holds the :data:`ISSUES` that apply, each with whether that is certain
    (False: the version's patch level or the architecture is unknown).
    """

    backend: Backend
    version: Version | None
    version_source: str
    arch: str | None
    rules: tuple[Rule, ...]  # one per CAPABILITIES key, in that order
    issues: tuple[tuple[KnownIssue, bool], ...]

    def rule(self, capability: str) -> Rule:
        for r in self.rules:
            if r.capability == capability:
                return r
        raise KeyError(f"capability: expected one of {', '.join(CAPABILITIES)}, got {capability!r}")

    def why(self, capability: str) -> str:
        """The deciding row's note and source, for log lines and error messages."""
        r = self.rule(capability)
        return f"{r.note} ({r.source})" if r.source else r.note

    @property
    def label(self) -> str:
        """``"ROCm 7.2.0"``, ``"CUDA 12.8"`` (``"version unknown"`` when it could not be found)."""
        name = "ROCm" if self.backend == "hip" else "CUDA"
        return f"{name} {self.version}" if self.version is not None else f"{name} (version unknown)"

    @property
    def conditional_while(self) -> bool:
        """Native WHILE and one-body IF nodes (else: the host-driven loop)."""
        return bool(self.rule("conditional_while").value)

    @property
    def conditional_branches(self) -> bool:
        """Native IF/ELSE and SWITCH nodes (else: per-branch dispatch or supergraph)."""
        return bool(self.rule("conditional_branches").value)

    @property
    def exec_update(self) -> bool:
        """``GraphExecUpdate`` may be used in place (else: re-instantiate)."""
        return bool(self.rule("exec_update").value)

    @property
    def child_graph_update(self) -> bool:
        """A child graph may be hot-swapped in place (else: rebuild, re-instantiate)."""
        return bool(self.rule("child_graph_update").value)

    @property
    def capture_errors_raised(self) -> bool:
        """The runtime raises at capture-unsafe calls (else: check capture status)."""
        return bool(self.rule("capture_errors_raised").value)

    @property
    def toggle_node_types(self) -> tuple[int, ...]:
        """The node types ``GraphNodeSetEnabled`` can disable."""
        return tuple(self.rule("toggle_node_types").value)

    @property
    def toggle_in_flight(self) -> bool:
        """A node toggle leaves launches in flight alone (else: wait for the last one)."""
        return bool(self.rule("toggle_in_flight").value)

    @property
    def device_launch(self) -> bool:
        """Device-side graph launch is used (else: the host launch pipeline)."""
        return bool(self.rule("device_launch").value)


def _issues(backend: str, version: Version | None, arch: str | None) -> tuple[tuple[KnownIssue, bool], ...]:
    found = []
    for issue in ISSUES:
        applies = _within(version, issue.since, issue.before) if issue.backend == backend else False
        if applies is not False and issue.arch is not None and arch != issue.arch:
            applies = None if arch is None else False
        if applies is not False:
            found.append((issue, bool(applies)))
    return tuple(found)


@functools.lru_cache(maxsize=64)
def capabilities_for(backend: str, version: Version | None, *, arch: str | None = None,
                     version_source: str = "given") -> Capabilities:
    """Look ``backend`` (``"cuda"``/``"hip"``) at ``version`` up in :data:`TABLE` (cached; pure).

    ``version`` None (unknown) gets the conservative catch-all rows.

    Raises:
        ValueError: an unknown backend, or a version that is not a :class:`Version`.
    """
    if backend not in ("cuda", "hip"):
        raise ValueError(f"backend: expected 'cuda' or 'hip', got {backend!r}")
    if version is not None and not isinstance(version, Version):
        raise ValueError(f"version: expected a Version or None, got {type(version).__name__}")
    rules = tuple(_decide(c, backend, version) for c in CAPABILITIES)
    return Capabilities(backend, version, version_source, arch,  # type: ignore[arg-type]
                        rules, _issues(backend, version, arch))


# ------------------------------------------------------------ which version
def rocm_version_from_library(path: str) -> Version | None:
    """The ROCm version in a ``libamdhip64.so.MAJOR.MINOR.NNNNN`` file name (None: not such a name).

    ROCm releases encode their version in the last field (``libamdhip64.so.7.2.70203`` is ROCm
    7.2.3, as reported in rocm-systems#10021); a last field that does not decode to the same
    major.minor is a build number, and the patch level stays unknown.
    """
    m = re.search(r"libamdhip64\.so\.(\d+)\.(\d+)\.(\d+)$", os.path.basename(str(path)))
    if m is None:
        return None
    major, minor, last = (int(g) for g in m.groups())
    decoded = (last // 10000, (last // 100) % 100, last % 100)
    if decoded[:2] == (major, minor):
        return Version(*decoded)
    return Version(major, minor)


@functools.lru_cache(maxsize=8)
def detect_rocm_version(library: str | None = None) -> tuple[Version | None, str]:
    """This process's ROCm version and how it was found (cached; :func:`forget_detected_versions`).

    Order: the file name of ``library`` or of the ``libamdhip64`` mapped into the process
    (the runtime actually in use), ``torch.version.rocm`` (the ROCm PyTorch was built for),
    then ``torch.version.hip`` (HIP's own version: the ROCm patch level stays unknown).
    Cost: one read of ``/proc/self/maps`` on the first call.
    """
    for path in ([library] if library else []) + _loaded_libraries(LIBRARY_STEMS["hip"]):
        found = rocm_version_from_library(path)
        if found is not None:
            return found, f"file name of the loaded {os.path.basename(path)}"
    rocm = torch_rocm_version()
    if rocm:
        try:
            return Version.parse(rocm), f"torch.version.rocm {rocm!r} (the ROCm PyTorch was built for)"
        except ValueError:
            pass
    build, text = torch_build_version()
    if build == "hip" and text:
        try:
            v = Version.parse(text)
        except ValueError:
            return None, f"torch.version.hip {text!r} is not a version"
        return Version(v.major, v.minor), f"torch.version.hip {text!r} (HIP's version: ROCm patch level unknown)"
    return None, "no ROCm version found (no libamdhip64 loaded; torch.version.rocm and .hip unset)"


def identify(runtime: Runtime | None = None) -> tuple[Backend | None, Version | None, str]:
    """(backend, version, how it was found) for ``runtime``, or for this process when None.

    CUDA: the lower of the driver and runtime versions the binding reports (both must support
    a feature), else ``torch.version.cuda``. HIP: :func:`detect_rocm_version`.
    """
    if runtime is not None and runtime.name == "hip":
        return ("hip", *detect_rocm_version(getattr(runtime, "path", None) or None))
    if runtime is not None:
        caps = runtime.capabilities
        known = [v for v in (caps.driver_version, caps.runtime_version) if v > 0]
        if known:
            return ("cuda", Version.from_cuda_int(min(known)),
                    f"the lower of CUDA driver {Version.from_cuda_int(caps.driver_version)} and runtime "
                    f"{Version.from_cuda_int(caps.runtime_version)} ({runtime.binding})")
    build, text = torch_build_version()
    if build == "hip":
        return ("hip", *detect_rocm_version())
    if build == "cuda" and text:
        try:
            return "cuda", Version.parse(text), f"torch.version.cuda {text!r} (what PyTorch was built for)"
        except ValueError:
            return "cuda", None, f"torch.version.cuda {text!r} is not a version"
    return None, None, "CPU-only PyTorch: no GPU runtime"


@functools.lru_cache(maxsize=32)
def capabilities_of(runtime: Runtime, *, arch: str | None = None) -> Capabilities:
    """The table's answer for the backend ``runtime`` reaches, at the version it reports.

    Cost: a cached lookup per runtime object (about 0.2 us; runtimes are cached
    themselves, see :func:`~._select.get_runtime`).
    """
    backend, version, how = identify(runtime)
    return capabilities_for(backend or runtime.name, version, arch=arch, version_source=how)


@functools.lru_cache(maxsize=1)
def current_capabilities() -> Capabilities | None:
    """This process's row of the table, from PyTorch's build (no binding is loaded; cached).

    None on a CPU-only PyTorch. Strategy code that holds a runtime uses :func:`capabilities_of`.
    """
    backend, version, how = identify(None)
    if backend is None:
        return None
    return capabilities_for(backend, version, version_source=how)


def forget_detected_versions() -> None:
    """Forget cached versions and rows (tests, or after loading another runtime library)."""
    detect_rocm_version.cache_clear()
    current_capabilities.cache_clear()
    capabilities_of.cache_clear()
    capabilities_for.cache_clear()

