"""The capability table, driven with mocked versions: which strategy each CUDA and ROCm version gets.

Each case sets ``torch.version`` (and, for CUDA, the versions a fake binding
reports) to one release and asks the real entry points which strategy they
pick: conditional branches and loops, exec update, the compositor's hot swap,
capture-status checks, supergraph toggling, and what ``gfxgraph doctor``
warns about. No GPU is needed.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from hipgraph_bridge.compose.compositor import GraphCompositor
from hipgraph_bridge.compose.exec_update import apply_update
from hipgraph_bridge.conditional import strategies
from hipgraph_bridge.conditional import support as cond_support
from hipgraph_bridge.conditional.graph import resolve_strategy
from hipgraph_bridge.conditional.loop import resolve_loop_strategy
from hipgraph_bridge.errors import GraphCaptureError
from hipgraph_bridge.graph import capture as capture_mod
from hipgraph_bridge.graph.recovery import capture_lost_reason, runtime_checks_capture
from hipgraph_bridge.platform import Platform
from hipgraph_bridge.runtime import (
    CAPABILITIES,
    NODE_KERNEL,
    NODE_MEMCPY,
    NODE_MEMSET,
    TABLE,
    ExecUpdateOutcome,
    Graph,
    Runtime,
    RuntimeCaps,
    Version,
    capabilities_for,
    capabilities_of,
    capability_lines,
    capability_report,
    current_capabilities,
    detect_rocm_version,
    forget_detected_versions,
)
from hipgraph_bridge.runtime import capabilities as caps_mod
from hipgraph_bridge.runtime.capabilities import rocm_version_from_library

# (backend, version, the torch.version fields that say so)
RELEASES = {
    "hip-6.2": ("hip", "6.2", {"hip": "6.2.41133-dd7f95766", "rocm": None}),  # older torch: no .rocm
    "hip-7.0": ("hip", "7.0", {"hip": "7.0.51831", "rocm": "7.0.0"}),
    "hip-7.2.0": ("hip", "7.2.0", {"hip": "7.2.26015", "rocm": "7.2.0"}),
    "hip-7.2.2": ("hip", "7.2.2", {"hip": "7.2.26043", "rocm": "7.2.2"}),
    "hip-7.14": ("hip", "7.14", {"hip": "7.14.60850", "rocm": None}),
    "cuda-12.3": ("cuda", "12.3", {"cuda": "12.3"}),
    "cuda-12.8": ("cuda", "12.8", {"cuda": "12.8"}),
    "cuda-13.0": ("cuda", "13.0", {"cuda": "13.0"}),
}

# What each release gets: conditional branch strategy, loop strategy, exec update in place,
# hot swap in place, capture-status checks, and the known issues doctor warns about (on gfx942).
EXPECTED = {
    "hip-6.2": ("dispatch", "host", False, False, True, {"sglang-project/sglang#24011"}),
    "hip-7.0": ("dispatch", "host", False, False, True, {"sglang-project/sglang#24011"}),
    "hip-7.2.0": ("dispatch", "host", False, False, True, {"ROCm/clr#279", "sglang-project/sglang#24011"}),
    "hip-7.2.2": ("dispatch", "host", False, False, True, {"ROCm/clr#279"}),
    "hip-7.14": ("dispatch", "host", False, False, False, set()),
    "cuda-12.3": ("dispatch", "host", True, True, False, set()),
    "cuda-12.8": ("native", "native", True, True, False, set()),
    "cuda-13.0": ("native", "native", True, True, False, set()),
}

_ISSUE_URLS = {"https://github.com/ROCm/clr/issues/279": "ROCm/clr#279",
               "https://github.com/sgl-project/sglang/issues/24011": "sglang-project/sglang#24011"}


def _cuda_int(text: str) -> int:
    v = Version.parse(text)
    return 1000 * v.major + 10 * v.minor


class _Binding:
    """What the conditional-support probe reads from a cuda-bindings runtime."""

    def __init__(self, version: int) -> None:
        self.capabilities = RuntimeCaps(version, version, True, True, True, False, "")

    def conditional_nodes_reason(self):
        return None

    def binds_switch_nodes(self):
        return True


class FakeRuntime(Runtime):
    """Enough of a runtime for apply_update and the compositor; records the calls that matter."""

    kind = "fake"
    binding = "fake"

    def __init__(self, name: str, version: int = 0) -> None:
        self.name = self.prefix = name
        self._version = version
        self._ids = itertools.count(0x1000, 0x10)
        self.calls: list[str] = []

    def _has(self, suffix):
        return True

    def _error_name(self, code):
        return f"{self.prefix}ErrorFake"

    def _error_string(self, code):
        return "fake"

    def _clear_last_error(self):
        pass

    def runtime_version(self):
        return self._version

    def driver_version(self):
        return self._version

    def graph_create(self):
        return next(self._ids)

    def graph_instantiate(self, graph, flags=0):
        self.calls.append("instantiate")
        return next(self._ids)

    def graph_add_child(self, graph, deps, child):
        return next(self._ids)

    def exec_update(self, exec_, graph):
        self.calls.append("exec_update")
        return ExecUpdateOutcome(True, f"{self.prefix}GraphExecUpdateSuccess")

    def exec_set_child(self, exec_, node, child):
        self.calls.append("set_child")

    def event_create(self):
        return next(self._ids)

    def exec_upload(self, exec_, stream):
        pass

    def exec_launch(self, exec_, stream):
        pass

    def event_record(self, event, stream):
        pass

    def event_query(self, event):
        return True

    def graph_destroy(self, graph):
        pass

    def exec_destroy(self, exec_):
        pass

    def event_destroy(self, event):
        pass


@pytest.fixture
def release(request, monkeypatch):
    """Make this process look like ``request.param``'s release; yield (key, backend, version)."""
    key = request.param
    backend, text, fields = RELEASES[key]
    for name in ("cuda", "hip", "rocm"):
        monkeypatch.setattr(torch.version, name, fields.get(name), raising=False)
    monkeypatch.setattr(caps_mod, "_loaded_libraries", lambda stem: [])  # no libamdhip64 in this process
    arch = "gfx942" if backend == "hip" else "sm_90"
    monkeypatch.setattr(cond_support, "probe",
                        lambda: Platform(backend, torch.__version__, text, 1, "fake", arch, None))
    monkeypatch.setattr(cond_support, "nvrtc_unavailable_reason", lambda: None)
    monkeypatch.setattr(cond_support, "get_runtime", lambda kind=None: _Binding(_cuda_int(text)))
    forget_detected_versions()
    cond_support.conditional_support.cache_clear()
    yield key, backend, text
    forget_detected_versions()
    cond_support.conditional_support.cache_clear()


def _fake_runtime(backend: str, text: str) -> FakeRuntime:
    return FakeRuntime(backend, _cuda_int(text) if backend == "cuda" else 0)


ALL = pytest.mark.parametrize("release", list(RELEASES), indirect=True)


# ------------------------------------------------------------------ versions
class TestVersions:
    @pytest.mark.parametrize("text, expected", [
        ("7.2.2", Version(7, 2, 2)), ("12.8", Version(12, 8)), ("6.2.41133-dd7f95766", Version(6, 2)),
        ("7.14.60850", Version(7, 14)), ("13.0", Version(13, 0)),
    ])
    def test_parse(self, text, expected):
        assert Version.parse(text) == expected

    def test_parse_refuses_what_is_not_a_version(self):
        with pytest.raises(ValueError, match="expected 'MAJOR.MINOR"):
            Version.parse("rocm")

    def test_cuda_encoding(self):
        assert Version.from_cuda_int(12080) == Version(12, 8) and Version.from_cuda_int(13000) == Version(13, 0)

    @pytest.mark.parametrize("name, expected", [
        ("/opt/rocm/lib/libamdhip64.so.7.2.70203", Version(7, 2, 3)),  # ROCm 7.2.3 (rocm-systems#10021)
        ("libamdhip64.so.6.2.60204", Version(6, 2, 4)),
        ("libamdhip64.so.7.14.60850", Version(7, 14)),  # a build number: patch level unknown
        ("libamdhip64.so.7", None),
        ("libcudart.so.13", None),
    ])
    def test_rocm_version_from_library_file_name(self, name, expected):
        assert rocm_version_from_library(name) == expected

    def test_detection_order(self, monkeypatch):
        monkeypatch.setattr(torch.version, "hip", "7.2.26015", raising=False)
        monkeypatch.setattr(torch.version, "rocm", "7.2.1", raising=False)
        monkeypatch.setattr(caps_mod, "_loaded_libraries", lambda stem: ["/x/libamdhip64.so.7.2.70203"])
        forget_detected_versions()
        try:
            assert detect_rocm_version()[0] == Version(7, 2, 3)  # the runtime actually loaded wins
            monkeypatch.setattr(caps_mod, "_loaded_libraries", lambda stem: [])
            forget_detected_versions()
            assert detect_rocm_version() == (Version(7, 2, 1), "torch.version.rocm '7.2.1' (the ROCm PyTorch "
                                                                "was built for)")
            monkeypatch.setattr(torch.version, "rocm", None, raising=False)
            forget_detected_versions()
            v, how = detect_rocm_version()
            assert v == Version(7, 2) and "patch level unknown" in how
        finally:
            forget_detected_versions()

    def test_unknown_patch_is_conservative_and_said(self):
        caps = capabilities_for("hip", Version(7, 2), arch="gfx942")
        assert not caps.capture_errors_raised
        assert [certain for _, certain in caps.issues] == [False, False]  # may apply: patch unknown
        assert all("may apply" in w for w in capability_report(caps)["warnings"])


# ------------------------------------------------------------------- table
class TestTable:
    def test_every_capability_has_a_row_for_every_backend_at_any_version(self):
        for backend, capability in itertools.product(("cuda", "hip"), CAPABILITIES):
            assert capabilities_for(backend, None).rule(capability).capability == capability

    def test_every_hip_row_and_issue_names_a_public_source(self):
        for rule in TABLE:
            if rule.backend == "hip":
                assert rule.source.startswith("https://"), rule
        for issue in caps_mod.ISSUES:
            assert issue.source.startswith("https://github.com/")

    def test_supergraph_may_disable_only_kernel_memcpy_memset_nodes(self):
        for backend in ("cuda", "hip"):
            assert set(capabilities_for(backend, None).toggle_node_types) == {NODE_KERNEL, NODE_MEMCPY,
                                                                              NODE_MEMSET}

    def test_device_side_launch_on_cuda_12_only(self):
        hip = capabilities_for("hip", Version(7, 14))
        assert not hip.device_launch and "ROCm/hip#3160" in hip.why("device_launch")
        assert hip.rule("device_graph_tail_launches").value == 0
        cuda = capabilities_for("cuda", Version(13, 0))
        assert cuda.device_launch and "libcudadevrt" in cuda.why("device_launch")
        assert not capabilities_for("cuda", Version(11, 8)).device_launch
        # the limits CUDA documents, each with its source
        assert cuda.rule("device_graph_tail_launches").value == 255
        assert cuda.rule("device_graph_fire_and_forget").value == 120
        assert cuda.rule("device_graph_relaunch").value is False
        assert set(cuda.rule("device_graph_node_types").value) == {0, 1, 2, 4}
        for name in ("device_launch", "device_graph_node_types", "device_graph_relaunch",
                     "device_graph_tail_launches", "device_graph_fire_and_forget"):
            assert cuda.rule(name).source.startswith("https://docs.nvidia.com/cuda/")

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="backend: expected 'cuda' or 'hip'"):
            capabilities_for("xpu", None)
        with pytest.raises(ValueError, match="version: expected a Version"):
            capabilities_for("hip", "7.2")
        with pytest.raises(KeyError, match="capability: expected one of"):
            capabilities_for("hip", None).rule("teleport")


# ------------------------------------------------------- strategies by release
@ALL
def test_conditional_strategies(release):
    key, _, _ = release
    branch, loop = EXPECTED[key][:2]
    assert resolve_strategy("auto")[0] == branch
    assert resolve_loop_strategy("auto")[0] == loop
    # the HIP emulations stay forcible on every release (how they run on CUDA hardware)
    assert resolve_strategy("supergraph")[0] == "supergraph"
    assert resolve_strategy("dispatch")[0] == "dispatch"
    assert resolve_loop_strategy("host")[0] == "host"


@ALL
def test_hip_names_the_emulation_and_the_source(release):
    _, backend, _ = release
    reason = resolve_strategy("auto")[1]
    if backend == "hip":
        assert "per-branch dispatch" in reason and "HIP has no conditional graph nodes" in reason
        with pytest.raises(RuntimeError, match="strategy='native' needs CUDA conditional nodes"):
            resolve_strategy("native")


@ALL
def test_exec_update(release, caplog):
    key, backend, text = release
    rt = _fake_runtime(backend, text)
    exe = Graph.create(runtime=rt).instantiate()
    with caplog.at_level(logging.INFO, logger="gfxgraph"):
        exe, res = apply_update(exe, Graph.create(runtime=rt))
    if EXPECTED[key][2]:
        assert res.method == "exec_update" and rt.calls.count("exec_update") == 1
    else:
        assert res.method == "reinstantiate" and "exec_update" not in rt.calls
        assert "rocm-systems/pull/10714" in res.reason and "rocm-systems/pull/11434" in res.reason
        assert f"not used on ROCm {text}" in res.reason
        assert "re-instantiating executable graphs instead of updating them" in caplog.text  # once, at INFO
    exe, res = apply_update(exe, Graph.create(runtime=rt), strategy="reinstantiate")  # forced: everywhere
    assert res.method == "reinstantiate" and "requested" in res.reason


@ALL
def test_hot_swap(release):
    key, backend, text = release
    rt = _fake_runtime(backend, text)
    comp = GraphCompositor(runtime=rt, upload=False)
    comp.add("a", Graph.create(runtime=rt))
    comp.add("b", Graph.create(runtime=rt), after=["a"])
    comp.instantiate(stream=1)
    result = comp.replace("b", Graph.create(runtime=rt))
    if EXPECTED[key][3]:
        assert result.method == "set_params" and "set_child" in rt.calls
    else:
        assert result.method == "reinstantiate" and "set_child" not in rt.calls
        assert "rocm-systems/pull/11434" in result.reason
    assert GraphCompositor(runtime=rt, swap="reinstantiate")._swap == "reinstantiate"


class _StubGraph(capture_mod.OriginalCUDAGraph):
    """An instance of PyTorch's graph class on a CPU-only build (whose base cannot be built)."""

    def __new__(cls):
        return object.__new__(cls)

    def __init__(self):
        pass


@ALL
def test_capture_status_checks(release):
    key, _, _ = release
    assert runtime_checks_capture() is not EXPECTED[key][4]
    assert capture_mod.GraphCapture(_StubGraph())._check_status is EXPECTED[key][4]
    assert capture_mod.GraphCapture(_StubGraph(), check_capture_status=True)._check_status  # forcible


@ALL
def test_supergraph_waits_before_toggling_where_not_documented_safe(release):
    _, backend, text = release
    caps = capabilities_of(_fake_runtime(backend, text))
    assert caps.toggle_in_flight is (backend == "cuda")


@ALL
def test_doctor_warnings(release):
    key, _, _ = release
    caps = current_capabilities()
    caps = capabilities_for(caps.backend, caps.version, arch="gfx942" if caps.backend == "hip" else "sm_90",
                            version_source=caps.version_source)
    found = {_ISSUE_URLS[issue.source] for issue, _ in caps.issues}
    assert found == EXPECTED[key][5]
    text = "\n".join(capability_lines(caps))
    for capability in CAPABILITIES:
        assert capability in text
    if "ROCm/clr#279" in found:
        assert "enable(validate=True)" in text and "WARNING" in text


# ------------------------------------------------------------- capture status
class TestCaptureStatus:
    def test_reason_only_when_not_active(self):
        assert capture_lost_reason(1, "x") is None and capture_lost_reason(None, "x") is None
        why = capture_lost_reason(2, "of stream 0x1 at capture_end")
        assert "invalidated" in why and "pytorch/pull/187110" in why
        assert "not capturing" in capture_lost_reason(0, "x")

    def test_lost_capture_is_discarded_and_raised(self, monkeypatch):
        cap = capture_mod.GraphCapture(_StubGraph(), check_capture_status=True)
        cap.stream = type("S", (), {"cuda_stream": 0x42})()
        discarded = []
        monkeypatch.setattr(capture_mod, "runtime_capture_status", lambda stream: 2)
        monkeypatch.setattr(cap, "discard", lambda reason, **kw: discarded.append(reason))
        with pytest.raises(GraphCaptureError, match="invalidated without having raised an error"):
            cap._require_active("at capture_end")
        assert len(discarded) == 1 and "0x42" in discarded[0]
        monkeypatch.setattr(capture_mod, "runtime_capture_status", lambda stream: 1)
        cap._require_active("at capture_end")  # active: nothing happens
        assert len(discarded) == 1


# ------------------------------------------------------------ supergraph nodes
class TestSupergraphNodes:
    class _Typed:
        prefix = "hip"

        def __init__(self, types):
            self._types = types

        def node_type(self, n):
            return self._types[n]

    def test_toggles_only_what_the_table_allows(self):
        rt = self._Typed({1: NODE_KERNEL, 2: NODE_MEMCPY, 3: 5, 4: NODE_MEMSET})  # 5: empty
        toggled = capabilities_for("hip", Version(7, 2, 2)).toggle_node_types
        assert strategies._toggled_nodes(rt, [1, 2, 3, 4], toggled) == [1, 2, 4]

    def test_refuses_a_node_it_could_not_disable(self):
        rt = self._Typed({1: NODE_KERNEL, 2: 4})  # 4: a host node
        with pytest.raises(strategies.StrategyUnavailable, match="hipGraphNodeSetEnabled can only disable"):
            strategies._toggled_nodes(rt, [1, 2], capabilities_for("hip", None).toggle_node_types)


def test_cpu_only_process_has_no_row():
    if torch.version.cuda or getattr(torch.version, "hip", None):
        pytest.skip("this PyTorch has a GPU build")
    forget_detected_versions()
    assert current_capabilities() is None
    assert capability_report()["lines"] == ["capabilities: none (CPU-only PyTorch: every graph path runs "
                                            "eagerly)"]
