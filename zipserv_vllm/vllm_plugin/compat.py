"""Every vLLM symbol and behaviour the plugin relies on, found in one place by feature.

The plugin's other modules take vLLM's classes and functions from here, never
from vLLM directly, so a vLLM release that moves or renames one shows up in
exactly one module, as one clear line naming what is missing, not as a
traceback from inside vLLM. Each entry lists where the supported releases
keep it (several candidates where a rename is known or announced, e.g. vLLM's
fused-MoE classes); :func:`find` takes the first that exists, :func:`missing`
lists what none of the candidates provides, and :func:`check` is what the
plugin runs at registration.

The releases this is tested with are declared in :mod:`.version`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from . import version


class VLLMCompatError(RuntimeError):
    """The installed vLLM lacks (or changed) something the plugin needs; the message names it."""


@dataclass(frozen=True)
class Need:
    """One thing the plugin uses: where vLLM keeps it, and what it is for (for the error line)."""

    what: str
    candidates: tuple[tuple[str, str], ...]  # (module, attribute)
    required: bool = True


NEEDS: dict[str, Need] = {n.what: n for n in (
    Need("register_quantization_config", (("vllm.model_executor.layers.quantization", "register_quantization_config"),)),
    Need("QuantizationConfig", (("vllm.model_executor.layers.quantization.base_config", "QuantizationConfig"),)),
    Need("QuantizeMethodBase", (("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase"),)),
    Need("LinearBase", (("vllm.model_executor.layers.linear", "LinearBase"),)),
    Need("LinearMethodBase", (("vllm.model_executor.layers.linear", "LinearMethodBase"),)),
    Need("UnquantizedLinearMethod", (("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),)),
    Need("ColumnParallelLinear", (("vllm.model_executor.layers.linear", "ColumnParallelLinear"),)),
    Need("MergedColumnParallelLinear", (("vllm.model_executor.layers.linear", "MergedColumnParallelLinear"),)),
    Need("QKVParallelLinear", (("vllm.model_executor.layers.linear", "QKVParallelLinear"),)),
    Need("ReplicatedLinear", (("vllm.model_executor.layers.linear", "ReplicatedLinear"),)),
    Need("RowParallelLinear", (("vllm.model_executor.layers.linear", "RowParallelLinear"),)),
    Need("VocabParallelEmbedding", (("vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding"),)),
    Need("ParallelLMHead", (("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),)),
    Need("UnquantizedEmbeddingMethod",
         (("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod"),)),
    Need("initialize_online_processing",
         (("vllm.model_executor.model_loader.reload.layerwise", "initialize_online_processing"),
          ("vllm.model_executor.model_loader.reload", "initialize_online_processing"))),
    Need("set_weight_attrs", (("vllm.model_executor.utils", "set_weight_attrs"),)),
    Need("dispatch_cpu_unquantized_gemm", (("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm"),)),
    Need("dispatch_unquantized_gemm", (("vllm.model_executor.layers.utils", "dispatch_unquantized_gemm"),)),
    Need("current_platform", (("vllm.platforms", "current_platform"),)),
    Need("get_current_vllm_config", (("vllm.config", "get_current_vllm_config"),), required=False),
    # The engine's config while vLLM builds a model (None outside): its additional_config carries zipserv's
    # compile-cache factors, its static_forward_context the MoE layers the zipserv::moe_experts op looks up.
    Need("get_current_vllm_config_or_none", (("vllm.config.vllm", "get_current_vllm_config_or_none"),
                                             ("vllm.config", "get_current_vllm_config_or_none")), required=False),
    # The running forward pass's per-layer objects (no_compile_layers), as vLLM's attention op finds its layer.
    Need("get_forward_context", (("vllm.forward_context", "get_forward_context"),), required=False),
    Need("is_forward_context_available", (("vllm.forward_context", "is_forward_context_available"),),
         required=False),
    Need("init_logger", (("vllm.logger", "init_logger"),)),
    # The OpenAI server `vllm serve` runs (python -m zipserv_vllm.serve); looked up, not imported.
    Need("api_server_entry", (("vllm.entrypoints.launchers.api_server.entry", "main"),
                              ("vllm.entrypoints.openai.api_server", "main")), required=False),
    # Mixture-of-experts method base (vLLM is moving MoE to a factory + modular kernels).
    Need("FusedMoEMethodBase", (("vllm.model_executor.layers.fused_moe.fused_moe_method_base", "FusedMoEMethodBase"),
                                ("vllm.model_executor.layers.fused_moe", "FusedMoEMethodBase")), required=False),
    # The routed experts of a MoE layer (what get_quant_method is asked about) and vLLM's own method for them,
    # which zipserv's (vllm_plugin/moe.py) extends. Without them MoE layers stay BF16.
    Need("RoutedExperts", (("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts"),
                           ("vllm.model_executor.layers.fused_moe", "RoutedExperts")), required=False),
    Need("UnquantizedFusedMoEMethod",
         (("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod"),
          ("vllm.model_executor.layers.fused_moe", "UnquantizedFusedMoEMethod")), required=False),
)}

_found: dict[str, Any] = {}


def _lookup(need: Need):
    for module, attr in need.candidates:
        try:
            mod = importlib.import_module(module)
        except Exception:  # ImportError, or a vLLM module that fails to import on this host
            continue
        if hasattr(mod, attr):
            return getattr(mod, attr)
    return None


def find(what: str, required: bool = True):
    """The vLLM object ``what`` (a key of :data:`NEEDS`); VLLMCompatError when absent and required."""
    if what not in _found:
        _found[what] = _lookup(NEEDS[what])
    obj = _found[what]
    if obj is None and required:
        raise VLLMCompatError(_missing_line(NEEDS[what]))
    return obj


def current_vllm_config():
    """The config of the engine vLLM is building a model for, or None outside one (or on a vLLM
    without ``get_current_vllm_config_or_none``)."""
    get = find("get_current_vllm_config_or_none", required=False)
    return get() if get is not None else None


def _missing_line(need: Need) -> str:
    where = " or ".join(f"{m}.{a}" for m, a in need.candidates)
    return (f"zipserv: this vLLM ({version.vllm_version()}) has no {need.what} ({where}), which zipserv-vllm needs; "
            f"zipserv-vllm is tested with vLLM {version.tested_text()}")


def missing_line(what: str) -> str:
    return _missing_line(NEEDS[what])


def server_entry_module() -> str | None:
    """The module of vLLM's OpenAI server entry point (without importing it)."""
    import importlib.util

    for module, _ in NEEDS["api_server_entry"].candidates:
        try:
            if importlib.util.find_spec(module) is not None:
                return module
        except (ImportError, ValueError):
            continue
    return None


# -------------------------------------------------------------- behaviours
def _params(fn) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def behaviour_problems() -> list[str]:
    """Signatures the plugin relies on, checked without building anything."""
    out = []
    lm = find("LinearMethodBase", required=False)
    if lm is not None:
        p = _params(lm.create_weights)
        want = ["layer", "input_size_per_partition", "output_partition_sizes", "input_size", "output_size",
                "params_dtype"]
        if p[1:7] != want:
            out.append(f"LinearMethodBase.create_weights takes ({', '.join(p[1:])}), zipserv-vllm expects "
                       f"({', '.join(want)}, **extra_weight_attrs)")
    qc = find("QuantizationConfig", required=False)
    if qc is not None:
        abstract = set(getattr(qc, "__abstractmethods__", ()))
        known = {"get_name", "get_supported_act_dtypes", "get_min_capability", "get_config_filenames",
                 "from_config", "get_quant_method"}
        extra = sorted(abstract - known)
        if extra:
            out.append(f"QuantizationConfig requires methods zipserv-vllm does not implement: {', '.join(extra)}")
    d = find("dispatch_cpu_unquantized_gemm", required=False)
    if d is not None and _params(d)[:2] != ["layer", "remove_weight"]:
        out.append(f"dispatch_cpu_unquantized_gemm takes ({', '.join(_params(d))}), zipserv-vllm expects "
                   "(layer, remove_weight)")
    return out


def missing() -> list[str]:
    """One line per required API this vLLM lacks or changed (empty: everything is there)."""
    lines = [_missing_line(n) for n in NEEDS.values() if n.required and find(n.what, required=False) is None]
    lines += [f"zipserv: this vLLM ({version.vllm_version()}): {p}; zipserv-vllm is tested with vLLM {version.tested_text()}"
              for p in behaviour_problems()]
    return lines


def check() -> None:
    """Raise VLLMCompatError (first problem) unless every required API is there."""
    problems = missing()
    if problems:
        raise VLLMCompatError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
