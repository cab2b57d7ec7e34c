"""What configures gfxgraph: every environment variable, parsed here, and the switches ``enable()`` sets.

Every parser names the variable and the accepted values when it rejects one:
``GFXGRAPH`` and ``GFXGRAPH_LOG_LEVEL`` (alias ``HGB_LOG_LEVEL``) are read at
import, so a bad value there is a logged warning (an import must not fail over
a typo; with logging unconfigured it reaches stderr through
``logging.lastResort``); ``GFXGRAPH_VRAM_CAP``,
``GFXGRAPH_LIB`` and ``GFXGRAPH_RUNTIME`` are read when they are used, and a bad
value there is a :class:`ConfigError`.

:data:`switches` holds what ``enable()`` turned on. Hot paths read it as
``config.switches.validate``: two attribute loads, no call, no lock; it is
replaced whole (never mutated) by :func:`set_switches`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from .errors import ConfigError

__all__ = [
    "EnableMode",
    "read_enable_mode",
    "read_log_level",
    "LOG_LEVEL_VARS",
    "read_vram_cap",
    "check_vram_cap",
    "read_runtime_lib",
    "read_runtime_kind",
    "RuntimeKind",
    "RUNTIME_KINDS",
    "DEFAULT_VRAM_CAP",
    "Switches",
    "switches",
    "set_switches",
]

EnableMode = Literal["off", "on", "debug", "validate"]
RuntimeKind = Literal["auto", "cuda-bindings", "ctypes"]
RUNTIME_KINDS: tuple[str, ...] = ("auto", "cuda-bindings", "ctypes")

DEFAULT_VRAM_CAP = 0.90

_ENABLE_VALUES: dict[str, EnableMode] = {
    "": "off",
    "0": "off",
    "1": "on",
    "debug": "debug",
    "validate": "validate",
}

_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

_log = logging.getLogger("gfxgraph")


def _warn(msg: str) -> None:
    # The logger alone: with logging unconfigured, logging.lastResort prints it (the
    # library attaches no handler by default), so a warnings.warn too would print it twice.
    _log.warning(msg)


def read_enable_mode(environ: Mapping[str, str] | None = None) -> EnableMode:
    """Parse ``GFXGRAPH``: ``1``, ``debug``, ``validate`` or ``0`` (unset = ``0``).

    Any other value logs a warning naming the accepted ones and leaves gfxgraph off.
    """
    env = os.environ if environ is None else environ
    raw = env.get("GFXGRAPH", "")
    value = raw.strip().lower()
    mode = _ENABLE_VALUES.get(value)
    if mode is None:
        _warn(f"GFXGRAPH={raw!r} is not understood; accepted values are 1, debug, validate, 0. "
              "gfxgraph stays disabled.")
        return "off"
    return mode


LOG_LEVEL_VARS = ("GFXGRAPH_LOG_LEVEL", "HGB_LOG_LEVEL")  # the primary name first, then the seed's alias


def read_log_level(environ: Mapping[str, str] | None = None) -> int | None:
    """Parse ``GFXGRAPH_LOG_LEVEL`` (debug, info, warn, error); None when unset or bad.

    ``HGB_LOG_LEVEL``, the seed's name, is read only when ``GFXGRAPH_LOG_LEVEL``
    is unset or empty. A bad value logs a warning naming the variable and the
    accepted values (the other variable is then not consulted).
    """
    env = os.environ if environ is None else environ
    for name in LOG_LEVEL_VARS:
        raw = env.get(name)
        if raw is not None and raw.strip():
            break
    else:
        return None
    level = _LOG_LEVELS.get(raw.strip().lower())
    if level is None:
        _warn(f"{name}={raw!r} is not understood; accepted values are debug, info, warn, error. "
              "The 'gfxgraph' logger keeps its level.")
    return level


def read_vram_cap(environ: Mapping[str, str] | None = None) -> float:
    """Parse ``GFXGRAPH_VRAM_CAP``: a fraction in (0.0, 1.0], default 0.90.

    Raises:
        ConfigError: the value is not a number in that range.
    """
    env = os.environ if environ is None else environ
    raw = env.get("GFXGRAPH_VRAM_CAP")
    if raw is None or not raw.strip():
        return DEFAULT_VRAM_CAP
    try:
        cap = float(raw)
    except ValueError:
        cap = float("nan")
    if not (0.0 < cap <= 1.0):
        raise ConfigError(
            f"GFXGRAPH_VRAM_CAP={raw!r}: expected a fraction of device memory in (0.0, 1.0], "
            f"e.g. 0.9 (the default is {DEFAULT_VRAM_CAP})"
        )
    return cap


def check_vram_cap(cap: float, *, name: str = "vram_cap") -> float:
    """Validate a VRAM cap given as an option rather than through the environment."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (0.0 < cap <= 1.0):
        raise ConfigError(f"{name}: expected a fraction of device memory in (0.0, 1.0], got {cap!r}")
    return float(cap)


def read_runtime_lib(environ: Mapping[str, str] | None = None) -> str | None:
    """Parse ``GFXGRAPH_LIB``: an explicit runtime library for the native runtime layer.

    Raises:
        ConfigError: the path is set but is not a regular file.
    """
    env = os.environ if environ is None else environ
    raw = env.get("GFXGRAPH_LIB")
    if raw is None or not raw.strip():
        return None
    if not os.path.isfile(raw):
        raise ConfigError(
            f"GFXGRAPH_LIB={raw!r}: expected the path of a regular file (a CUDA runtime "
            "libcudart.so* or HIP runtime libamdhip64.so*); it does not exist or is not a file"
        )
    return raw


def read_runtime_kind(environ: Mapping[str, str] | None = None) -> RuntimeKind:
    """Parse ``GFXGRAPH_RUNTIME``: ``auto`` (default), ``cuda-bindings`` or ``ctypes``.

    Raises:
        ConfigError: any other value.
    """
    env = os.environ if environ is None else environ
    raw = env.get("GFXGRAPH_RUNTIME")
    if raw is None or not raw.strip():
        return "auto"
    value = raw.strip().lower()
    if value not in RUNTIME_KINDS:
        raise ConfigError(f"GFXGRAPH_RUNTIME={raw!r}: expected one of {', '.join(RUNTIME_KINDS)}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class Switches:
    """What ``gfxgraph.enable()`` turned on (all off until it is called)."""

    enabled: bool = False
    debug: bool = False
    validate: bool = False  # compare high-level calls with eager, return eager on a mismatch
    checked: bool = field(init=False, default=False)  # debug or validate: the hot paths read one flag

    def __post_init__(self) -> None:
        object.__setattr__(self, "checked", self.debug or self.validate)


switches = Switches()
_switch_lock = threading.Lock()


def set_switches(**changes: bool) -> Switches:
    """Replace :data:`switches` with a copy carrying ``changes``; returns the new one."""
    global switches
    with _switch_lock:
        switches = replace(switches, **changes)
        return switches
