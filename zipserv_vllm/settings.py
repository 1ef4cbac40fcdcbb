"""The ``ZIPSERV_*`` environment variables: read in one place, each bad value refused with one line.

Every reader raises :class:`SettingError` (a ``ValueError``) whose message is
one line starting ``zipserv:`` and naming the variable, the value and what it
accepts. The command line prints it as ``zipserv: error: ...``; the vLLM plugin
checks every variable once when its config is built (:func:`check_all`), in
the process the user started, so a bad value stops vLLM before any worker
starts. This module imports nothing of the package and no vLLM.
"""

from __future__ import annotations

import os


class SettingError(ValueError):
    """A ``ZIPSERV_*`` variable (or a checkpoint setting) has a value that does not exist."""


def raw(name: str) -> str | None:
    """The variable's value, stripped; None when unset or empty."""
    v = os.environ.get(name)
    return v.strip() if v and v.strip() else None


def choice(name: str, choices: tuple[str, ...], fallback: str | None = None, fallback_source: str | None = None) -> str:
    """A value out of ``choices`` (case-insensitive): the variable if set, else ``fallback``
    (named ``fallback_source`` in the error), else ``choices[0]``."""
    env = raw(name)
    v = (env or (fallback.strip() if isinstance(fallback, str) and fallback.strip() else None) or choices[0]).lower()
    if v not in choices:
        source = name if env else (fallback_source or name)
        raise SettingError(f"zipserv: {source} is {v!r}; expected one of {', '.join(choices)}")
    return v


def integer(name: str, default: int, minimum: int | None = None) -> int:
    env = raw(name)
    if env is None:
        return default
    try:
        value = int(env)
    except ValueError:
        what = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise SettingError(f"zipserv: {name} must be {what}, got {env!r}") from None
    if minimum is not None and value < minimum:
        raise SettingError(f"zipserv: {name} must be an integer >= {minimum}, got {env!r}")
    return value


def positive_number(name: str, default: float) -> float:
    env = raw(name)
    if env is None:
        return default
    try:
        value = float(env)
    except ValueError:
        raise SettingError(f"zipserv: {name} must be a positive number, got {env!r}") from None
    if not value > 0 or value == float("inf"):
        raise SettingError(f"zipserv: {name} must be a positive number, got {env!r}")
    return value


def flag(name: str, default: bool) -> bool:
    env = raw(name)
    if env is None:
        return default
    if env not in ("0", "1"):
        raise SettingError(f"zipserv: {name} must be 0 or 1, got {env!r}")
    return env == "1"


# ---------------------------------------------------------------- the variables
MODES = ("fast", "exact")
VERIFY_MODES = ("tiles", "full", "none")
PREFER = ("memory", "speed")
CPU_LAYOUTS = ("bytesplit", "v1")  # the first is the default
GPU_LAYOUTS = ("v1", "bytesplit")


def threads() -> int | None:
    """``ZIPSERV_THREADS``: codec threads (None: not set)."""
    env = raw("ZIPSERV_THREADS")
    return None if env is None else integer("ZIPSERV_THREADS", 1, minimum=1)


def arena_page_mb(default: float) -> float:
    return positive_number("ZIPSERV_ARENA_PAGE_MB", default)


def cpu_layout() -> str:
    return choice("ZIPSERV_CPU_LAYOUT", CPU_LAYOUTS)


def gpu_layout(prefer: str = "memory") -> str:
    """``ZIPSERV_GPU_LAYOUT``: the in-memory layout of a GPU engine's linear layers in fast mode:
    ``v1`` (TCA-TBE, the smallest) or ``bytesplit`` (docs/FORMAT.md appendix A: ~12.05 bits per
    weight, a decode of a few integer operations per pair). Unset: ``bytesplit`` under
    ``prefer: speed``, ``v1`` otherwise."""
    return choice("ZIPSERV_GPU_LAYOUT", GPU_LAYOUTS, "bytesplit" if prefer == "speed" else "v1")


def cpu_fused_max_n(default: int) -> int:
    return integer("ZIPSERV_CPU_FUSED_MAX_N", default, minimum=0)


def cpu_op() -> bool:
    """ZIPSERV_CPU_OP=0: zipserv::packed_gemm stays the Python implementation (no C++ CPU kernel)."""
    return flag("ZIPSERV_CPU_OP", True)


def check_all() -> None:
    """Every variable the plugin reads, once (raises SettingError on the first bad one)."""
    threads()
    arena_page_mb(1.0)
    cpu_layout()
    gpu_layout()
    cpu_fused_max_n(0)
    cpu_op()
    choice("ZIPSERV_MODE", MODES)
    choice("ZIPSERV_VERIFY", VERIFY_MODES)
    choice("ZIPSERV_PREFER", PREFER)
    flag("ZIPSERV_AUTOTUNE", True)
