"""CPU tests of the runtime layer: backend selection, error translation, symbols, GFXGRAPH_LIB.

They pass on a CPU-only machine without cuda-bindings (those tests skip), and
on a GPU machine (no test relies on the absence of a driver).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import pytest
import torch

import hipgraph_bridge
from hipgraph_bridge.errors import ConfigError
from hipgraph_bridge.errors import GraphRuntimeError, GraphsUnavailableError
from hipgraph_bridge.runtime import Runtime, _select, get_runtime, reset_runtime_cache
from hipgraph_bridge.runtime._ctypes import CtypesRuntime, bound_symbols
from hipgraph_bridge.runtime._library import LIBRARY_STEMS, _loaded_libraries, find_runtime_library

SYMBOLS_FILE = Path(hipgraph_bridge.__file__).parent / "runtime" / "hip_api_symbols.txt"


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.delenv("GFXGRAPH_LIB", raising=False)
    monkeypatch.delenv("GFXGRAPH_RUNTIME", raising=False)
    reset_runtime_cache()
    yield
    reset_runtime_cache()


def _set_build(monkeypatch, *, cuda=None, hip=None):
    monkeypatch.setattr(torch.version, "cuda", cuda, raising=False)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)


class _Marker(Runtime):
    """Stands in for a backend in selection tests; records how it was made."""

    def __init__(self, kind, *args):
        self.kind = kind
        self.name = "hip" if "hip" in args else "cuda"
        self.prefix = self.name
        self.binding = f"marker {kind}"
        self.args = args


def _libcudart():
    """A loadable libcudart, or skip."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    pytest.skip("no libcudart loadable on this machine")


def _libc_path() -> str:
    for path in _loaded_libraries("libc.so"):
        if os.path.isfile(path):
            return path
    pytest.skip("cannot locate libc through /proc/self/maps")


# ---------------------------------------------------------------- selection
class TestSelection:
    @pytest.fixture
    def fake_backends(self, monkeypatch):
        made = []

        def cuda_bindings():
            made.append(("cuda-bindings",))
            return _Marker("cuda-bindings")

        def ctypes_(api, lib):
            made.append(("ctypes", api, lib))
            return _Marker("ctypes", api, lib)

        monkeypatch.setattr(_select, "CudaBindingsRuntime", cuda_bindings)
        monkeypatch.setattr(_select, "_ctypes", ctypes_)
        return made

    def test_cpu_only_build_is_unavailable_with_install_hint(self, monkeypatch, fake_backends):
        _set_build(monkeypatch)
        with pytest.raises(GraphsUnavailableError, match=r"gfxgraph\[cuda\]"):
            get_runtime()
        assert fake_backends == []

    def test_rocm_build_selects_hip_ctypes(self, monkeypatch, fake_backends):
        _set_build(monkeypatch, hip="6.2.41133")
        rt = get_runtime()
        assert rt.kind == "ctypes" and rt.name == "hip"
        assert fake_backends == [("ctypes", "hip", None)]

    def test_cuda_build_prefers_cuda_bindings(self, monkeypatch, fake_backends):
        _set_build(monkeypatch, cuda="13.0")
        assert get_runtime().kind == "cuda-bindings"

    def test_cuda_build_falls_back_to_ctypes_and_logs(self, monkeypatch, fake_backends, caplog):
        _set_build(monkeypatch, cuda="13.0")

        def missing():
            raise ImportError("no module named cuda.bindings")

        monkeypatch.setattr(_select, "CudaBindingsRuntime", missing)
        from hipgraph_bridge.log import forget_logged

        forget_logged()
        with caplog.at_level(logging.INFO, logger="gfxgraph"):
            rt = get_runtime()
        assert rt.kind == "ctypes"
        assert "cuda-bindings is not installed" in caplog.text
        assert "gfxgraph[cuda]" in caplog.text

    def test_cuda_build_without_any_binding_names_the_extra(self, monkeypatch):
        _set_build(monkeypatch, cuda="13.0")

        def missing():
            raise ImportError("the CUDA runtime binding is not installed: pip install "
                              "'gfxgraph[cuda]' (cuda-bindings>=12.8)")

        def no_lib(api, lib):
            raise GraphsUnavailableError("could not find the CUDA runtime library")

        monkeypatch.setattr(_select, "CudaBindingsRuntime", missing)
        monkeypatch.setattr(_select, "_ctypes", no_lib)
        with pytest.raises(GraphsUnavailableError, match=r"pip install 'gfxgraph\[cuda\]'"):
            get_runtime()

    def test_forced_ctypes_on_cuda_build(self, monkeypatch, fake_backends):
        _set_build(monkeypatch, cuda="13.0")
        monkeypatch.setenv("GFXGRAPH_RUNTIME", "ctypes")
        assert get_runtime().kind == "ctypes"
        assert fake_backends == [("ctypes", "cuda", None)]

    def test_forced_kind_argument_beats_environment(self, monkeypatch, fake_backends):
        _set_build(monkeypatch, cuda="13.0")
        monkeypatch.setenv("GFXGRAPH_RUNTIME", "ctypes")
        assert get_runtime("cuda-bindings").kind == "cuda-bindings"

    def test_gfxgraph_lib_selects_ctypes_over_that_library(self, monkeypatch, tmp_path,
                                                          fake_backends):
        _set_build(monkeypatch, cuda="13.0")
        lib = tmp_path / "libcudart.so.13"
        lib.write_bytes(b"\x7fELF")
        monkeypatch.setenv("GFXGRAPH_LIB", str(lib))
        assert get_runtime().kind == "ctypes"
        assert fake_backends == [("ctypes", "cuda", str(lib))]

    def test_bad_runtime_kind_names_accepted_values(self, monkeypatch):
        monkeypatch.setenv("GFXGRAPH_RUNTIME", "cupy")
        with pytest.raises(ConfigError, match="GFXGRAPH_RUNTIME='cupy'.*auto, cuda-bindings, ctypes"):
            get_runtime()
        with pytest.raises(ValueError, match="kind: expected one of"):
            get_runtime("nccl")

    def test_runtime_is_cached_until_reset(self, monkeypatch, fake_backends):
        _set_build(monkeypatch, hip="6.2")
        assert get_runtime() is get_runtime()
        assert len(fake_backends) == 1
        reset_runtime_cache()
        get_runtime()
        assert len(fake_backends) == 2

    def test_failures_are_not_cached(self, monkeypatch, fake_backends):
        _set_build(monkeypatch)
        with pytest.raises(GraphsUnavailableError):
            get_runtime()
        _set_build(monkeypatch, hip="6.2")
        assert get_runtime().name == "hip"

    def test_resolve_runtime_rejects_other_types(self):
        with pytest.raises(TypeError, match="runtime: expected None, a Runtime"):
            _select.resolve_runtime(3)

    def test_health_reports_native_bridge_false_with_reason(self, monkeypatch):
        _set_build(monkeypatch)
        from hipgraph_bridge.health import native_bridge_available

        ok, why = native_bridge_available()
        assert ok is False
        assert "CPU-only" in why


# ---------------------------------------------------------- error translation
class TestCudaBindingsErrors:
    @pytest.fixture
    def rt(self):
        pytest.importorskip("cuda.bindings")
        return get_runtime("cuda-bindings")

    def test_binding_description(self, rt):
        assert rt.name == "cuda" and rt.kind == "cuda-bindings"
        assert rt.binding.startswith("cuda-bindings ")
        assert rt.capabilities.runtime_version >= 12000

    def test_failure_carries_runtime_name_and_message(self, rt):
        with pytest.raises(GraphRuntimeError) as info:
            rt.graph_instantiate(0)  # NULL graph: fails with or without a driver
        err = info.value
        assert err.call == "cudaGraphInstantiateWithFlags"
        assert err.name.startswith("cudaError") and err.explanation
        assert err.name in str(err) and err.explanation in str(err)
        if rt.capabilities.driver_version == 0:  # this CPU machine: no driver
            assert err.name == "cudaErrorInsufficientDriver"
            assert err.code == 35
            assert "driver" in err.explanation

    def test_error_name_of_unknown_code_does_not_raise(self, rt):
        assert rt._error_name(123456).startswith("cuda")

    def test_end_capture_and_discard_surfaces_errors(self, rt):
        if rt.capabilities.driver_version:
            pytest.skip("needs a machine without a CUDA driver")
        with pytest.raises(GraphRuntimeError, match="cudaStreamIsCapturing"):
            rt.end_capture_and_discard(0x1234)


class TestCtypesCudaErrors:
    def test_real_libcudart_translates_errors(self):
        path = _libcudart()
        rt = CtypesRuntime.open(path)
        assert rt.name == "cuda" and rt.kind == "ctypes"
        with pytest.raises(GraphRuntimeError) as info:
            rt.graph_instantiate(0)
        assert info.value.call == "cudaGraphInstantiateWithFlags"
        assert info.value.name.startswith("cudaError")
        if rt.capabilities.driver_version == 0:
            assert info.value.name == "cudaErrorInsufficientDriver"
            assert info.value.code == 35

    def test_every_cuda_symbol_bound_is_exported(self):
        lib = ctypes.CDLL(_libcudart())
        missing = [s for s in bound_symbols("cuda") if not hasattr(lib, s)]
        assert missing == []


# --------------------------------------------------------------- HIP symbols
def _documented_hip_symbols() -> set[str]:
    names = set()
    for line in SYMBOLS_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(line)
    return names


def test_hip_symbol_table_is_shipped_and_well_formed():
    names = _documented_hip_symbols()
    assert len(names) > 20
    assert all(n.startswith("hip") and n.isidentifier() for n in names)


def test_every_symbol_the_hip_backend_binds_is_documented():
    bound = bound_symbols("hip")
    undocumented = sorted(set(bound) - _documented_hip_symbols())
    assert undocumented == [], f"not in hip_api_symbols.txt: {undocumented}"
    assert "hipGraphExecUpdate" in bound and "hipGraphLaunch" in bound


def test_hip_and_cuda_bind_the_same_entry_points():
    assert [s[3:] for s in bound_symbols("hip")] == [s[4:] for s in bound_symbols("cuda")]


# ---------------------------------------------------------------- GFXGRAPH_LIB
class TestRuntimeLib:
    def test_non_file_path_is_a_config_error(self, monkeypatch, tmp_path):
        monkeypatch.setenv("GFXGRAPH_LIB", str(tmp_path / "missing.so"))
        with pytest.raises(ConfigError, match="GFXGRAPH_LIB=.*regular file"):
            get_runtime()
        monkeypatch.setenv("GFXGRAPH_LIB", str(tmp_path))  # a directory
        with pytest.raises(ConfigError, match="GFXGRAPH_LIB"):
            get_runtime("ctypes")

    def test_file_that_is_not_a_library_is_a_clear_error(self, monkeypatch, tmp_path):
        bogus = tmp_path / "libcudart.so.13"
        bogus.write_text("not a shared object\n")
        monkeypatch.setenv("GFXGRAPH_LIB", str(bogus))
        with pytest.raises(ConfigError, match="expected a loadable shared library"):
            get_runtime()

    def test_library_without_runtime_symbols_is_a_clear_error(self, monkeypatch):
        monkeypatch.setenv("GFXGRAPH_LIB", _libc_path())
        with pytest.raises(ConfigError, match="exports neither"):
            get_runtime("ctypes")

    def test_real_runtime_through_gfxgraph_lib(self, monkeypatch):
        name = _libcudart()
        paths = [p for p in _loaded_libraries(LIBRARY_STEMS["cuda"]) if os.path.isfile(p)]
        if not paths:
            pytest.skip(f"{name} loaded but its path is not visible")
        monkeypatch.setenv("GFXGRAPH_LIB", paths[0])
        rt = get_runtime()
        assert rt.kind == "ctypes" and rt.name == "cuda"
        assert rt.path == paths[0]

    def test_explicit_library_wins_discovery(self):
        assert find_runtime_library("hip", explicit="/x/libamdhip64.so") == "/x/libamdhip64.so"

    def test_discovery_failure_names_the_variable(self, monkeypatch):
        from hipgraph_bridge.runtime import _library as mod

        monkeypatch.setattr(mod, "_loaded_libraries", lambda stem: [])
        monkeypatch.setattr(mod, "_SONAMES", {"hip": ("libamdhip64.so.999",)})
        with pytest.raises(GraphsUnavailableError, match="GFXGRAPH_LIB=/path/to/libamdhip64.so"):
            find_runtime_library("hip")


# ------------------------------------------------- HIP flavour, via a fake library
class _FakeHipLib:
    """``hip*`` entry points as real C callbacks, so the ctypes backend marshals real calls.

    Only what the tests below exercise does anything; every other entry point
    returns hipSuccess.
    """

    NAMES = {100: "hipErrorNoDevice", 600: "hipErrorNotReady",
             901: "hipErrorStreamCaptureInvalidated", 910: "hipErrorGraphExecUpdateFailure"}

    def __init__(self, *, skip=(), graph_create_status=0, update_status=0, update_result=0):
        from hipgraph_bridge.runtime._ctypes import _signatures

        self.graph_create_status = graph_create_status
        self.update_status = update_status
        self.update_result = update_result
        self.clears = 0
        self.calls: list[str] = []
        self._strings: dict[str, ctypes.Array] = {}
        self._keep = []
        for suffix, (restype, argtypes, _required) in _signatures("hip").items():
            if suffix in skip:
                continue
            cb_restype = ctypes.c_void_p if restype is ctypes.c_char_p else restype
            impl = getattr(self, "_" + suffix, None)
            fn = ctypes.CFUNCTYPE(cb_restype, *argtypes)(self._wrap(suffix, impl))
            self._keep.append(fn)
            setattr(self, "hip" + suffix, fn)

    def _wrap(self, suffix, impl):
        def call(*args):
            self.calls.append(suffix)
            return 0 if impl is None else impl(*args)
        return call

    def _cstr(self, text: str) -> int:
        buf = self._strings.setdefault(text, ctypes.create_string_buffer(text.encode()))
        return ctypes.addressof(buf)

    def _GetErrorName(self, code):
        return self._cstr(self.NAMES.get(code, "hipErrorUnknown"))

    def _GetErrorString(self, code):
        return self._cstr(f"fake hip error {code}")

    def _GetLastError(self):
        self.clears += 1
        return 0

    def _RuntimeGetVersion(self, out):
        out[0] = 60241
        return 0

    def _GraphCreate(self, out, flags):
        if self.graph_create_status == 0:
            out[0] = 0x1000
        return self.graph_create_status

    def _GraphExecUpdate(self, exec_, graph, error_node, result):
        result[0] = self.update_result
        return self.update_status

    def _EventQuery(self, event):
        return 600

    def _StreamIsCapturing(self, stream, status):
        status[0] = 2  # invalidated
        return 0

    def _StreamEndCapture(self, stream, out):
        return 901


class TestHipFlavour:
    def test_success_and_version(self):
        fake = _FakeHipLib()
        rt = CtypesRuntime(fake, "hip", path="libamdhip64.so.6")
        assert (rt.name, rt.prefix, rt.binding) == ("hip", "hip", "ctypes libamdhip64.so.6")
        assert rt.graph_create() == 0x1000
        assert rt.capabilities.runtime_version == 60241

    def test_failure_carries_hip_name_and_clears_last_error(self):
        fake = _FakeHipLib(graph_create_status=100)
        rt = CtypesRuntime(fake, "hip")
        with pytest.raises(GraphRuntimeError) as info:
            rt.graph_create()
        err = info.value
        assert (err.call, err.name, err.code) == ("hipGraphCreate", "hipErrorNoDevice", 100)
        assert err.explanation == "fake hip error 100"
        assert fake.clears == 1  # PyTorch's next launch check must not see our error

    def test_exec_update_uses_the_hip_out_pointers(self):
        fake = _FakeHipLib(update_status=910, update_result=2)
        outcome = CtypesRuntime(fake, "hip").exec_update(0x10, 0x20)
        assert outcome.ok is False
        assert outcome.result == "hipGraphExecUpdateErrorTopologyChanged"
        assert outcome.error == "hipErrorGraphExecUpdateFailure"
        assert fake.clears == 1

    def test_exec_update_success(self):
        outcome = CtypesRuntime(_FakeHipLib(), "hip").exec_update(0x10, 0x20)
        assert outcome.ok and outcome.result == "hipGraphExecUpdateSuccess"

    def test_not_ready_and_invalidated_capture_are_not_errors(self):
        fake = _FakeHipLib()
        rt = CtypesRuntime(fake, "hip")
        assert rt.event_query(0x30) is False
        rt.end_capture_and_discard(0x40)  # invalidated: ended, nothing to destroy
        assert fake.calls[-2:] == ["StreamEndCapture", "GetLastError"]
        assert "GraphDestroy" not in fake.calls

    def test_missing_required_symbol_is_named(self):
        with pytest.raises(GraphsUnavailableError, match="hipGraphAddChildGraphNode"):
            CtypesRuntime(_FakeHipLib(skip={"GraphAddChildGraphNode"}), "hip")

    def test_missing_optional_symbol_turns_the_capability_off(self):
        rt = CtypesRuntime(_FakeHipLib(skip={"GraphExecChildGraphNodeSetParams"}), "hip")
        assert rt.capabilities.child_graph_update is False
        assert rt.capabilities.exec_update is True
        with pytest.raises(GraphsUnavailableError, match="hipGraphExecChildGraphNodeSetParams"):
            rt.exec_set_child(1, 2, 3)


def test_discovery_prefers_the_copy_matching_torchs_runtime(monkeypatch):
    from hipgraph_bridge.runtime import _library as mod

    monkeypatch.setattr(torch.version, "cuda", "13.0", raising=False)
    monkeypatch.setattr(mod, "_loaded_libraries",
                        lambda stem: ["/opt/x/libcudart.so.12", "/site/nvidia/cu13/lib/libcudart.so.13"])
    assert find_runtime_library("cuda") == "/site/nvidia/cu13/lib/libcudart.so.13"
