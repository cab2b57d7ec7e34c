"""Where gfxgraph's log records go: stderr by default for warnings, on request for levels,
never twice, and the application's configuration always wins."""

from __future__ import annotations

import logging

import pytest

import gfxgraph
from conftest import GPU_SKIP_REASON
from hipgraph_bridge import log

# Two fallback causes on CPU-only PyTorch (no_gpu) and on any machine (oversize), each hit
# several times. On a GPU machine no_gpu does not happen; the oversize notice always does.
POOL = """
    import torch, gfxgraph
    pool = gfxgraph.ShapeBucketPool(torch.nn.Linear(4, 4), [1, 2], progress=False)
    with torch.no_grad():
        for n in (1, 2, 1, 2, 3, 3, 5):
            pool(torch.randn(n, 4, device="cuda" if torch.cuda.is_available() else "cpu"))
    print("done")
"""
_CLEAN = {"GFXGRAPH_LOG_LEVEL": "", "HGB_LOG_LEVEL": "", "GFXGRAPH": ""}


def test_first_fallback_of_each_cause_reaches_stderr_without_any_configuration(warm_py):
    r = warm_py(POOL, env=_CLEAN)
    assert r.returncode == 0, r.stderr
    # one notice per pool and cause, whatever the batch size (3 and 5 are both above the largest bucket)
    assert r.stderr.count("running eagerly (reason: oversize): batches above the largest bucket 2") == 1
    assert r.stderr.count("reason: oversize") == 1
    if GPU_SKIP_REASON is not None:
        assert r.stderr.count("running eagerly (reason: no_gpu)") == 1


def test_fallback_notices_can_be_silenced_alone(warm_py):
    r = warm_py("import logging; logging.getLogger('gfxgraph.fallback').setLevel(logging.ERROR)\n"
           + POOL.replace("\n    ", "\n"), env=_CLEAN)
    assert r.returncode == 0, r.stderr
    assert "running eagerly" not in r.stderr


def test_application_logging_gets_each_notice_once(warm_py):
    r = warm_py("import logging; logging.basicConfig(format='APP %(name)s %(levelname)s %(message)s')\n"
           + POOL.replace("\n    ", "\n"), env={**_CLEAN, "GFXGRAPH_LOG_LEVEL": "info"})
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "reason: oversize)" in line]
    assert lines == ["APP gfxgraph.fallback WARNING gfxgraph: running eagerly (reason: oversize): "
                     "batches above the largest bucket 2"]


@pytest.mark.parametrize("var", ["GFXGRAPH_LOG_LEVEL", "HGB_LOG_LEVEL"])
def test_level_variable_sends_debug_records_to_stderr(warm_py, var):
    r = warm_py("import gfxgraph; gfxgraph.enable(); print('ok')", env={**_CLEAN, var: "debug"})
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("[DEBUG] gfxgraph enabled (debug=False, validate=False)") == 1


def test_primary_level_variable_wins_over_alias(warm_py):
    r = warm_py("import logging, gfxgraph; print(logging.getLogger('gfxgraph').level)",
           env={**_CLEAN, "GFXGRAPH_LOG_LEVEL": "error", "HGB_LOG_LEVEL": "debug"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(logging.ERROR)


def test_gfxgraph_debug_mode_prints_debug_records(warm_py):
    r = warm_py("import gfxgraph; print(gfxgraph.is_enabled())", env={**_CLEAN, "GFXGRAPH": "debug"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
    assert "[DEBUG] gfxgraph enabled (debug=True, validate=False)" in r.stderr


def test_logging_configured_after_import_is_not_duplicated(warm_py):
    r = warm_py("""
        import logging, gfxgraph
        logging.basicConfig(format="APP %(message)s")
        gfxgraph.enable()
    """, env={**_CLEAN, "GFXGRAPH_LOG_LEVEL": "debug"})
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "gfxgraph enabled" in line]
    assert lines == ["APP gfxgraph enabled (debug=False, validate=False)"]


def test_bad_level_variable_is_visible_without_configuration(warm_py):
    r = warm_py("import gfxgraph", env={**_CLEAN, "GFXGRAPH_LOG_LEVEL": "loud"})
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("GFXGRAPH_LOG_LEVEL='loud' is not understood") == 1


def test_inductor_failure_reaches_stderr_by_default(warm_py):
    r = warm_py("""
        import torch
        from hipgraph_bridge.compile import compiler
        from hipgraph_bridge.compile.options import BackendOptions

        def broken(*args):
            raise RuntimeError("kernel build exploded")

        compiler.compile_fx = broken
        gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        fn, used, why = compiler.compile_graph(gm, [torch.randn(2)], BackendOptions(), on_cpu=False)
        print(used)
    """, env=_CLEAN)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "eager"
    assert "inductor failed on a subgraph (RuntimeError: kernel build exploded)" in r.stderr


# ---------------------------------------------------------------- in process
@pytest.fixture
def no_stderr_handler():
    log.detach_stderr_handler()
    yield
    log.detach_stderr_handler()


def test_enable_debug_attaches_one_handler_and_disable_removes_it(no_stderr_handler):
    logger = logging.getLogger("gfxgraph")
    level = logger.level
    gfxgraph.enable(debug=True)
    gfxgraph.enable(debug=True)
    assert [type(h) for h in logger.handlers].count(log.StderrHandler) == 1
    assert logger.level == logging.DEBUG
    gfxgraph.disable()
    assert not any(isinstance(h, log.StderrHandler) for h in logger.handlers)
    assert logger.level == level


def test_attach_is_idempotent(no_stderr_handler):
    assert log.attach_stderr_handler() is True
    assert log.attach_stderr_handler() is False
    assert logging.getLogger("gfxgraph").handlers.count(log._stderr_handler) == 1


def test_handler_stays_quiet_while_the_application_handles_records(no_stderr_handler, caplog, capsys):
    gfxgraph.enable(debug=True)  # pytest's capture handler on the root logger plays the application
    with caplog.at_level(logging.DEBUG, logger="gfxgraph"):
        logging.getLogger("gfxgraph.fallback").warning("gfxgraph: test notice")
    assert "gfxgraph: test notice" in caplog.text
    assert "test notice" not in capsys.readouterr().err


def test_handler_prints_when_nothing_else_would(no_stderr_handler, monkeypatch, capsys):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # no application configuration (pytest's removed)
    gfxgraph.enable(debug=True)
    logging.getLogger("gfxgraph").debug("gfxgraph: visible %d", 1)
    err = capsys.readouterr().err
    assert err == "[DEBUG] gfxgraph enabled (debug=True, validate=False)\n[DEBUG] gfxgraph: visible 1\n"
