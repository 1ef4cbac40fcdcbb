"""The plugin's logger. Its name must start with ``vllm.`` or vLLM's logging
configuration drops its records (vllm-plugin-notes, pitfall 6)."""

from __future__ import annotations

import logging

try:
    from vllm.logger import init_logger

    logger = init_logger("vllm.zipserv")
except Exception:  # pragma: no cover - vLLM missing: plain logging
    logger = logging.getLogger("vllm.zipserv")
