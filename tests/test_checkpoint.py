"""zipserv_vllm.checkpoint: compressed checkpoints round-trip bit for bit, stream, and stage their output.

Budget: a few seconds (tiny models only), with or without the native codec.
"""

from __future__ import annotations

import json
import shutil
import weakref
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

pytest.importorskip("transformers")

from zipserv_vllm import compress_tensor, decompress_tensor  # noqa: E402
from zipserv_vllm.checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointError,
    ShardWriter,
    compress_checkpoint,
    compressible,
    decompress_checkpoint,
    inspect_checkpoint,
    is_compressed_checkpoint,
    iter_tensors,
    layer_kind,
    parse_size,
    verify_checkpoint,
)
from zipserv_vllm.format import CompressedTensor, spec  # noqa: E402
from zipserv_vllm.testing import build_tiny_model  # noqa: E402

SUFFIXES = spec.SUFFIXES


def load_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def shard_of(path: Path) -> dict[str, str]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: f.name for k in sf.keys()})
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(name + ".tmp-") or p.name.startswith(name + ".old-"))


MODELS = {
    "llama": dict(arch="llama"),
    "llama-sharded-odd": dict(arch="llama", intermediate_size=700, sharded=True, max_shard_bytes=600_000),
    "qwen2": dict(arch="qwen2"),
    "qwen2-sharded": dict(arch="qwen2", sharded=True, max_shard_bytes=1_000_000),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: build_tiny_model(root / k, **kw) for k, kw in MODELS.items()}


@pytest.mark.parametrize("model", list(MODELS))
def test_round_trip(models, model, tmp_path):
    src = models[model]
    dst, out = tmp_path / "zs", tmp_path / "plain"
    # A small shard limit on the sharded sources so that the output is sharded too.
    limit = 700_000 if "sharded" in model else 5 * 10**9
    report = compress_checkpoint(src, dst, max_shard_bytes=limit, progress=False)
    assert is_compressed_checkpoint(dst) and not is_compressed_checkpoint(src)
    assert not leftovers(tmp_path, "zs")

    orig = load_all(src)
    stored = load_all(dst)
    where = shard_of(dst)
    compressed = [k for k, v in orig.items() if compressible(k, v)]
    assert compressed and len(report.compressed_modules) == len(compressed)
    for name, t in orig.items():
        if name in compressed:
            prefix = name[: -len(".weight")]
            assert name not in stored
            assert len({where[f"{prefix}.{s}"] for s in SUFFIXES}) == 1, f"{prefix}: arrays split across shards"
            ct = CompressedTensor.from_arrays({s: stored[f"{prefix}.{s}"] for s in SUFFIXES}, name)
            assert ct.crc32 == zlib.crc32(t.view(torch.int16).numpy().tobytes())
            assert torch.equal(decompress_tensor(ct, backend="reference").view(torch.int16), t.view(torch.int16))
        else:
            assert torch.equal(bits(stored[name]), bits(t)), name

    cfg = json.loads((dst / "config.json").read_text())
    q = cfg.pop("quantization_config")
    assert q["quant_method"] == "zipserv" and q["format_version"] == 1 and q["mode"] == "fast"
    assert sorted(q["compressed_modules"]) == sorted(n[: -len(".weight")] for n in compressed)
    assert cfg == json.loads((src / "config.json").read_text())
    for side in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (dst / side).read_bytes() == (src / side).read_bytes()
    if report.shards > 1:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == where
        assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in stored.values())
    else:
        assert not (dst / "model.safetensors.index.json").exists()
    if "sharded" in model:
        assert report.shards > 1

    v = verify_checkpoint(dst, src, progress=False)
    assert v.ok, v.problems
    assert v.compressed == len(compressed) and v.copied == len(orig) - len(compressed)

    info = inspect_checkpoint(dst)
    assert {r["name"] for r in info["tensors"]} == set(orig)
    assert info["totals"]["bytes_after"] == sum(v.numel() * v.element_size() for v in stored.values())

    decompress_checkpoint(dst, out, progress=False)
    back = load_all(out)
    assert back.keys() == orig.keys()
    for name, t in orig.items():
        assert back[name].dtype == t.dtype and torch.equal(bits(back[name]), bits(t)), name
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert verify_checkpoint(dst, out, progress=False).ok


def test_single_file_decompress_is_byte_identical(models, tmp_path):
    """On a single-file source the decompressed files equal the original files byte for byte."""
    src = models["llama"]
    compress_checkpoint(src, tmp_path / "zs", progress=False)
    decompress_checkpoint(tmp_path / "zs", tmp_path / "out", progress=False)
    for f in src.iterdir():
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name


def test_summary_numbers(models, tmp_path):
    """Per-kind totals equal what compressing each tensor on its own gives."""
    src = models["llama-sharded-odd"]
    report = compress_checkpoint(src, tmp_path / "zs", progress=False)
    expect: dict[str, list[int]] = {}
    for name, t in load_all(src).items():
        if compressible(name, t):
            kind, after = layer_kind(name), compress_tensor(t, checksums=True).nbytes
        else:
            kind, after = "uncompressed", t.numel() * t.element_size()
        e = expect.setdefault(kind, [0, 0, 0, 0])
        e[0] += 1
        e[1] += t.numel()
        e[2] += t.numel() * t.element_size()
        e[3] += after
    got = {k: [s.tensors, s.elements, s.before, s.after] for k, s in report.summary.kinds.items() if s.tensors}
    assert got == expect
    assert set(got) == {"attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down", "embedding",
                        "lm_head", "uncompressed"}
    assert got["attn.q"][0] == 2 and got["uncompressed"][0] == 5
    total = report.summary.total
    assert total.before == sum(e[2] for e in expect.values())
    assert total.after == sum(v.numel() * v.element_size() for v in load_all(tmp_path / "zs").values())
    comp = report.summary.compressed
    assert comp.bits_per_weight == pytest.approx(8 * comp.after / comp.elements)
    assert comp.ratio == pytest.approx(comp.before / comp.after)
    assert 1.0 < comp.ratio < 16 / 3  # compression happened; 3 bits/weight of planes is the floor
    info = inspect_checkpoint(tmp_path / "zs")
    assert info["by_kind"]["total"]["bytes_after"] == total.after
    assert info["by_kind"]["mlp.up"]["bytes_before"] == expect["mlp.up"][2]


def test_inspect_coverage_matches_exponent_windows(models, tmp_path):
    """Coverage = share of real elements whose exponent lies in the tile's window (base+1 .. base+7)."""
    src = models["llama-sharded-odd"]
    compress_checkpoint(src, tmp_path / "zs", progress=False)
    info = {r["name"]: r for r in inspect_checkpoint(tmp_path / "zs")["tensors"]}
    ck = Checkpoint.open(tmp_path / "zs")
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        ct = ck.read_compressed(name)
        w = decompress_tensor(ct).view(torch.int16).numpy().view(np.uint16)
        exp = (w.astype(np.int32) >> 7) & 0xFF
        base = np.repeat(np.repeat(ct.base.numpy().astype(np.int32), 64, 0), 64, 1)[: w.shape[0], : w.shape[1]]
        code = exp - base
        expected = float(((code >= 1) & (code <= 7) & (exp != 0)).mean())
        assert info[name]["coverage"] == pytest.approx(expected, abs=1e-6), name
        assert info[name]["shape"] == list(w.shape)
    assert info["model.layers.0.mlp.up_proj.weight"]["shape"] == [700, 256]  # not a multiple of 64


def test_streaming_holds_one_source_tensor(models, tmp_path):
    """compress reads one source tensor, writes it, and drops it before reading the next."""
    alive: set[str] = set()
    peak = [0]

    def hook(name, t):
        alive.add(name)
        weakref.finalize(t, alive.discard, name)
        peak[0] = max(peak[0], len(alive))

    report = compress_checkpoint(models["qwen2-sharded"], tmp_path / "zs", max_shard_bytes=500_000,
                                 progress=False, _on_tensor=hook)
    assert report.summary.total.tensors > 20
    assert peak[0] == 1, f"{peak[0]} source tensors were alive at once"
    assert not alive


def test_shard_writer_keeps_no_tensor_and_aligns(tmp_path):
    w = ShardWriter(tmp_path, max_shard_bytes=100)
    t = torch.arange(10, dtype=torch.int16)
    ref = weakref.ref(t)
    w.add({"a": t, "b": torch.tensor([1, 2, 3], dtype=torch.int64), "c": torch.ones(5, dtype=torch.uint8)})
    del t
    assert ref() is None, "the writer kept the tensor alive"
    w.add({"d": torch.zeros(40, dtype=torch.bfloat16)})  # 49 + 80 > 100: second shard
    w.add({"e": torch.tensor(7.0)})  # a 0-d tensor
    wm = w.finish()
    assert wm == {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00001-of-00002.safetensors", "d": "model-00002-of-00002.safetensors",
                  "e": "model-00002-of-00002.safetensors"}
    got = load_all(tmp_path)
    assert torch.equal(got["a"], torch.arange(10, dtype=torch.int16)) and got["e"].shape == ()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # Every tensor starts at a multiple of its element size (8-byte dtypes first).
    raw = (tmp_path / "model-00001-of-00002.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert (8 + n) % 8 == 0 and header["b"]["data_offsets"][0] == 0


def test_interrupted_compress_leaves_nothing(models, tmp_path):
    calls = []

    def boom(name, t):
        calls.append(name)
        if len(calls) == 6:
            raise KeyboardInterrupt

    dst = tmp_path / "zs"
    with pytest.raises(KeyboardInterrupt):
        compress_checkpoint(models["llama"], dst, progress=False, _on_tensor=boom)
    assert not dst.exists() and not leftovers(tmp_path, "zs")
    # With --overwrite, an interrupted run leaves the previous DST as it was.
    compress_checkpoint(models["llama"], dst, progress=False)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        compress_checkpoint(models["qwen2"], dst, overwrite=True, progress=False, _on_tensor=boom)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before and not leftovers(tmp_path, "zs")
    compress_checkpoint(models["qwen2"], dst, overwrite=True, progress=False)
    assert json.loads((dst / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert not leftovers(tmp_path, "zs")


def test_hub_id_uses_snapshot_download(models, tmp_path, monkeypatch):
    import huggingface_hub

    seen = []

    def fake(repo_id, **kw):
        seen.append(repo_id)
        return str(models["llama"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    compress_checkpoint("some-org/tiny", tmp_path / "zs", progress=False)
    assert seen == ["some-org/tiny"] and is_compressed_checkpoint(tmp_path / "zs")

    def offline(repo_id, **kw):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore text")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match=r"some-org/other: no such directory, and fetching it from the "
                                              r"Hugging Face Hub failed \(OSError: We couldn't connect"):
        compress_checkpoint("some-org/other", tmp_path / "zs2", progress=False)
    assert not (tmp_path / "zs2").exists()


def test_reader_api(models, tmp_path):
    compress_checkpoint(models["qwen2"], tmp_path / "zs", progress=False)
    ck = Checkpoint.open(tmp_path / "zs")
    assert ck.compressed and ck.check_format_version() == 1
    e = ck.entry("model.layers.0.self_attn.q_proj")
    assert e.compressed and e.name == "model.layers.0.self_attn.q_proj.weight"
    ct = ck.read_compressed("model.layers.0.self_attn.q_proj.weight")
    assert ct.shape == (256, 256)
    bias = ck.read_tensor("model.layers.0.self_attn.q_proj.bias")
    orig = load_all(models["qwen2"])
    assert torch.equal(bits(bias), bits(orig["model.layers.0.self_attn.q_proj.bias"]))
    decoded = dict(iter_tensors(tmp_path / "zs", decode=True))
    assert decoded.keys() == orig.keys()
    assert all(torch.equal(bits(decoded[k]), bits(v)) for k, v in orig.items())
    lazy = dict(iter_tensors(tmp_path / "zs"))
    assert isinstance(lazy["model.embed_tokens.weight"], CompressedTensor)


def test_compressible_and_kinds():
    w = torch.empty(4, 4)
    assert compressible("model.layers.0.mlp.down_proj.weight", w)
    assert compressible("lm_head.weight", (10, 4))
    assert not compressible("model.norm.weight", (4, 4))  # 2-D or not, norms stay plain
    assert not compressible("model.layers.0.input_layernorm.weight", (4,))
    assert not compressible("model.layers.0.self_attn.q_proj.bias", (4,))
    assert not compressible("transformer.wpe.weight", (4, 4))
    assert not compressible("conv.weight", (4, 4, 3))
    assert layer_kind("model.layers.3.self_attn.k_proj.weight") == "attn.k"
    assert layer_kind("model.layers.3.self_attn.o_proj.weight") == "attn.o"
    assert layer_kind("model.layers.3.mlp.gate_proj.weight") == "mlp.gate"
    assert layer_kind("model.embed_tokens.weight") == "embedding"
    assert layer_kind("lm_head.weight") == "lm_head"
    assert layer_kind("model.layers.0.block_sparse_moe.router.weight") == "linear.other"
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("1000") == 1000
    assert parse_size("1.5MB") == 1_500_000
    for bad in ("5XB", "", "-1", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_every_source_file_is_accounted_for(models, tmp_path):
    """Every file reaches the output byte for byte (weights in subfolders included, e.g. a
    sentence-transformers Dense layer), except copies of the main weights in other formats,
    which are named; verify --against checks the files too, and decompress restores them."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    shutil.copytree(models["llama"], src)
    (src / "README.md").write_text("# tiny\n")
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (src / "modules.json").write_text('[{"idx": 0, "name": "0", "path": "", "type": "x.Transformer"}]')
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (src / "2_Dense").mkdir()
    save_file({"linear.weight": torch.randn(32, 256).to(torch.bfloat16)}, str(src / "2_Dense" / "model.safetensors"))
    (src / "pytorch_model.bin").write_bytes(b"a PyTorch copy")
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"Meta's copy")
    (src / "original" / "params.json").write_text("{}")
    (src / "extra").mkdir()
    (src / "extra" / "adapter.pth").write_bytes(b"cannot be classified: copied")
    (src / ".cache").mkdir()
    (src / ".cache" / "x").write_text("download cache")
    report = compress_checkpoint(src, tmp_path / "zs", progress=False)
    dst = tmp_path / "zs"
    copied = ["1_Pooling/config.json", "2_Dense/model.safetensors", "extra/adapter.pth", "original/params.json",
              ".gitattributes", "README.md", "modules.json"]
    for rel in copied:
        assert (dst / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert sorted(d[0] for d in report.side.duplicates) == ["original/consolidated.00.pth", "pytorch_model.bin"]
    assert not (dst / "pytorch_model.bin").exists() and not (dst / "original" / "consolidated.00.pth").exists()
    assert not (dst / ".cache").exists() and report.side.ignored == [".cache/"]
    rep = verify_checkpoint(dst, src, progress=False)
    others = [f for f in models["llama"].iterdir() if f.name not in ("config.json", "model.safetensors")]
    assert rep.ok and rep.files_checked == len(copied) + len(others)  # + tokenizer.json, chat_template.jinja...
    (dst / "2_Dense" / "model.safetensors").write_bytes(b"damaged")
    rep = verify_checkpoint(dst, src, progress=False)
    assert [p.split(":")[0] for p in rep.problems] == ["2_Dense/model.safetensors"]
    (dst / "2_Dense" / "model.safetensors").unlink()
    rep = verify_checkpoint(dst, src, progress=False)
    assert rep.problems == [f"2_Dense/model.safetensors: in {src} but missing from {dst}"]
    shutil.copy(src / "2_Dense" / "model.safetensors", dst / "2_Dense" / "model.safetensors")
    decompress_checkpoint(dst, tmp_path / "back", progress=False)
    for rel in copied:
        assert (tmp_path / "back" / rel).read_bytes() == (src / rel).read_bytes(), rel
