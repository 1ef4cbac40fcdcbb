"""The plugin's logger. Its name must start with ``vllm.`` or vLLM's logging
configuration drops its records (vllm-plugin-notes, pitfall 6)."""

from __future__ import annotations

import logging

from . import compat

_init_logger = compat.find("init_logger", required=False)
logger = _init_logger("vllm.zipserv") if _init_logger is not None else logging.getLogger("vllm.zipserv")
