"""Finding the CUDA or HIP runtime library to bind, preferring the copy PyTorch already loaded."""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Literal

import torch

from ..errors import GraphsUnavailableError
from ..platform import torch_build_version

__all__ = ["find_runtime_library", "LIBRARY_STEMS", "Api"]

Api = Literal["cuda", "hip"]

LIBRARY_STEMS: dict[str, str] = {"cuda": "libcudart.so", "hip": "libamdhip64.so"}
_SONAMES: dict[str, tuple[str, ...]] = {
    "cuda": ("libcudart.so.13", "libcudart.so.12", "libcudart.so"),
    "hip": ("libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"),
}


def _loaded_libraries(stem: str, maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of already-mapped shared objects whose file name starts with ``stem``."""
    found: list[str] = []
    try:
        with open(maps_path) as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith(stem) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _torch_runtime_major(api: Api) -> str | None:
    build, version = torch_build_version()
    return version.split(".", 1)[0] if build == api and version else None


def find_runtime_library(api: Api, *, explicit: str | None = None) -> str:
    """Locate the runtime library for ``api``; prefer the copy PyTorch already loaded.

    Order: ``explicit`` (``GFXGRAPH_LIB``), a library already mapped into this
    process, the dynamic loader by soname, PyTorch's own ``lib`` folder, then
    (CUDA) ``cuda.pathfinder`` when installed.

    Raises:
        GraphsUnavailableError: nothing loadable was found; the message says where it looked.
    """
    if explicit:
        return explicit
    stem = LIBRARY_STEMS[api]
    loaded = _loaded_libraries(stem)
    if loaded:
        # Another package may have loaded a second copy: prefer the major version
        # PyTorch was built against (libcudart.so.13 for torch.version.cuda "13.0").
        major = _torch_runtime_major(api)
        loaded.sort(key=lambda p: major is None or f".so.{major}" not in os.path.basename(p))
        return loaded[0]
    errors: list[str] = []
    for soname in _SONAMES[api]:
        try:
            ctypes.CDLL(soname)
            return soname
        except OSError as exc:
            errors.append(str(exc))
    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", stem + "*"))):
        return path
    if api == "cuda":
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib  # optional: comes with cuda-bindings

            return str(load_nvidia_dynamic_lib("cudart").abs_path)
        except Exception as exc:  # absent, or it found nothing
            errors.append(f"cuda.pathfinder: {exc}")
    raise GraphsUnavailableError(
        f"could not find the {api.upper()} runtime library ({stem}*): it is not loaded in this "
        f"process and the dynamic loader did not find {', '.join(_SONAMES[api])}. Set "
        f"GFXGRAPH_LIB=/path/to/{stem}.<version>. Loader said: {'; '.join(errors[-2:])}"
    )


# ------------------------------------------------------------------ backend
