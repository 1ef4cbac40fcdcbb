"""vLLM plugin: the ``zipserv`` quantization method (lossless compressed BF16 weights).

vLLM calls :func:`register` in every process through the
``vllm.general_plugins`` entry point declared in pyproject.toml. Importing this
package imports no vLLM (so :mod:`.arena` and :mod:`.tiles` work without it);
``register()`` imports the vLLM-facing modules, whose import runs
``@register_quantization_config("zipserv")``.

Modules (bottom up: version <- compat <- log <- the rest):
  * :mod:`.version`  - the vLLM versions this plugin is tested with (one place; imports no plugin module).
  * :mod:`.compat`   - every vLLM symbol the plugin uses, found by feature (one place).
  * :mod:`.log`      - the plugin's logger (vLLM's, found through compat).
  * :mod:`.config`   - ``ZipServConfig`` (quant_method ``zipserv``, modes, preflight checks).
  * :mod:`.methods`, :mod:`.moe` - linear / embedding and mixture-of-experts methods.
  * :mod:`.loading`  - per-layer state, tensor-parallel tile selection, completeness checks.
  * :mod:`.weight_loaders` - the placeholders' loaders: recording, then weight updates.
  * :mod:`.layouts`  - which in-memory layout (v1 / byte-split) a device holds; pack and repack.
  * :mod:`.gemm`     - the exact-mode GEMM: the same kernel vLLM's unquantized path runs.
  * :mod:`.arena`, :mod:`.tiles` - the paged arena and byte-range plans (no vLLM).
  * :mod:`.errors`  - every load failure as one readable line, whatever vLLM wraps around it.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register the ``zipserv`` quantization config with vLLM (idempotent, cheap)."""
    global _registered
    if _registered:
        return
    _registered = True
    from . import compat, errors, version
    from .log import logger

    errors.install()
    line = version.unsupported_warning()  # (a vLLM outside the tested series; logged once the APIs were looked up)
    try:
        compat.check()
    except compat.VLLMCompatError as exc:
        if line:
            logger.warning("%s", line)
        errors.report(exc)  # one line; "zipserv" then stays unknown to vLLM
        return
    if line:
        logger.warning("%s", line)
    from . import config  # noqa: F401  (runs @register_quantization_config)


__all__ = ["register"]
