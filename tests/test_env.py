"""Environment variables: every accepted value, and a named warning or error for the rest."""

from __future__ import annotations

import logging

import pytest

from hipgraph_bridge.config import (
    DEFAULT_VRAM_CAP,
    ConfigError,
    check_vram_cap,
    read_enable_mode,
    read_log_level,
    read_runtime_lib,
    read_vram_cap,
)


@pytest.mark.parametrize("raw,mode", [("", "off"), ("0", "off"), ("1", "on"), ("debug", "debug"),
                                      ("DEBUG", "debug"), ("validate", "validate"), (" 1 ", "on")])
def test_enable_mode_values(raw, mode):
    assert read_enable_mode({"GFXGRAPH": raw}) == mode


def test_enable_mode_unset_is_off():
    assert read_enable_mode({}) == "off"


@pytest.mark.parametrize("raw", ["yes", "true", "2", "on"])
def test_enable_mode_bad_value_warns_with_accepted_values(raw, caplog):
    with caplog.at_level(logging.WARNING, logger="gfxgraph"):
        assert read_enable_mode({"GFXGRAPH": raw}) == "off"
    msg = caplog.text
    assert "GFXGRAPH" in msg and repr(raw) in msg
    for accepted in ("1", "debug", "validate", "0"):
        assert accepted in msg


@pytest.mark.parametrize("raw,level", [("debug", logging.DEBUG), ("info", logging.INFO),
                                       ("warn", logging.WARNING), ("ERROR", logging.ERROR)])
def test_log_level(raw, level):
    assert read_log_level({"HGB_LOG_LEVEL": raw}) == level


@pytest.mark.parametrize("name", ["GFXGRAPH_LOG_LEVEL", "HGB_LOG_LEVEL"])
def test_log_level_bad_value_warns(name, caplog):
    with caplog.at_level(logging.WARNING, logger="gfxgraph"):
        assert read_log_level({name: "loud"}) is None
    assert f"{name}='loud'" in caplog.text and "debug, info, warn, error" in caplog.text


def test_log_level_primary_name_and_alias():
    assert read_log_level({"GFXGRAPH_LOG_LEVEL": "info"}) == logging.INFO
    assert read_log_level({"GFXGRAPH_LOG_LEVEL": "info", "HGB_LOG_LEVEL": "error"}) == logging.INFO
    assert read_log_level({"GFXGRAPH_LOG_LEVEL": " ", "HGB_LOG_LEVEL": "error"}) == logging.ERROR
    assert read_log_level({}) is None


def test_bad_primary_log_level_does_not_fall_back_to_alias(caplog):
    with caplog.at_level(logging.WARNING, logger="gfxgraph"):
        assert read_log_level({"GFXGRAPH_LOG_LEVEL": "loud", "HGB_LOG_LEVEL": "debug"}) is None
    assert "GFXGRAPH_LOG_LEVEL='loud'" in caplog.text and "HGB_LOG_LEVEL" not in caplog.text


def test_vram_cap_default_and_values():
    assert read_vram_cap({}) == DEFAULT_VRAM_CAP == 0.90
    assert read_vram_cap({"GFXGRAPH_VRAM_CAP": "0.5"}) == 0.5
    assert read_vram_cap({"GFXGRAPH_VRAM_CAP": "1"}) == 1.0


@pytest.mark.parametrize("raw", ["0", "-0.1", "1.5", "half", "nan"])
def test_vram_cap_bad_value_is_error_naming_variable(raw):
    with pytest.raises(ConfigError, match=r"GFXGRAPH_VRAM_CAP.*\(0\.0, 1\.0\]"):
        read_vram_cap({"GFXGRAPH_VRAM_CAP": raw})


@pytest.mark.parametrize("bad", [0, 1.2, "0.5", True, None])
def test_vram_cap_option_validation(bad):
    with pytest.raises(ConfigError, match="vram_cap"):
        check_vram_cap(bad)


def test_runtime_lib(tmp_path):
    assert read_runtime_lib({}) is None
    f = tmp_path / "libfake.so"
    f.write_bytes(b"")
    assert read_runtime_lib({"GFXGRAPH_LIB": str(f)}) == str(f)
    with pytest.raises(ConfigError, match="GFXGRAPH_LIB.*regular file"):
        read_runtime_lib({"GFXGRAPH_LIB": str(tmp_path)})
    with pytest.raises(ConfigError, match="GFXGRAPH_LIB"):
        read_runtime_lib({"GFXGRAPH_LIB": str(tmp_path / "missing.so")})
