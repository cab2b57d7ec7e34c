"""enable()/disable(): idempotent, thread-safe, exact restore; GFXGRAPH at import."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.cuda.graphs

import gfxgraph
from conftest import SRC
from gfxgraph import BridgedCUDAGraph
from hipgraph_bridge import OriginalCUDAGraph


def test_enable_swaps_and_disable_restores_exact_objects():
    before = (torch.cuda.CUDAGraph, torch.cuda.graphs.CUDAGraph)
    assert not gfxgraph.is_enabled()
    gfxgraph.enable()
    assert gfxgraph.is_enabled()
    assert torch.cuda.CUDAGraph is BridgedCUDAGraph
    assert torch.cuda.graphs.CUDAGraph is BridgedCUDAGraph
    gfxgraph.disable()
    assert (torch.cuda.CUDAGraph, torch.cuda.graphs.CUDAGraph) == before
    assert torch.cuda.CUDAGraph is before[0] and torch.cuda.graphs.CUDAGraph is before[1]
    assert not gfxgraph.is_enabled()


def test_enable_and_disable_are_idempotent():
    original = torch.cuda.CUDAGraph
    gfxgraph.enable()
    gfxgraph.enable()
    assert torch.cuda.CUDAGraph is BridgedCUDAGraph
    gfxgraph.disable()
    assert torch.cuda.CUDAGraph is original
    gfxgraph.disable()
    assert torch.cuda.CUDAGraph is original


def test_bridged_graph_is_a_cuda_graph_subclass():
    assert issubclass(BridgedCUDAGraph, OriginalCUDAGraph)
    assert OriginalCUDAGraph is torch.cuda.graphs.CUDAGraph  # captured before any patch
    g = BridgedCUDAGraph()
    assert isinstance(g, torch.cuda.CUDAGraph)
    gfxgraph.enable()
    assert isinstance(torch.cuda.CUDAGraph(), OriginalCUDAGraph)


def test_enable_flags_are_validated_and_updated():
    with pytest.raises(TypeError, match="bools"):
        gfxgraph.enable(debug="yes")  # type: ignore[arg-type]
    gfxgraph.enable(validate=True)
    from hipgraph_bridge import config

    assert config.switches.validate
    gfxgraph.enable()
    assert not config.switches.validate
    assert gfxgraph.stats()["enabled_at"] is not None
    gfxgraph.disable()
    assert gfxgraph.stats()["enabled_at"] is None


def test_enable_disable_thread_safe():
    original = torch.cuda.CUDAGraph
    errors: list[BaseException] = []

    def toggle(n: int) -> None:
        try:
            for i in range(200):
                (gfxgraph.enable if (i + n) % 2 else gfxgraph.disable)()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=toggle, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert torch.cuda.CUDAGraph in (original, BridgedCUDAGraph)
    assert (torch.cuda.CUDAGraph is BridgedCUDAGraph) == gfxgraph.is_enabled()
    gfxgraph.disable()
    assert torch.cuda.CUDAGraph is original


def test_disable_leaves_a_foreign_patch_alone(caplog):
    gfxgraph.enable()

    class Other:  # someone else patched after us
        pass

    torch.cuda.CUDAGraph = Other  # type: ignore[misc]
    try:
        gfxgraph.disable()
        assert torch.cuda.CUDAGraph is Other
        assert "replaced by someone else" in caplog.text
    finally:
        torch.cuda.CUDAGraph = OriginalCUDAGraph  # type: ignore[misc]


def test_importing_hipgraph_bridge_patches_nothing(warm_py):
    r = warm_py("""
        import torch
        before = torch.cuda.CUDAGraph
        import hipgraph_bridge
        assert torch.cuda.CUDAGraph is before
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


@pytest.mark.parametrize("value,enabled,flag", [("1", True, None), ("debug", True, "debug"),
                                                 ("validate", True, "validate"), ("0", False, None)])
def test_gfxgraph_env_auto_enables_at_import(warm_py, value, enabled, flag):
    r = warm_py("""
        import gfxgraph, torch
        from hipgraph_bridge import config
        s = config.switches
        print(gfxgraph.is_enabled(), torch.cuda.CUDAGraph.__name__, s.debug, s.validate)
    """, env={"GFXGRAPH": value})
    assert r.returncode == 0, r.stderr
    is_on, name, debug, validate = r.stdout.split()
    assert is_on == str(enabled)
    assert name == ("BridgedCUDAGraph" if enabled else "CUDAGraph")
    assert debug == str(flag == "debug") and validate == str(flag == "validate")


def test_gfxgraph_env_bad_value_warns_and_stays_off(warm_py):
    r = warm_py("""
        import logging; logging.basicConfig()
        import gfxgraph
        print(gfxgraph.is_enabled())
    """, env={"GFXGRAPH": "sure"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    assert "GFXGRAPH='sure'" in r.stderr and "1, debug, validate, 0" in r.stderr


def test_hgb_log_level_sets_logger_level(warm_py):
    r = warm_py("""
        import logging, gfxgraph
        print(logging.getLogger("gfxgraph").level)
    """, env={"HGB_LOG_LEVEL": "error"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(40)


def test_import_attaches_no_handler_unless_a_level_is_asked_for(warm_py):
    code = """
        import logging, gfxgraph
        print(len(logging.getLogger("gfxgraph").handlers), logging.getLogger("gfxgraph").level)
    """
    r = warm_py(code, env={"GFXGRAPH_LOG_LEVEL": "", "HGB_LOG_LEVEL": "", "GFXGRAPH": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "0"]  # Python's library convention: the application decides
    r = warm_py(code, env={"GFXGRAPH_LOG_LEVEL": "info"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", str(logging.INFO)]



def test_every_source_file_compiles_without_a_warning():
    """An invalid escape sequence is a SyntaxWarning at import on Python 3.12 (DeprecationWarning before);
    compiled here from source, so a cached .pyc cannot hide it."""
    for path in sorted(SRC.rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(encoding="utf-8"), str(path), "exec")


def test_import_prints_no_warning():
    """``python -W error -c "import gfxgraph"``: torch's NumPy warning (numpy is in the test extra the README
    installs) and any warning of gfxgraph's own would be an error."""
    r = subprocess.run([sys.executable, "-W", "error", "-c", "import gfxgraph, numpy"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
