"""The zipserv config as vLLM sees it: registration, versions, modes, from_config, preflight."""

from __future__ import annotations

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
    from zipserv_vllm.vllm_plugin import version

    assert version.is_supported(version.vllm_version())  # the installed one is tested
    assert version.is_supported("0.32.0") and version.is_supported("0.32.7+cpu")
    assert not version.is_supported("0.33.0") and not version.is_supported("dev")
    monkeypatch.setattr(version, "vllm_version", lambda: "0.40.1")
    monkeypatch.delenv("ZIPSERV_SKIP_VLLM_VERSION_CHECK", raising=False)
    with pytest.raises(version.UnsupportedVLLMError, match=r"supports vLLM 0\.32\.x, found vLLM 0\.40\.1"):
        version.check_vllm_version()
    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    with pytest.raises(version.UnsupportedVLLMError, match="found vLLM 0.40.1"):
        ZipServConfig()


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


def test_preflight_accepts_a_sound_checkpoint(llama_dirs):
    from zipserv_vllm.vllm_plugin.preflight import check_checkpoint

    counts = check_checkpoint(llama_dirs[1])
    # 16 matrices compressed; the 5 RMSNorm weights stay plain
    assert counts == {"shards": 1, "compressed": 16, "uncompressed_weights": 5}
