"""Device-side launch without a GPU: where it is refused and why, the launcher's source, finding libcudadevrt."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import gfxgraph
from hipgraph_bridge.bucketing import device_sized as ds
from hipgraph_bridge.compose.device_launch import status_message
from hipgraph_bridge.errors import GraphsUnavailableError
from hipgraph_bridge.runtime import device_launch as dl
from hipgraph_bridge.runtime._base import RuntimeCaps


class _Rt:
    """Just what device_launch_unavailable_reason reads of a runtime."""

    def __init__(self, name: str, runtime: int = 13000, driver: int = 13000) -> None:
        self.name = name
        self.capabilities = RuntimeCaps(runtime_version=runtime, driver_version=driver, exec_update=True,
                                        child_graph_update=True, upload=True, device_launch=name == "cuda",
                                        device_launch_reason="")


def test_hip_is_refused_with_the_tracker_issue():
    why = dl.device_launch_unavailable_reason(_Rt("hip"))
    assert "ROCm/hip#3160" in why and "host path" in why


@pytest.mark.parametrize("runtime,driver", [(11080, 13000), (13000, 11080)])
def test_cuda_before_12_is_refused_with_both_versions(runtime, driver):
    why = dl.device_launch_unavailable_reason(_Rt("cuda", runtime, driver))
    assert "CUDA 12.0" in why and str(runtime) in why and str(driver) in why


def test_no_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(dl.torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA GPU" in dl.device_launch_unavailable_reason(_Rt("cuda"))


def test_missing_compilers_are_named(monkeypatch):
    monkeypatch.setattr(dl.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dl, "nvrtc_unavailable_reason", lambda: "libnvrtc could not be loaded")
    assert "NVRTC and nvJitLink: libnvrtc could not be loaded" in dl.device_launch_unavailable_reason(_Rt("cuda"))


def test_missing_devrt_says_what_to_install(monkeypatch):
    monkeypatch.setattr(dl.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dl, "nvrtc_unavailable_reason", lambda: None)
    monkeypatch.setattr(dl, "nvjitlink_unavailable_reason", lambda: None)
    monkeypatch.setattr(dl, "find_cudadevrt", lambda: None)
    why = dl.device_launch_unavailable_reason(_Rt("cuda"))
    assert "libcudadevrt.a" in why and "nvidia-cuda-runtime" in why and "CUDA_HOME" in why


def test_everything_present_means_no_reason(monkeypatch):
    monkeypatch.setattr(dl.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dl, "nvrtc_unavailable_reason", lambda: None)
    monkeypatch.setattr(dl, "nvjitlink_unavailable_reason", lambda: None)
    monkeypatch.setattr(dl, "find_cudadevrt", lambda: "/x/libcudadevrt.a")
    assert dl.device_launch_unavailable_reason(_Rt("cuda")) is None


def test_devrt_found_in_an_nvidia_wheel_folder(tmp_path, monkeypatch):
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudadevrt.a").write_bytes(b"!<arch>\n")
    (tmp_path / "nvidia" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "nvidia", raising=False)
    monkeypatch.setitem(__import__("sys").modules, "cuda.pathfinder", None)  # not installed: the wheels are looked at
    assert dl.find_cudadevrt() == os.path.join(str(tmp_path / "nvidia"), "cu13/lib", "libcudadevrt.a")


def test_launcher_source_tail_launches_and_keeps_the_first_error():
    src = dl.LAUNCHER_SOURCE
    assert src.count(", cudaStreamGraphTailLaunch)") == 2 and "atomicCAS(status, 0, code)" in src
    # an n outside the buckets launches the zero-fill graph (slot count) and says so
    assert "execs[pick]" in src and "gfxgraph_note(status, -1)" in src and dl.OUT_OF_RANGE == -1


def test_status_messages():
    assert "outside [1, 64]" in status_message(dl.OUT_OF_RANGE, largest=64)
    assert "cudaError_t 1" in status_message(1)


def test_launchers_compile_and_link_against_the_device_runtime():
    """NVRTC and nvJitLink need no GPU: where they and libcudadevrt.a are installed, the launchers build."""
    from hipgraph_bridge.runtime import jit

    why = jit.nvrtc_unavailable_reason() or jit.nvjitlink_unavailable_reason()
    devrt = dl.find_cudadevrt()
    if why or devrt is None:
        pytest.skip(f"NVRTC/nvJitLink/libcudadevrt not installed here: {why or 'no libcudadevrt.a'}")
    images = dict(jit.compile_source(dl.LAUNCHER_SOURCE, 90, name="l.cu", options=("--relocatable-device-code=true",)))
    linked = jit.link_cubin(images["cubin sm_90"], 90, libraries=(devrt,))
    assert linked[:4] == b"\x7fELF" and len(linked) > len(images["cubin sm_90"])  # the device runtime is in


def test_health_check_and_doctor_say_whether_device_launch_is_there():
    import gfxgraph
    from hipgraph_bridge import health

    report = gfxgraph.health_check()
    ok, detail = health.device_launch_available()
    assert report["device_launch"] is ok
    assert f"device-side graph launch: {detail}" in report["details"]
    if not ok:
        assert detail  # a reason, never an empty line


# ------------------------------------------------------------ device-sized pool calls: when the host path is taken


def test_device_sized_needs_a_gpu_and_says_so():
    pool = gfxgraph.ShapeBucketPool(lambda x: x * 2, [2, 4], progress=False)
    with pytest.raises(GraphsUnavailableError, match="ShapeBucketPool.device_sized needs a CUDA or ROCm GPU"):
        pool.device_sized(torch.ones(4, 3))


def _call(*, keys=None, entries=None, process_group=None, outputs=None, buckets=(2, 4)):
    """A DeviceSizedCall shell over a stub pool: just what _why_host reads."""
    graph = object()
    if entries is None:
        entries = {(b, ()): SimpleNamespace(graph=graph) for b in buckets}
    pool = SimpleNamespace(options=SimpleNamespace(process_group=process_group), buckets=list(buckets),
                           failed_buckets={}, _engine=SimpleNamespace(
                               keys={(): SimpleNamespace(decided=True, refusal=None)} if keys is None else keys,
                               entries=entries))
    call = ds.DeviceSizedCall.__new__(ds.DeviceSizedCall)
    call._pool, call._bd, call.capacity = pool, 0, buckets[-1]
    call._outputs = [torch.zeros(buckets[-1], 3)] if outputs is None else outputs
    return call


@pytest.fixture
def launch_ok(monkeypatch):
    monkeypatch.setattr(ds, "current_runtime", lambda: object())
    monkeypatch.setattr(ds, "device_launch_unavailable_reason", lambda rt: None)


def test_a_padded_pool_with_every_bucket_graphed_goes_to_the_device(launch_ok):
    assert _call()._why_host() is None


def test_no_device_launch_gives_its_reason(monkeypatch):
    monkeypatch.setattr(ds, "current_runtime", lambda: object())
    monkeypatch.setattr(ds, "device_launch_unavailable_reason", lambda rt: "HIP has no device-side graph launch")
    assert _call()._why_host() == "HIP has no device-side graph launch"


def test_no_runtime_binding_is_a_reason_not_a_crash(monkeypatch):
    def boom():
        raise RuntimeError("no binding loads")

    monkeypatch.setattr(ds, "current_runtime", boom)
    assert "no binding loads" in _call()._why_host()


def test_multi_rank_pools_stay_on_the_host(launch_ok):
    assert "ranks" in _call(process_group=object())._why_host()


def test_undecided_or_unpadded_models_stay_on_the_host(launch_ok):
    assert "not decided" in _call(keys={})._why_host()
    refused = {(): SimpleNamespace(decided=True, refusal="rows are coupled: x.mean(0)")}
    assert "does not pad this model: rows are coupled" in _call(keys=refused)._why_host()


def test_a_bucket_without_a_graph_keeps_the_host_path(launch_ok):
    entries = {(2, ()): SimpleNamespace(graph=None), (4, ()): SimpleNamespace(graph=object())}
    assert "buckets [2] have no graph" in _call(entries=entries)._why_host()


def test_outputs_without_the_batch_keep_the_host_path(launch_ok):
    assert "output 1 does not carry the batch" in _call(outputs=[torch.zeros(4, 3), torch.zeros(3)])._why_host()
    assert "output 0 does not carry the batch" in _call(outputs=[torch.zeros(2, 3)])._why_host()
