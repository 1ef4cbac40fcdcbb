"""Where zipserv-vllm keeps what it builds or measures once: ``ZIPSERV_CACHE`` or ``~/.cache/zipserv-vllm``
(the demo's model, the GPU dispatcher's timings)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("ZIPSERV_CACHE") or Path.home() / ".cache" / "zipserv-vllm")
