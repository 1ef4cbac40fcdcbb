"""The zipserv config as vLLM sees it: registration, versions, modes, from_config, preflight."""

from __future__ import annotations

import os
import pickle

import pytest


def test_register_is_idempotent_and_registers_the_name():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from zipserv_vllm.vllm_plugin import register
    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    register()
    register()
    assert QUANTIZATION_METHODS.count("zipserv") == 1
    assert get_quantization_config("zipserv") is ZipServConfig


def test_version_support(monkeypatch):
    """0.32, 0.33 and 0.34 are tested; a newer vLLM runs with one warning when every API is found; an
    older one is refused with one line; a missing API is named in one line."""
    from zipserv_vllm.vllm_plugin import compat, version

    assert version.is_supported(version.vllm_version())  # the installed one is tested
    assert version.is_supported("0.32.0") and version.is_supported("0.32.7+cpu") and version.is_supported("0.33.0")
    assert version.is_supported("0.34.0") and version.status("0.34.1") == "tested"
    assert version.status("0.35.0") == "newer" and version.status("0.31.0") == "older"
    assert not version.is_supported("dev") and version.status("dev") == "unknown"
    monkeypatch.delenv("ZIPSERV_SKIP_VLLM_VERSION_CHECK", raising=False)
    monkeypatch.setattr(version, "vllm_version", lambda: "0.40.1")
    version.check_vllm_version()  # newer: allowed (the compatibility layer decides)
    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    assert ZipServConfig().mode in ("fast", "exact")
    monkeypatch.setattr(version, "vllm_version", lambda: "0.31.2")
    with pytest.raises(version.UnsupportedVLLMError, match=r"supports vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x, found vLLM 0\.31\.2"):
        version.check_vllm_version()
    with pytest.raises(version.UnsupportedVLLMError, match="found vLLM 0.31.2"):
        ZipServConfig()
    # an API that moved away: one line naming it, the candidates and the tested versions
    assert compat.missing() == []
    monkeypatch.setitem(compat.NEEDS, "LinearBase", compat.Need("LinearBase", (("vllm.no_such_module", "LinearBase"),)))
    monkeypatch.setitem(compat._found, "LinearBase", None)
    with pytest.raises(compat.VLLMCompatError, match=r"has no LinearBase \(vllm\.no_such_module\.LinearBase\), which "
                                                     r"zipserv-vllm needs; zipserv-vllm is tested with vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x"):
        compat.check()


def test_mode_resolution(monkeypatch):
    from zipserv_vllm.vllm_plugin.config import ZipServConfig, resolve_mode

    monkeypatch.delenv("ZIPSERV_MODE", raising=False)
    assert resolve_mode(None) == "fast"
    assert resolve_mode("exact") == "exact"
    assert ZipServConfig.from_config({"quant_method": "zipserv", "format_version": 1, "mode": "exact"}).mode == "exact"
    monkeypatch.setenv("ZIPSERV_MODE", "fast")
    assert resolve_mode("exact") == "fast"  # the variable wins
    monkeypatch.setenv("ZIPSERV_MODE", "turbo")
    with pytest.raises(ValueError, match="ZIPSERV_MODE is 'turbo'"):
        resolve_mode(None)


def test_from_config_and_defaults(monkeypatch):
    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    monkeypatch.delenv("ZIPSERV_MODE", raising=False)
    flag_only = ZipServConfig()  # --quantization zipserv on a BF16 checkpoint
    assert not flag_only.precompressed and flag_only.mode == "fast" and flag_only.get_name() == "zipserv"
    pre = ZipServConfig.from_config({"quant_method": "ZipServ", "format_version": 1, "compressed_modules": ["x"]})
    assert pre.precompressed and pre.extra == {"compressed_modules": ["x"]}
    with pytest.raises(ValueError, match="no format_version"):
        ZipServConfig.from_config({"quant_method": "zipserv"})
    with pytest.raises(ValueError, match="format_version 3 is not supported"):
        ZipServConfig.from_config({"quant_method": "zipserv", "format_version": 3})
    monkeypatch.setenv("ZIPSERV_ARENA_PAGE_MB", "abc")
    with pytest.raises(ValueError, match="ZIPSERV_ARENA_PAGE_MB"):
        ZipServConfig()


def test_config_pickles_settings_not_state():
    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    cfg = ZipServConfig.from_config({"quant_method": "zipserv", "format_version": 1})
    cfg.arena("cpu")
    back = pickle.loads(pickle.dumps(cfg))
    assert back.precompressed and back.mode == cfg.mode and back._arenas == {} and back._states == []


def test_compile_cache_factors(monkeypatch):
    """What goes into the engine's additional_config (hashed into vLLM's compile-cache key): the mode,
    every ZIPSERV_* setting except the per-process error file, and once loaded the layers' digest."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    for k in [k for k in os.environ if k.startswith("ZIPSERV_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("ZIPSERV_MODE", "exact")
    monkeypatch.setenv("ZIPSERV_ERROR_FILE", "/tmp/zipserv-errors-xyz.txt")
    monkeypatch.setenv("ZIPSERV_CPU_LAYOUT", "v1")
    exact = ZipServConfig(precompressed=True)
    f = exact.compile_factors()
    assert f["mode"] == "exact" and f["env"] == {"ZIPSERV_CPU_LAYOUT": "v1", "ZIPSERV_MODE": "exact"}
    assert f["layers"] is None  # nothing loaded yet
    monkeypatch.setenv("ZIPSERV_MODE", "fast")
    assert ZipServConfig(precompressed=True).compile_factors() != f
    vc = VllmConfig()
    with set_current_vllm_config(vc):
        exact._key_compile_cache()
    assert vc.additional_config["zipserv"] == exact.compile_factors() and vc.additional_config["zipserv"]["mode"] == "exact"
    before = vc.compute_hash()
    vc.additional_config["zipserv"]["mode"] = "fast"
    assert vc.compute_hash() != before  # vLLM hashes it


def test_preflight_accepts_a_sound_checkpoint(llama_dirs):
    from zipserv_vllm.vllm_plugin.preflight import check_checkpoint

    counts = check_checkpoint(llama_dirs[1])
    # 16 matrices compressed; the 5 RMSNorm weights stay plain
    assert counts == {"shards": 1, "compressed": 16, "uncompressed_weights": 5}


BAD_SETTINGS = [
    ("ZIPSERV_THREADS", "abc", "zipserv: ZIPSERV_THREADS must be an integer >= 1, got 'abc'"),
    ("ZIPSERV_THREADS", "0", "zipserv: ZIPSERV_THREADS must be an integer >= 1, got '0'"),
    ("ZIPSERV_ARENA_PAGE_MB", "-1", "zipserv: ZIPSERV_ARENA_PAGE_MB must be a positive number, got '-1'"),
    ("ZIPSERV_ARENA_PAGE_MB", "lots", "zipserv: ZIPSERV_ARENA_PAGE_MB must be a positive number, got 'lots'"),
    ("ZIPSERV_MODE", "turbo", "zipserv: ZIPSERV_MODE is 'turbo'; expected one of fast, exact"),
    ("ZIPSERV_PREFER", "latency", "zipserv: ZIPSERV_PREFER is 'latency'; expected one of memory, speed"),
    ("ZIPSERV_VERIFY", "some", "zipserv: ZIPSERV_VERIFY is 'some'; expected one of tiles, full, none"),
    ("ZIPSERV_CPU_LAYOUT", "v2", "zipserv: ZIPSERV_CPU_LAYOUT is 'v2'; expected one of bytesplit, v1"),
    ("ZIPSERV_CPU_FUSED_MAX_N", "many", "zipserv: ZIPSERV_CPU_FUSED_MAX_N must be an integer >= 0, got 'many'"),
    ("ZIPSERV_AUTOTUNE", "yes", "zipserv: ZIPSERV_AUTOTUNE must be 0 or 1, got 'yes'"),
]


@pytest.mark.parametrize("name,value,line", BAD_SETTINGS)
def test_every_bad_setting_is_refused_with_one_line_at_config_time(monkeypatch, name, value, line):
    """Checked when vLLM builds the config (the process the user started), before any worker."""
    from zipserv_vllm.vllm_plugin import errors
    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    monkeypatch.setenv(name, value)
    for build in (ZipServConfig, lambda: ZipServConfig.from_config({"quant_method": "zipserv", "format_version": 1})):
        with pytest.raises(ValueError) as exc:
            build()
        assert str(exc.value) == line and getattr(exc.value, "_zs_reported", False)
    assert errors.ENV  # (the launcher test in test_errors.py shows the line a user sees)


def test_checkpoint_settings_that_do_not_exist(monkeypatch):
    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    for name in ("ZIPSERV_MODE", "ZIPSERV_PREFER", "ZIPSERV_VERIFY"):
        monkeypatch.delenv(name, raising=False)
    for key, value, line in (
            ("mode", "turbo", "zipserv: the checkpoint's quantization_config.mode is 'turbo'; expected one of fast, exact"),
            ("prefer", "latency", "zipserv: quantization_config.prefer is 'latency'; expected one of memory, speed"),
            ("verify", "some", "zipserv: the checkpoint's quantization_config.verify is 'some'; expected one of "
                               "tiles, full, none")):
        with pytest.raises(ValueError) as exc:
            ZipServConfig.from_config({"quant_method": "zipserv", "format_version": 1, key: value})
        assert str(exc.value) == line


def test_moe_layers_found_by_name_in_their_own_engine():
    """zipserv::moe_experts finds its layer by name in the running forward pass's no_compile_layers:
    two engines' layers of the same name (two configs, as two engines in one process) each run their
    own; outside a forward pass the name must be unambiguous among the live layers."""
    import gc

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from zipserv_vllm.vllm_plugin import moe

    class Method:  # the three things the op uses of a ZipServMoEMethod
        # a name no real model in this process has: earlier tests in the same pytest worker may still hold
        # engines whose layers are named model.layers.N.mlp.experts
        zs_prefix = "test_config.two_engines.mlp.experts"

        def __init__(self, tag):
            self.tag = tag

        def compute(self, layer, x, topk_weights, topk_ids):
            return x + self.tag

        def one_call(self, layer, x):  # (not the one-call kernel: the C++ op kernel never takes these)
            return None

    layers, configs = [], []
    for tag in (1.0, 2.0):
        vc, layer = VllmConfig(), torch.nn.Linear(1, 1)
        with set_current_vllm_config(vc):
            moe._register(layer, Method(tag))
        layers.append(layer)
        configs.append(vc)
    x, w, ids = torch.zeros(2, 4), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    name = moe._op_name(Method.zs_prefix)
    for vc, tag in zip(configs, (1.0, 2.0)):
        with set_forward_context(None, vc):
            assert torch.equal(torch.ops.zipserv.moe_experts(x, w, ids, name), x + tag)
    with pytest.raises(RuntimeError, match="2 models in this process have a compressed MoE layer named"):
        torch.ops.zipserv.moe_experts(x, w, ids, name)
    del layers[0]
    gc.collect()
    assert torch.equal(torch.ops.zipserv.moe_experts(x, w, ids, name), x + 2.0)  # the only live one
    with set_forward_context(None, configs[0]), pytest.raises(RuntimeError, match="after its model was freed"):
        torch.ops.zipserv.moe_experts(x, w, ids, name)


def test_gpu_first_contact_decides_mode_and_layout_once_and_drops_a_stale_tuner(monkeypatch):
    """A GPU engine's first contact (kernels/selfcheck.py) runs once per device, before the tuner
    times anything there; when it turns the byte-split layout back into v1 (or fast into exact mode),
    a tuner made for the old layout is released and dropped. (CPU-side logic; the checks are
    injected: no GPU here.)"""
    from zipserv_vllm.kernels import selfcheck
    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    monkeypatch.delenv("ZIPSERV_GPU_LAYOUT", raising=False)
    monkeypatch.delenv("ZIPSERV_MODE", raising=False)
    checked = []
    fails = {"cuda:0": ["packed tile_n=8 split=1 (general X): wrong outputs"], "cuda:1": []}
    monkeypatch.setattr(selfcheck, "first_contact", lambda dev: checked.append(dev) or fails[dev])

    cfg = ZipServConfig(prefer="speed", mode="fast")
    assert (cfg.mode, cfg.gpu_layout) == ("fast", "bytesplit")
    released = []
    from zipserv_vllm.kernels import autotune

    def time_fn(plan, n, m, k):
        return 1.0

    time_fn.release = lambda: released.append(1)
    cfg.__dict__["_tuner_obj"] = autotune.Tuner(time_fn, 8, 8)
    cfg._first_contact(["cuda:0"])
    assert (cfg.mode, cfg.gpu_layout) == ("fast", "v1") and released == [1] and "_tuner_obj" not in cfg.__dict__
    cfg._first_contact(["cuda:0"])  # judged once
    assert checked == ["cuda:0"]

    ok = ZipServConfig(prefer="speed", mode="fast")
    ok.__dict__["_tuner_obj"] = kept = object()
    ok._first_contact(["cuda:1"])
    assert (ok.mode, ok.gpu_layout) == ("fast", "bytesplit") and ok.__dict__["_tuner_obj"] is kept

    exact = ZipServConfig(prefer="speed", mode="exact")
    exact._first_contact(["cuda:0"])  # exact mode runs no check
    assert checked == ["cuda:0", "cuda:1"]
    assert ZipServConfig().gpu_layout == "v1"  # prefer: memory keeps v1 on a GPU
    assert "_contacted" not in pickle.loads(pickle.dumps(cfg)).__getstate__()


def test_version_is_the_bottom_layer_and_words_the_registration_warning(monkeypatch):
    """version.py imports no plugin module (compat and log build on it: no import cycle), and gives
    the one line register() logs for a vLLM outside the tested series."""
    import ast
    from pathlib import Path

    from zipserv_vllm.vllm_plugin import version

    tree = ast.parse(Path(version.__file__).read_text())
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0]
    assert relative == [], [ast.unparse(n) for n in relative]
    monkeypatch.delenv("ZIPSERV_SKIP_VLLM_VERSION_CHECK", raising=False)
    monkeypatch.setattr(version, "vllm_version", lambda: "0.34.2")
    assert version.unsupported_warning() is None
    monkeypatch.setattr(version, "vllm_version", lambda: "0.40.1")
    assert "vLLM 0.40.1 is newer than the releases" in version.unsupported_warning()
    monkeypatch.setattr(version, "vllm_version", lambda: "0.31.2")
    assert "found vLLM 0.31.2" in version.unsupported_warning()
