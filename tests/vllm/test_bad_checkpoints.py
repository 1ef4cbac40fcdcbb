"""Bad pre-compressed checkpoints fail at load with one message naming the tensor.

Each case corrupts a copy of the tiny Llama's compressed checkpoint and checks
that ``LLM(...)`` raises with the expected message. The header-level checks
(missing/unknown tensors, truncated shards, versions) run in vLLM's front-end
before any engine starts; a layer with no tensors at all is caught by the
plugin's completeness check while the engine loads.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from zipserv_vllm.format import spec
from zs_e2e import ENGINE_KW

LAYER = "model.layers.1.self_attn.o_proj"


def _copy(zs, tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(zs, dst)
    return dst


def _edit_tensors(d, fn):
    f = d / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _load(model):
    """Load ``model``; return (the summary's words on how its data was checked, the counts)."""
    from vllm import LLM

    from zs_e2e import _release, load_check

    llm = LLM(model=str(model), **ENGINE_KW)
    try:
        return llm.apply_model(load_check)[0]
    finally:
        _release(llm)


def test_missing_tensor(vllm_env, llama_dirs, tmp_path):
    d = _copy(llama_dirs[1], tmp_path, "missing")
    _edit_tensors(d, lambda t: t.pop(f"{LAYER}.zs_sm"))
    with pytest.raises(Exception, match=rf"{LAYER}\.zs_sm is missing"):
        _load(d)


def test_truncated_shard(vllm_env, llama_dirs, tmp_path):
    d = _copy(llama_dirs[1], tmp_path, "truncated")
    f = d / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 1000)
    with pytest.raises(Exception, match=r"model\.safetensors is truncated: tensor \S+ needs bytes"):
        _load(d)


def test_wrong_format_version_in_config(vllm_env, llama_dirs, tmp_path):
    d = _copy(llama_dirs[1], tmp_path, "version")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"format_version 2 is not supported.*supported: 1"):
        _load(d)


def test_wrong_format_version_in_tensor(vllm_env, llama_dirs, tmp_path):
    d = _copy(llama_dirs[1], tmp_path, "meta_version")

    def bump(t):
        meta = t[f"{LAYER}.zs_meta"].clone()
        meta[1] = 7  # a later format, written with its checksum
        meta[5] = spec.meta_checksum(meta.tolist())
        t[f"{LAYER}.zs_meta"] = meta

    _edit_tensors(d, bump)
    with pytest.raises(Exception, match=rf"{LAYER}\.zs_meta: format version 7 is not supported"):
        _load(d)


def test_damaged_meta_is_refused_in_the_front_end(vllm_env, llama_dirs, tmp_path):
    """A zs_meta whose shape was altered no longer matches its checksum (format minor version 1);
    one whose checksum was dropped (5 values) among others that have one is refused too."""
    d = _copy(llama_dirs[1], tmp_path, "meta_shape")

    def shape(t):
        meta = t[f"{LAYER}.zs_meta"].clone()
        meta[2] = 128
        t[f"{LAYER}.zs_meta"] = meta

    _edit_tensors(d, shape)
    with pytest.raises(Exception, match=rf"{LAYER}\.zs_meta: zs_meta does not match its checksum"):
        _load(d)
    d2 = _copy(llama_dirs[1], tmp_path, "meta_short")
    _edit_tensors(d2, lambda t: t.__setitem__(f"{LAYER}.zs_meta", t[f"{LAYER}.zs_meta"][:5].clone()))
    with pytest.raises(Exception, match=rf"checkpoint tensor {LAYER}\.zs_meta has no checksum, while \S+\.zs_meta "
                                        r"and others do: the checkpoint was damaged or edited"):
        _load(d2)


def test_unexpected_tensor(vllm_env, llama_dirs, tmp_path):
    d = _copy(llama_dirs[1], tmp_path, "unexpected")
    _edit_tensors(d, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.zs_extra", torch.zeros(4, dtype=torch.uint8)))
    with pytest.raises(Exception, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.zs_extra"):
        _load(d)


def test_layer_with_no_tensors(vllm_env, llama_dirs, tmp_path):
    d = _copy(llama_dirs[1], tmp_path, "no_layer")
    _edit_tensors(d, lambda t: [t.pop(k) for k in [k for k in t if k.startswith(LAYER + ".")]])
    with pytest.raises(Exception, match=rf"{LAYER}\.zs_meta is missing"):
        _load(d)


def test_some_matrices_without_tile_checksums_is_refused(vllm_env, llama_dirs, tmp_path):
    """compress writes zs_crc for every matrix: a checkpoint with some missing was damaged or edited."""
    d = _copy(llama_dirs[1], tmp_path, "mixed")
    _edit_tensors(d, lambda t: t.pop(f"{LAYER}.zs_crc"))
    with pytest.raises(Exception, match=rf"zipserv: checkpoint tensor {LAYER}\.zs_crc is missing, while 15 other "
                                        r"compressed matrices have tile checksums"):
        _load(d)


def test_corrupt_offsets(vllm_env, llama_dirs, tmp_path):
    d = _copy(llama_dirs[1], tmp_path, "corrupt")

    def smash(t):
        off = t[f"{LAYER}.zs_offsets"].clone()
        off[-1, -1, 0] = 1 << 40
        t[f"{LAYER}.zs_offsets"] = off

    _edit_tensors(d, smash)
    with pytest.raises(Exception, match=rf"corrupt checkpoint tensor {LAYER}\.weight: tile .* overruns"):
        _load(d)


def _flip_sm_byte(t):
    sm = t[f"{LAYER}.zs_sm"].clone()
    sm[100] ^= 0x01  # one bit of one weight's mantissa: the format stays valid
    t[f"{LAYER}.zs_sm"] = sm


def test_flipped_byte_is_refused_by_the_tile_checksums(vllm_env, llama_dirs, tmp_path):
    d = _copy(llama_dirs[1], tmp_path, "flipped")
    _edit_tensors(d, _flip_sm_byte)
    with pytest.raises(Exception, match=rf"checkpoint tensor {LAYER}\.zs_\* is damaged: tile \(0, 0\) does not "
                                        r"match its checksum"):
        _load(d)


def test_verify_modes(vllm_env, llama_dirs, tmp_path, monkeypatch):
    """ZIPSERV_VERIFY=none loads a damaged checkpoint; on one written without tile checksums
    the default cannot see the damage, and ZIPSERV_VERIFY=full (decode + CRC-32) refuses it."""
    d = _copy(llama_dirs[1], tmp_path, "old")

    def age(t):
        for k in [k for k in t if k.endswith(".zs_crc")]:
            t.pop(k)
        _flip_sm_byte(t)

    _edit_tensors(d, age)
    words, counts = _load(d)  # no checksums to compare: loads, and says the data was NOT checked
    assert counts == {"no checksums": 10} and words.startswith("NOT checked: 10 of 10 layers have no tile "
                                                               "checksums"), words
    monkeypatch.setenv("ZIPSERV_VERIFY", "full")
    with pytest.raises(Exception, match=rf"checkpoint tensor {LAYER}\.zs_\* is damaged: the decoded matrix's CRC-32"):
        _load(d)
    d2 = _copy(llama_dirs[1], tmp_path, "damaged")
    _edit_tensors(d2, _flip_sm_byte)
    monkeypatch.setenv("ZIPSERV_VERIFY", "none")
    _load(d2)
    monkeypatch.setenv("ZIPSERV_VERIFY", "full")  # a matrix whose zs_meta stores no CRC-32: never "full"

    def no_crc(t):
        meta = t[f"{LAYER}.zs_meta"].clone()
        meta[4] = -1  # a writer that stored no CRC-32 (its checksum agrees)
        meta[5] = spec.meta_checksum(meta.tolist())
        t[f"{LAYER}.zs_meta"] = meta

    d3 = _copy(llama_dirs[1], tmp_path, "no_crc")
    _edit_tensors(d3, no_crc)
    words, counts = _load(d3)
    assert counts == {"full": 9, "no CRC stored": 1}, counts
    assert words.startswith(f"NOT checked in full: 1 of 10 layers have no CRC-32 stored in zs_meta (e.g. {LAYER})")
    monkeypatch.setenv("ZIPSERV_VERIFY", "tiles")
    assert _load(llama_dirs[1]) == ("every tile checked", {"tiles": 10})
    monkeypatch.setenv("ZIPSERV_VERIFY", "sometimes")
    with pytest.raises(Exception, match=r"ZIPSERV_VERIFY is 'sometimes'; expected one of tiles, full, none"):
        _load(d2)
