"""``ZipServConfig``: the ``zipserv`` quantization method as vLLM sees it.

* A pre-compressed checkpoint declares itself in config.json
  (``"quantization_config": {"quant_method": "zipserv", "format_version": 1, "mode": ...}``);
  vLLM then picks this config with no flag (``--quantization zipserv`` is accepted too).
* ``--quantization zipserv`` on a plain BF16 checkpoint (no ``quantization_config``)
  makes vLLM call ``ZipServConfig()`` with no arguments: pack at load.

Mode: ``ZIPSERV_MODE`` (``fast`` | ``exact``) wins over the checkpoint's
``"mode"``; the default is ``fast``. Arena page size: ``ZIPSERV_ARENA_PAGE_MB``
(default 64).
"""

from __future__ import annotations

import os as _os
from pathlib import Path
from typing import Any

import torch

from .. import settings
from ..format import spec
from . import compat, errors, layouts, loading, methods
from ..format.cpu_layout import PackedTensor
from .arena import DEFAULT_PAGE_BYTES, PagedArena
from .log import logger
from .version import check_vllm_version

#: ZIPSERV_* variables that differ between processes but never change a traced graph
_PER_PROCESS = ("ZIPSERV_ERROR_FILE",)

LinearBase = compat.find("LinearBase")
QuantizationConfig = compat.find("QuantizationConfig")
VocabParallelEmbedding = compat.find("VocabParallelEmbedding")
register_quantization_config = compat.find("register_quantization_config")

NAME = "zipserv"
MODES = settings.MODES


def resolve_mode(checkpoint_mode: str | None) -> str:
    """``ZIPSERV_MODE`` if set, else the checkpoint's mode, else ``fast``."""
    return settings.choice("ZIPSERV_MODE", MODES, checkpoint_mode, "the checkpoint's quantization_config.mode")


def resolve_verify(checkpoint_verify: str | None) -> str:
    """How a pre-compressed checkpoint's data is checked at load: ``ZIPSERV_VERIFY`` if set,
    else the checkpoint's ``"verify"``, else ``tiles`` (every tile a rank loads against its
    checksum); ``full`` also decodes every matrix and compares its CRC-32; ``none`` skips both."""
    return settings.choice("ZIPSERV_VERIFY", settings.VERIFY_MODES, checkpoint_verify,
                           "the checkpoint's quantization_config.verify")


_PATH_WORDS = {"tiles": "loaded tile by tile", "packed": "packed at load", "re-encoded": "re-encoded at load"}


def _page_bytes() -> int:
    return int(settings.arena_page_mb(DEFAULT_PAGE_BYTES / (1 << 20)) * (1 << 20))


def _release_freed_memory() -> None:
    """Return freed heap memory to the OS after packing (glibc only; a no-op elsewhere).

    Packing at load allocates and frees one BF16 layer and its compressed
    temporaries per layer; glibc keeps much of that freed heap mapped, which would
    show up as resident memory (measured: about 190 MiB on a 1.1 B model)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@register_quantization_config(NAME)
class ZipServConfig(QuantizationConfig):
    """Lossless TCA-TBE compressed BF16 weights (pre-compressed or packed at load)."""

    def __init__(self, precompressed: bool = False, mode: str | None = None, format_version: int = spec.VERSION,
                 extra: dict[str, Any] | None = None, verify: str | None = None, prefer: str | None = None):
        super().__init__()
        try:
            check_vllm_version()
            settings.check_all()  # every ZIPSERV_* variable, before any worker starts
            if format_version not in spec.SUPPORTED_VERSIONS:
                raise ValueError(
                    f"zipserv: checkpoint format_version {format_version} is not supported by this zipserv-vllm "
                    f"(supported: {', '.join(map(str, spec.SUPPORTED_VERSIONS))})")
            self.mode = resolve_mode(mode)
            self.verify = resolve_verify(verify)
            from ..kernels.autotune import prefer_policy

            self.prefer = prefer_policy(prefer)
            # a GPU engine's layout in fast mode (first contact may turn bytesplit back into v1)
            self.gpu_layout = settings.gpu_layout(self.prefer)
            self.page_bytes = _page_bytes()
        except Exception as exc:
            raise errors.report(exc)
        self.precompressed = precompressed
        self.checkpoint_mode = mode
        self.format_version = format_version
        self.extra = dict(extra or {})
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._states: list[loading.LayerState] = []
        self._unmanaged: dict[str, int] = {}  # layer types vLLM asked about that zipserv leaves BF16
        self._plain: dict[str, list[str]] = {}  # reason -> layers zipserv left to vLLM's own method
        self._arenas: dict[str, PagedArena] = {}
        self._executed = False
        self._finished = False
        self._moe_pending = 0  # MoE layers created but not yet compressed (finish_loading waits for them)
        self._contacted: set[str] = set()  # CUDA devices whose first contact decided mode and layout

    # vLLM pickles the config from the front-end to the workers: ship settings, not state.
    def __getstate__(self):
        d = dict(self.__dict__)
        for k in ("_states", "_arenas", "_executed", "_finished", "_unmanaged", "_plain", "_moe_pending",
                  "_engine_extra", "_contacted", "_tuner_obj"):
            d.pop(k, None)
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._init_runtime()

    def __repr__(self) -> str:
        return (f"ZipServConfig(precompressed={self.precompressed}, mode={self.mode!r}, "
                f"format_version={self.format_version})")

    # ----------------------------------------------------------- vLLM API
    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # fused CUDA kernels need sm_80 (mma.m16n8k16 BF16); never consulted on CPU

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # with the flag and no quantization_config, vLLM calls ZipServConfig()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ZipServConfig":
        method = str(config.get("quant_method", NAME)).lower()
        if method != NAME:
            raise errors.report(ValueError(f"zipserv: quantization_config.quant_method is {method!r}, expected {NAME!r}"))
        version = config.get("format_version")
        if version is None:
            raise errors.report(ValueError("zipserv: quantization_config has no format_version (a zipserv checkpoint writes 1)"))
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise errors.report(ValueError(
                f"zipserv: quantization_config.format_version is {version!r}, not an integer")) from None
        known = {"quant_method", "format_version", "mode", "verify", "prefer"}
        return cls(precompressed=True, mode=config.get("mode"), format_version=version,
                   extra={k: v for k, v in config.items() if k not in known}, verify=config.get("verify"),
                   prefer=config.get("prefer"))

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None):
        """Preflight a local pre-compressed checkpoint (headers only, front-end)."""
        if not self.precompressed:
            return
        path = Path(model_name)
        if not path.is_dir():
            logger.info("zipserv: %s is not a local directory; checkpoint preflight skipped", model_name)
            return
        from .preflight import check_checkpoint

        try:
            counts = check_checkpoint(path)
        except Exception as exc:
            raise errors.report(exc)
        logger.debug("zipserv: checkpoint %s: %d compressed matrices in %d shard(s), mode %s",
                    path, counts["compressed"], counts["shards"], self.mode)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        loading.set_packed_mapping(self.packed_modules_mapping)
        self._key_compile_cache()
        if isinstance(layer, LinearBase):
            cls = methods.ZipServLinearMethod if self.precompressed else methods.ZipServOnlineLinearMethod
            return cls(self)
        if isinstance(layer, VocabParallelEmbedding):
            cls = methods.ZipServEmbeddingMethod if self.precompressed else methods.ZipServOnlineEmbeddingMethod
            return cls(self)
        routed = compat.find("RoutedExperts", required=False)
        if routed is not None and isinstance(layer, routed) and compat.find("UnquantizedFusedMoEMethod", required=False):
            from .moe import ZipServMoEMethod

            par = getattr(layer.moe_config, "moe_parallel_config", None)
            if getattr(par, "use_ep", False) and compat.find("current_platform").is_cpu():
                # The CPU exact path runs vLLM's expert kernel over every local expert and ignores
                # expert_map; untested (vLLM's own BF16 Mixtral crashes under CPU EP): refuse it.
                raise errors.report(ValueError(
                    f"zipserv: expert parallelism (--enable-expert-parallel) is not supported with zipserv on the "
                    f"CPU yet ({prefix or 'a MoE layer'}: ep_size {getattr(par, 'ep_size', '?')}); serve without "
                    "it (tensor parallelism splits the experts instead)"))
            return ZipServMoEMethod(layer.moe_config, self, prefix)
        name = type(layer).__name__
        if "MoE" in name or "Experts" in name:
            self._unmanaged[name] = self._unmanaged.get(name, 0) + 1
        return None

    def compile_factors(self) -> dict[str, Any]:
        """What decides the graphs torch.compile traces through zipserv's layers, beyond the traced source
        files and the checkpoint's config.json (which vLLM's compile-cache key already covers): the
        resolved mode, the package version (its native kernels are not traced files), every ``ZIPSERV_*``
        setting in the environment (the mode, the CPU layout, the dispatcher's preferences...; not the
        per-process error file) and, once loaded, which layers are compressed and how (the measuring
        dispatcher's ``prefer: speed`` may keep others BF16 on another host or run)."""
        import hashlib

        from .. import __version__

        env = {k: v for k, v in sorted(_os.environ.items()) if k.startswith("ZIPSERV_") and k not in _PER_PROCESS}
        layers = hashlib.sha256(repr(sorted(
            (st.prefix, st.bf16, [type(p).__name__ for p in st.parts]) for st in self._states)).encode())
        return {"version": __version__, "mode": self.mode, "precompressed": self.precompressed, "env": env,
                "layers": layers.hexdigest()[:16] if self._finished else None}

    def _key_compile_cache(self) -> None:
        """Put :meth:`compile_factors` into the engine's ``additional_config``, which vLLM hashes into its
        torch.compile cache key when it compiles (after loading; vLLM has no hook for a quantization
        config's own factors): a warm cache made with another mode, other settings or other layers
        compressed is then never reused. Called while vLLM builds the model (where its config is current)
        and again when loading is over."""
        if self.__dict__.get("_engine_extra") is None:
            vc = compat.current_vllm_config()
            if vc is None:
                return  # no engine being built (a layer made outside one): no compile cache to key
            # the dict only: holding the engine's config would keep its layers alive through this config
            self._engine_extra = getattr(vc, "additional_config", None)
        elif not self._finished:
            return  # keyed once while the model is built, once more when loading is over
        extra = self._engine_extra
        if isinstance(extra, dict):
            extra["zipserv"] = self.compile_factors()
        elif extra is not None and not getattr(self, "_warned_extra", False):
            self._warned_extra = True
            logger.warning("zipserv: additional_config is a %s, not a dict: zipserv's settings (mode %s) are not "
                           "in vLLM's compile-cache key; set VLLM_DISABLE_COMPILE_CACHE=1 when changing them",
                           type(extra).__name__, self.mode)

    # ------------------------------------------------------- loading state
    def note_plain(self, prefix: str, reason: str) -> None:
        """A layer zipserv hands to vLLM's unquantized method (for the summary's reasons)."""
        self._plain.setdefault(reason, []).append(prefix)

    def register_state(self, st: loading.LayerState) -> None:
        self._states.append(st)

    def arena(self, device: torch.device) -> PagedArena:
        key = str(torch.device(device))
        if key not in self._arenas:
            self._arenas[key] = self._new_arena(device)
        return self._arenas[key]

    def _new_arena(self, device) -> PagedArena:
        arena = PagedArena(device, page_bytes=self.page_bytes)
        arena.__dict__["_zs_states"] = self._states  # its users, for freeing pages after weight updates
        return arena

    def execute_plan(self) -> None:
        """Pre-compressed: load every recorded layer's tiles (first call only)."""
        if self._executed:
            return
        self._executed = True
        loading.execute_precompressed([s for s in self._states if s.layer is not None], self.arena, self.verify,
                                      self.speed_reason)
        self.finish_loading()

    def expect_moe(self) -> None:
        self._moe_pending += 1

    def moe_done(self) -> None:
        """A MoE layer's experts are compressed (or kept BF16); the last one may finish loading."""
        self._moe_pending -= 1
        if not self._moe_pending and (self._executed or all(st.done for st in self._states)):
            self.finish_loading()

    def finish_loading(self) -> None:
        """Once all layers are loaded: shrink partly used pages and log the memory summary."""
        if self._finished or self._moe_pending:
            return
        self._finished = True
        self._first_contact()  # (before the repack: it decides whether a GPU engine holds the byte-split layout)
        repacked = self._repack()
        for arena in self._arenas.values():
            users = [st for st in self._states if st.arena is arena and st.tables]
            # Drop the views first so each old page is freed as soon as it is copied
            # (otherwise trimming would briefly hold the arena twice).
            for st in users:
                st.parts = []
            arena.trim()
            for st in users:
                st.bind()
        self._autotune()
        self._key_compile_cache()  # now with the layers as loaded
        if not self.precompressed or repacked:
            _release_freed_memory()
        self.log_summary()
        from . import errors

        errors.clear_mine()  # this process's load went well: its earlier messages no longer apply

    def _first_contact(self, devices=None) -> None:
        """Fast mode on CUDA weights: every kernel instance checked exactly once per device before it
        serves (kernels/selfcheck.py); a failing GEMM instance switches this engine to exact mode with
        one warning, a failing decompress kernel refuses the load, a failing byte-split kernel keeps
        the layers in v1 (where the engine was to hold the byte-split layout). ``devices``: those of
        the layers' CUDA parts by default; the tuner names its device before it times any kernel.
        A device is judged once; a change of mode or layout drops a tuner made for the old one."""
        from ..format import CompressedTensor

        if devices is None:
            devices = {str(p.sm.device) for st in self._states if st.layer is not None for p in st.parts
                       if isinstance(p, CompressedTensor) and p.sm.is_cuda}
        devices = sorted(set(devices) - self._contacted)
        if not devices or self.mode != "fast":
            return
        self._contacted.update(devices)
        # Runs only with CUDA weights (no GPU here); the checks and the mode decision are tested on the
        # CPU with the SIMT harness's kernels and planted faults (tests/simt/test_selfcheck.py).
        from ..kernels import selfcheck

        before = (self.mode, self.gpu_layout)
        try:
            self.mode, line, self.gpu_layout = selfcheck.engine_mode(self.mode, devices, layout=self.gpu_layout)
        except selfcheck.DecodeError as exc:
            raise loading.ZipServLoadError(str(exc)) from None
        if line:
            logger.warning(line)
        if (self.mode, self.gpu_layout) != before:
            tuner = self.__dict__.pop("_tuner_obj", None)
            if tuner is not None:
                tuner.release()

    # ------------------------------------------------------------ dispatcher
    def _tuner(self):
        """The measuring dispatcher of this engine (kernels/autotune.py; on the CPU in fast mode
        kernels/cpu_dispatch.py's candidates), or None where it does not run: CPU exact mode without
        injected timings, or ZIPSERV_AUTOTUNE=0."""
        if "_tuner_obj" in self.__dict__:
            return self.__dict__["_tuner_obj"]

        from ..kernels import autotune, dispatch

        tuner = None
        timings = _os.environ.get("ZIPSERV_AUTOTUNE_TIMINGS")
        if settings.flag("ZIPSERV_AUTOTUNE", True):
            max_n, decode_n = 8192, 256
            get_cfg = compat.find("get_current_vllm_config", required=False)
            try:
                sched = get_cfg().scheduler_config if get_cfg is not None else None
                if sched is not None:
                    max_n, decode_n = int(sched.max_num_batched_tokens), int(sched.max_num_seqs)
            except Exception:  # no current config (a layer built outside an engine)
                pass
            if timings:
                layout = self._tuned_gpu_layout()
                tuner = autotune.Tuner(autotune.injected_time_fn(timings), max_n, decode_n,
                                       candidates=lambda n, m, k: dispatch.candidates(n, m, k, layout=layout))
            else:
                import torch

                from .. import __version__

                if torch.cuda.is_available():  # pragma: no cover - needs a GPU
                    from ..kernels import cuda

                    dev = torch.device("cuda", torch.cuda.current_device())
                    self._first_contact([str(dev)])  # (no kernel is timed before it passed)
                    layout = self._tuned_gpu_layout()
                    cache = autotune.cache_file(cuda.device_info(dev)[0], cuda.driver_version(), __version__, layout)
                    tuner = autotune.Tuner(autotune.cuda_time_fn(dev, layout=layout), max_n, decode_n, cache,
                                           candidates=lambda n, m, k: dispatch.candidates(n, m, k, layout=layout))
                elif layouts.uses_packed(torch.device("cpu"), self.mode):
                    # CPU fast mode: time the byte-split kernels against vLLM's own BF16 kernel.
                    from ..kernels import cpu_dispatch
                    from .gemm import bf16_linear_factory

                    threads = torch.get_num_threads()
                    ns = [b for b in cpu_dispatch.BUCKETS if b <= max_n] or [1]
                    import vllm

                    baseline = f"vllm={getattr(vllm, '__version__', '?')} torch={torch.__version__}"
                    tuner = autotune.Tuner(cpu_dispatch.cpu_time_fn(bf16_linear_factory), max_n, decode_n,
                                           cpu_dispatch.cache_file(threads, __version__, baseline),
                                           candidates=cpu_dispatch.candidates, ns=ns)
                    tuner.kind = "cpu"
        self.__dict__["_tuner_obj"] = tuner
        return tuner

    def _tuned_gpu_layout(self) -> str:
        """The layout whose GPU plans the tuner times: the engine's GPU layout in fast mode (v1 in exact
        mode, which never repacks). On a GPU first contact has decided it before the tuner is made; a
        later change of layout drops the tuner (:meth:`_first_contact`)."""
        return self.gpu_layout if self.mode == "fast" else "v1"

    def speed_reason(self, shapes) -> str | None:
        """With prefer=speed: why a layer of these part shapes stays BF16 (None: compress it)."""
        tuner = self._tuner()
        if tuner is None or self.prefer != "speed":
            return None
        worst = tuner.slower(shapes)
        if worst is None:
            return None
        ratio, n = worst
        return f"prefer=speed: its fastest compressed plan takes {ratio:.2f}x the BF16 time at {n} tokens (measured)"

    def _autotune(self) -> None:
        """Measure every compressed shape not measured yet and install the fastest plans."""
        tuner = self._tuner()
        if tuner is None:
            return
        from ..kernels import dispatch

        live = [s for s in self._states if s.layer is not None and s.tied_to is None and s.parts]
        shapes = sorted({tuple(p.shape) for s in live for p in s.parts})
        tuner.measure(shapes)
        if getattr(tuner, "kind", "") == "cpu":
            from ..kernels import cpu_dispatch

            cpu_dispatch.set_measured(tuner.tuning.times)
            for m, k in shapes:
                if (m, k) in tuner.tuning.times:
                    logger.info(cpu_dispatch.ratios_line(m, k, tuner.tuning.times[(m, k)]))
        else:
            dispatch.set_measured(tuner.tuning.rules())
        tuner.save()

    def _repack(self) -> int:
        """Fast mode: v1 layers -> the byte-split layout (layouts.repack) where the engine holds it
        (CPU fast mode by default; GPU with gpu_layout bytesplit)."""
        total = 0
        for key, old in list(self._arenas.items()):
            if not layouts.uses_packed(old.device, self.mode, self.gpu_layout):
                continue
            new = self._new_arena(old.device)
            n = layouts.repack([s for s in self._states if s.layer is not None or s.tables], old, new)
            if n:
                self._arenas[key] = new
                total += n
                how = ("ZIPSERV_CPU_LAYOUT=v1" if torch.device(old.device).type == "cpu"
                       else "ZIPSERV_GPU_LAYOUT=v1")
                logger.debug("zipserv: %d layers repacked into the byte-split layout on %s (fast mode; %s keeps "
                             "TCA-TBE v1 in memory)", n, old.device, how)
        return total

    def memory_summary(self) -> dict[str, int]:
        """Exact bytes: arena pages vs the BF16 weights they replace."""
        live = [s for s in self._states if s.layer is not None and s.tied_to is None]
        comp = [s for s in live if s.parts]
        return {
            "layers_compressed": len(comp),
            "layers_bf16": sum(1 for s in live if s.bf16),
            "arena_pages": sum(a.num_pages for a in self._arenas.values()),
            "arena_allocated_bytes": sum(a.allocated_bytes for a in self._arenas.values()),
            "arena_used_bytes": sum(a.used_bytes for a in self._arenas.values()),
            "compressed_bf16_bytes": sum(2 * s.rows * s.cols for s in comp),
        }

    def log_summary(self) -> None:
        """One line of what zipserv did, and one with the reasons for layers kept BF16."""
        m = self.memory_summary()
        live = [s for s in self._states if s.layer is not None and s.tied_to is None]
        if m["layers_compressed"]:
            ratio = m["compressed_bf16_bytes"] / max(1, m["arena_allocated_bytes"])
            paths: dict[str, int] = {}
            for st in live:
                if st.path and st.path != "bf16":
                    paths[st.path] = paths.get(st.path, 0) + 1
            how = ", ".join(f"{v} {_PATH_WORDS.get(k, k)}" for k, v in sorted(paths.items()))
            logger.info(
                "zipserv: %d layers compressed (%s), %d kept BF16; arena %d page(s), %.2f MiB allocated "
                "for %.2f MiB of BF16 weights (%.3fx, %.2f MiB saved), mode %s%s",
                m["layers_compressed"], how, m["layers_bf16"], m["arena_pages"], m["arena_allocated_bytes"] / 2**20,
                m["compressed_bf16_bytes"] / 2**20, ratio,
                (m["compressed_bf16_bytes"] - m["arena_allocated_bytes"]) / 2**20,
                self.mode + (" (byte-split layout)" if any(isinstance(p, PackedTensor) for st in live for p in st.parts)
                             else ""), self._check_words(live))
        reasons: dict[str, list[str]] = {}
        for st in live:
            if st.bf16:
                reasons.setdefault(st.bf16_reason or "not compressible", []).append(st.prefix or "<layer>")
        for why, names in self._plain.items():
            reasons.setdefault(why, []).extend(names)
        for name, n in self._unmanaged.items():
            reasons.setdefault(f"{name}: zipserv does not compress mixture-of-experts experts yet", []).append(
                f"{n} layer{'s' * (n != 1)}")
        if reasons:
            logger.info("zipserv: kept BF16: %s", "; ".join(
                f"{why} ({', '.join(names[:4])}{f' and {len(names) - 4} more' if len(names) > 4 else ''})"
                for why, names in reasons.items()))

    def load_check(self) -> str:
        """What the summary line says of how the checkpoint's data was checked ("" when packed at load)."""
        return self._check_words([s for s in self._states if s.layer is not None and s.tied_to is None])[2:]

    def _check_words(self, live) -> str:
        if not self.precompressed:
            return ""
        if self.verify == "none":
            return "; data not checked (ZIPSERV_VERIFY=none)"
        from_ckpt = [st for st in live if st.path in ("tiles", "re-encoded")]  # as memory.weight_memory's "checked"
        want = ("full",) if self.verify == "full" else ("tiles", "full")
        short = [st for st in from_ckpt if st.checked not in want]  # what the words below must not claim
        if not short:
            return "; every matrix decoded and CRC-checked" if self.verify == "full" else "; every tile checked"
        if self.verify == "full":
            return (f"; NOT checked in full: {len(short)} of {len(from_ckpt)} layers have no CRC-32 stored in "
                    f"zs_meta (e.g. {short[0].prefix}), their tiles were checked against zs_crc where present")
        return (f"; NOT checked: {len(short)} of {len(from_ckpt)} layers have no tile checksums (e.g. "
                f"{short[0].prefix}; written before zipserv-vllm 0.2); ZIPSERV_VERIFY=full decodes and checks "
                "every matrix")
