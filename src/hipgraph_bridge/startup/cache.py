"""Warm starts through PyTorch's own compile caches: save what this process compiled, load it in the next.

``torch.compile`` already keeps inductor's FX graph cache and the AOTAutograd
cache on local disk (under ``TORCHINDUCTOR_CACHE_DIR``), so a second process
on the same machine skips inductor's compile of a graph it has seen. For a
new machine (or a fresh container) PyTorch packs those entries, with
autotuning results, into one portable blob
(``torch.compiler.save_cache_artifacts``). :func:`save` writes that blob to a
file after a warm-up; :func:`load` hot-loads it before the first compile.
gfxgraph keeps no kernel cache of its own: what is cached, and when an entry
is reused, is PyTorch's (its keys cover the graph, the torch version, the
device and inductor's configuration). Dynamo still traces the Python in the
new process; graph capture is not cached (graphs hold device addresses).

:func:`hits` reads the caches' hit and miss counters of this process: after
a warm start the FX graph misses stay at 0.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .._torch_compat import compile_cache_counters, has_cache_artifacts, load_cache_artifacts, save_cache_artifacts
from ..log import logger

__all__ = ["save", "load", "hits", "supported", "write_whole"]


def supported() -> bool:
    """Whether this torch can save and load the portable cache blob (torch >= 2.7)."""
    return has_cache_artifacts


def save(path: str | os.PathLike[str]) -> dict[str, int]:
    """Write what this process compiled to ``path`` (PyTorch's portable cache blob).

    Call it after the warm-up, in the process that compiled. Returns how many
    entries of each kind were written (``{"inductor": 3, "aot_autograd": 3, ...}``).
    Raises ``RuntimeError`` when this process compiled nothing (there is nothing
    to save), ``NotImplementedError`` on a torch before 2.7. The file is written
    whole or not at all (a temporary file, then a rename).
    """
    got = save_cache_artifacts()
    if got is None:
        raise RuntimeError("gfxgraph.cache.save: this process compiled nothing with torch.compile, so "
                           "there is nothing to save; call it after the warm-up, in the same process")
    blob, info = got
    target = write_whole(path, blob)
    counts = _counts(info)
    logger.info("gfxgraph: saved compile cache to %s (%d bytes; %s)", target, len(blob), counts)
    return counts


def write_whole(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all: a unique temporary file beside it, then a rename,
    so concurrent saves never mix and a failed one leaves nothing. Returns the path."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load(path: str | os.PathLike[str]) -> dict[str, int]:
    """Hot-load a blob :func:`save` wrote, before the first compile of this process.

    Returns how many entries of each kind were loaded. Raises ``FileNotFoundError``
    for a missing file and ``NotImplementedError`` on a torch before 2.7. Entries
    made by another torch version or for another device are loaded but never hit
    (PyTorch's keys include both), so a stale file costs a cold compile, not an error.
    """
    blob = Path(path).read_bytes()
    counts = _counts(load_cache_artifacts(blob))
    logger.info("gfxgraph: loaded compile cache from %s (%s)", path, counts)
    return counts


def hits() -> dict[str, int]:
    """This process's hits and misses of inductor's FX graph cache and the AOTAutograd cache."""
    return compile_cache_counters()


def _counts(info: Any) -> dict[str, int]:
    """Entries per kind in torch's CacheInfo (its ``*_artifacts`` lists)."""
    if info is None:
        return {}
    out: dict[str, int] = {}
    for name in dir(info):
        if name.endswith("_artifacts") and not name.startswith("_"):
            value = getattr(info, name)
            if isinstance(value, (list, tuple)):
                out[name[: -len("_artifacts")]] = len(value)
    return out
