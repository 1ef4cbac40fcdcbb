"""The ``zipserv`` command: round trips, summaries, and one clear line for every bad input.

Budget: about 15 s (tiny models; one subprocess proves that no traceback reaches stderr).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

pytest.importorskip("transformers")

from zipserv_vllm.cli import main  # noqa: E402
from zipserv_vllm.format import spec  # noqa: E402
from zipserv_vllm.testing import build_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(hidden_size=128, intermediate_size=200, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=512)
Q = "model.layers.0.self_attn.q_proj"


def load_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def run(args, capsys) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    # The only other line allowed is the one-time "slow reference codec" warning of a build without _C.
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("zipserv: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("zipserv: error: "), err
    assert "Traceback" not in err
    return lines[0]


def no_staging_left(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    src = build_tiny_model(root / "src", **SMALL)
    assert main(["compress", str(src), str(root / "zs")]) == 0
    return src, root / "zs"


def mutate(zs: Path, tmp_path: Path, fn) -> Path:
    """A copy of the compressed checkpoint ``zs`` with its single shard rewritten by ``fn(tensors)``."""
    bad = tmp_path / "bad"
    shutil.copytree(zs, bad)
    tensors = load_all(bad)
    fn(tensors)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


# ------------------------------------------------------------------------------ round trip
@pytest.mark.parametrize("arch, sharded", [("llama", True), ("qwen2", False)])
def test_cli_round_trip(tmp_path, capsys, arch, sharded):
    src = build_tiny_model(tmp_path / "src", arch, intermediate_size=700, sharded=sharded, max_shard_bytes=600_000)
    zs, out = tmp_path / "zs", tmp_path / "out"
    rc, text, err = run(["compress", src, zs, "--max-shard-size", "800kB", "--threads", "2"], capsys)
    assert rc == 0, err
    assert f"compressed {src} -> {zs}:" in text
    total_row = [ln for ln in text.splitlines() if ln.startswith("total")]
    assert len(total_row) == 1
    for kind in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down", "embedding",
                 "uncompressed", "compressed"):
        assert any(ln.startswith(kind + " ") for ln in text.splitlines()), kind
    assert any(ln.startswith("lm_head") for ln in text.splitlines()) == (arch == "llama")  # qwen2 is tied

    rc, text, err = run(["verify", zs, "--against", src], capsys)
    assert rc == 0, err
    assert text.startswith(f"OK {zs}:") and f"bit-identical to {src}" in text

    rc, text, err = run(["inspect", zs, "--json"], capsys)
    assert rc == 0, err
    info = json.loads(text)
    assert info["compressed"] and info["format_version"] == 1 and info["mode"] == "fast"
    orig = load_all(src)
    rows = {r["name"]: r for r in info["tensors"]}
    assert rows.keys() == orig.keys()
    up = rows["model.layers.0.mlp.up_proj.weight"]
    assert up["compressed"] and up["shape"] == [700, 256] and up["original_bytes"] == 700 * 256 * 2
    assert up["bits_per_weight"] == pytest.approx(8 * up["bytes"] / (700 * 256), abs=1e-3)
    assert 0.5 < up["coverage"] <= 1.0
    assert rows["model.norm.weight"]["compressed"] is False and rows["model.norm.weight"]["coverage"] is None
    stored = sum(v.numel() * v.element_size() for v in load_all(zs).values())
    assert info["totals"]["bytes_after"] == stored
    assert info["totals"]["bytes_before"] == sum(v.numel() * v.element_size() for v in orig.values())
    assert (len(info["shards"]) > 1) == (zs / "model.safetensors.index.json").exists()
    # The human-readable table prints the same totals.
    rc, text, _ = run(["inspect", zs], capsys)
    assert rc == 0 and "window coverage of compressed weights" in text and up["name"] in text

    rc, text, err = run(["decompress", zs, out], capsys)
    assert rc == 0, err
    back = load_all(out)
    assert back.keys() == orig.keys()
    for k, v in orig.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), k
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert no_staging_left(tmp_path)


def test_overwrite(small, tmp_path, capsys):
    src, zs = small
    dst = tmp_path / "zs"
    shutil.copytree(zs, dst)
    (dst / "stale.txt").write_text("from the old run")
    rc, _, err = run(["compress", src, dst], capsys)
    assert rc == 2 and one_error_line(err) == f"zipserv: error: {dst}: already exists (use --overwrite to replace it)"
    assert (dst / "stale.txt").exists()
    rc, _, err = run(["compress", src, dst, "--overwrite"], capsys)
    assert rc == 0, err
    assert not (dst / "stale.txt").exists() and no_staging_left(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    rc, _, err = run(["decompress", dst, out], capsys)
    assert rc == 2 and "already exists" in one_error_line(err)
    assert run(["decompress", dst, out, "--overwrite"], capsys)[0] == 0


# ------------------------------------------------------------------------------ bad input
def test_missing_and_unreadable_paths(small, tmp_path, capsys):
    src, zs = small
    for cmd in (["compress", tmp_path / "nope", tmp_path / "o"], ["verify", tmp_path / "nope"],
                ["inspect", tmp_path / "nope"], ["decompress", tmp_path / "nope", tmp_path / "o"]):
        rc, _, err = run(cmd, capsys)
        assert rc == 2 and one_error_line(err) == f"zipserv: error: {tmp_path / 'nope'}: no such file or directory"
    f = tmp_path / "file.txt"
    f.write_text("x")
    rc, _, err = run(["inspect", f], capsys)
    assert rc == 2 and "not a directory" in one_error_line(err)
    rc, _, err = run(["compress", src, tmp_path / "no" / "such" / "parent"], capsys)
    assert rc == 2 and "no such directory" in one_error_line(err)
    rc, _, err = run(["verify", zs, "--against", tmp_path / "nope"], capsys)
    assert rc == 2 and "no such file or directory" in one_error_line(err)
    assert not (tmp_path / "o").exists() and no_staging_left(tmp_path)


def test_not_a_checkpoint(small, tmp_path, capsys):
    src, _ = small
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run(["compress", empty, tmp_path / "o"], capsys)
    assert rc == 2 and one_error_line(err) == f"zipserv: error: {empty}: not a Hugging Face checkpoint (no config.json)"
    (empty / "config.json").write_text("{}")
    (empty / "model.pt").write_bytes(b"")
    rc, _, err = run(["compress", empty, tmp_path / "o"], capsys)
    assert rc == 2 and one_error_line(err) == (
        f"zipserv: error: {empty}: not a checkpoint: no *.safetensors or pytorch_model*.bin files "
        "(found model.pt: zipserv reads safetensors and pytorch_model*.bin checkpoints)")
    (empty / "pytorch_model.bin").write_bytes(b"")
    rc, _, err = run(["compress", empty, tmp_path / "o"], capsys)
    assert rc == 2 and one_error_line(err) == (f"zipserv: error: {empty / 'pytorch_model.bin'}: not a readable "
                                               "PyTorch checkpoint (EOFError); truncated or corrupt?")
    (empty / "config.json").write_text("{not json")
    rc, _, err = run(["compress", empty, tmp_path / "o"], capsys)
    assert rc == 2 and "config.json: invalid JSON" in one_error_line(err)
    rc, _, err = run(["verify", src], capsys)
    assert rc == 2 and "not a zipserv checkpoint" in one_error_line(err)
    rc, _, err = run(["decompress", src, tmp_path / "o"], capsys)
    assert rc == 2 and "not a zipserv checkpoint" in one_error_line(err)
    assert not (tmp_path / "o").exists() and no_staging_left(tmp_path)


@pytest.mark.parametrize("dtype, code", [("float16", "F16"), ("float32", "F32")])
def test_refuses_non_bf16(tmp_path, capsys, dtype, code):
    src = build_tiny_model(tmp_path / "src", dtype=dtype, **SMALL)
    rc, _, err = run(["compress", src, tmp_path / "o"], capsys)
    line = one_error_line(err)
    assert rc == 2 and f"tensor lm_head.weight is {code}, not BF16" in line and "lossless" in line
    assert "`--dtype bfloat16`" in line  # the error names the flag
    assert not (tmp_path / "o").exists() and no_staging_left(tmp_path)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_dtype_bfloat16_casts_as_vllm_does(tmp_path, capsys, dtype):
    """--dtype bfloat16: each compressed weight is the source's cast by Tensor.to (round to nearest
    even, what vLLM's param.data.copy_ does); other tensors are copied as they are; verify --against
    compares with the cast source."""
    src = build_tiny_model(tmp_path / "src", dtype=dtype, **SMALL)
    rc, out, err = run(["compress", src, tmp_path / "zs", "--dtype", "bfloat16"], capsys)
    assert rc == 0, err
    cfg = json.loads((tmp_path / "zs" / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16" and cfg["quantization_config"]["source_dtype"] == dtype
    assert run(["decompress", tmp_path / "zs", tmp_path / "back"], capsys)[0] == 0
    orig, back = load_all(src), load_all(tmp_path / "back")
    compressed = cfg["quantization_config"]["compressed_modules"]
    assert compressed and set(orig) == set(back)
    for name, t in orig.items():
        if name[: -len(".weight")] in compressed:
            assert back[name].dtype == torch.bfloat16
            assert torch.equal(back[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), name
        else:
            assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    rc, out, err = run(["verify", tmp_path / "zs", "--against", src], capsys)
    assert rc == 0 and f"(its {dtype} weights cast to BF16 as vLLM casts them)" in out, err
    with pytest.raises(SystemExit) as exc:
        main(["compress", str(src), str(tmp_path / "o2"), "--dtype", "float8"])
    assert exc.value.code == 2 and "invalid choice: 'float8'" in capsys.readouterr().err


def test_refuses_quantized_source(small, tmp_path, capsys):
    src, zs = small
    rc, _, err = run(["compress", zs, tmp_path / "o"], capsys)
    assert rc == 2 and "already quantized" in one_error_line(err) and "'zipserv'" in err
    other = tmp_path / "gptq"
    shutil.copytree(src, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (other / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run(["compress", other, tmp_path / "o"], capsys)
    assert rc == 2 and "quant_method 'gptq'" in one_error_line(err)


@pytest.mark.parametrize("damage", ["truncate", "short", "garbage"])
@pytest.mark.parametrize("which", ["source", "compressed"])
def test_truncated_or_corrupt_shards(small, tmp_path, capsys, damage, which):
    src, zs = small
    bad = tmp_path / "bad"
    shutil.copytree(src if which == "source" else zs, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2], "short": data[:5],
                   "garbage": b"\x20\x00\x00\x00\x00\x00\x00\x00{this is not a safetensors header}"}[damage])
    cmds = [["compress", bad, tmp_path / "o"]] if which == "source" else \
        [["verify", bad], ["inspect", bad], ["decompress", bad, tmp_path / "o"]]
    for cmd in cmds:
        rc, _, err = run(cmd, capsys)
        line = one_error_line(err)
        assert rc == 2 and f"{f}: not a readable safetensors file" in line, line
    assert not (tmp_path / "o").exists() and no_staging_left(tmp_path)


def test_sharded_index_problems(tmp_path, capsys):
    src = build_tiny_model(tmp_path / "src", sharded=True, max_shard_bytes=200_000, **SMALL)
    zs = tmp_path / "zs"
    assert run(["compress", src, zs, "--max-shard-size", "200kB"], capsys)[0] == 0
    shards = sorted(zs.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    rc, _, err = run(["verify", zs], capsys)
    assert rc == 2 and f"shard {shards[-1].name} listed in model.safetensors.index.json does not exist" in one_error_line(err)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = next(iter(index["weight_map"].values()))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, _, err = run(["compress", src, tmp_path / "o"], capsys)
    assert rc == 2 and "tensor model.extra.weight listed in model.safetensors.index.json is missing" in one_error_line(err)


def test_unknown_format_version(small, tmp_path, capsys):
    _, zs = small
    bad = tmp_path / "v2"
    shutil.copytree(zs, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 2
    (bad / "config.json").write_text(json.dumps(cfg))
    for cmd in (["verify", bad], ["inspect", bad], ["decompress", bad, tmp_path / "o"]):
        rc, _, err = run(cmd, capsys)
        assert rc == 2 and "format version 2 is not supported by this zipserv-vllm (supported: 1)" in one_error_line(err)

    def bump(t):
        t[f"{Q}.zs_meta"][1] = 2  # as a later zipserv would write it: with its checksum
        t[f"{Q}.zs_meta"][5] = spec.meta_checksum(t[f"{Q}.zs_meta"].tolist())

    bad2 = mutate(zs, tmp_path / "m", bump)
    for cmd in (["verify", bad2], ["inspect", bad2], ["decompress", bad2, tmp_path / "o"]):
        rc, _, err = run(cmd, capsys)
        assert rc == 2 and one_error_line(err) == (f"zipserv: error: {Q}.weight: format version 2 is not supported "
                                                   "by this zipserv-vllm (supported: 1)")
    assert not (tmp_path / "o").exists() and no_staging_left(tmp_path)


def test_missing_zs_array(small, tmp_path, capsys):
    _, zs = small
    bad = mutate(zs, tmp_path, lambda t: t.pop(f"{Q}.zs_fb"))
    for cmd in (["verify", bad], ["inspect", bad], ["decompress", bad, tmp_path / "o"]):
        rc, _, err = run(cmd, capsys)
        assert rc == 2 and one_error_line(err) == f"zipserv: error: {Q}.weight: missing zs_fb"
    assert not (tmp_path / "o").exists()


def test_crc_mismatch(small, tmp_path, capsys):
    """A flipped mantissa byte decodes fine but to other bits: the CRC catches it."""
    src, zs = small

    def flip(t):
        t[f"{Q}.zs_sm"][3] ^= 0x01

    bad = mutate(zs, tmp_path, flip)
    rc, _, err = run(["verify", bad], capsys)
    lines = err.splitlines()
    assert rc == 1 and lines[0].startswith(f"zipserv: verify: {Q}.weight: CRC mismatch (stored ")
    assert lines[-1].startswith(f"zipserv: error: verification of {bad} failed: 1 mismatch (first: {Q}.weight: CRC")
    assert "Traceback" not in err
    rc, _, err = run(["verify", bad, "--against", src], capsys)
    assert rc == 1 and f"zipserv: verify: {Q}.weight: differs from {src} (the bits differ)" in err
    rc, _, err = run(["decompress", bad, tmp_path / "o"], capsys)
    assert rc == 2 and one_error_line(err).startswith(f"zipserv: error: {Q}.weight: CRC mismatch")
    assert not (tmp_path / "o").exists() and no_staging_left(tmp_path)


def test_verify_against_other_model(small, tmp_path, capsys):
    src, zs = small
    other = build_tiny_model(tmp_path / "other", seed=1, **SMALL)
    rc, _, err = run(["verify", zs, "--against", other], capsys)
    assert rc == 1
    # Every random weight differs; the norms (all ones) match.
    assert f"zipserv: verify: {Q}.weight: differs from {other} (the bits differ)" in err
    assert "model.norm.weight" not in err
    qwen = build_tiny_model(tmp_path / "qwen", "qwen2", **SMALL)
    rc, _, err = run(["verify", zs, "--against", qwen], capsys)
    assert rc == 1 and f"{Q}.bias: in {qwen} but missing from {zs}" in err
    assert f"lm_head.weight: in {zs} but not in {qwen}" in err


def test_bad_arguments_exit_2(small, tmp_path, capsys):
    src, _ = small
    for args in (["compress", src, tmp_path / "o", "--max-shard-size", "5XB"],
                 ["compress", src, tmp_path / "o", "--threads", "0"], ["frobnicate"], []):
        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in args])
        assert exc.value.code == 2
    assert "invalid size '5XB'" in capsys.readouterr().err


def test_subprocess_error_has_no_traceback(tmp_path):
    """Through the real entry point (python -m zipserv_vllm.cli), offline: one stderr line, exit 2, no output."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "zipserv_vllm.cli", "compress", "no-such-org/no-such-model",
                        str(tmp_path / "o")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    line = one_error_line(r.stderr)
    assert line.startswith("zipserv: error: no-such-org/no-such-model: no such directory, and fetching it from the "
                           "Hugging Face Hub failed (")
    assert r.stdout == ""
    assert not (tmp_path / "o").exists() and no_staging_left(tmp_path)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_compress_leaves_no_directory(small, tmp_path, capsys, monkeypatch, exc):
    """Ctrl-C (exit 130, one line) or an internal error (raised) part-way: no DST, no temp dir."""
    import zipserv_vllm.checkpoint.convert as convert

    src, _ = small
    real, calls = convert.compress_tensor, []

    def flaky(t, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise exc("simulated failure")
        return real(t, **kw)

    monkeypatch.setattr(convert, "compress_tensor", flaky)
    dst = tmp_path / "zs"
    if exc is KeyboardInterrupt:
        rc, _, err = run(["compress", src, dst], capsys)
        assert rc == 130 and err.strip() == "zipserv: interrupted (no partial output was left behind)"
    else:
        with pytest.raises(RuntimeError, match="simulated failure"):
            main(["compress", str(src), str(dst)])
    assert len(calls) == 3
    assert not dst.exists() and no_staging_left(tmp_path)


def test_progress_bar(small, tmp_path, capsys):
    src, _ = small
    rc, _, err = run(["compress", src, tmp_path / "zs", "--progress"], capsys)
    assert rc == 0 and "compress" in err and "B/s" in err


def test_destination_is_or_inside_source(small, tmp_path, capsys):
    src, zs = small
    rc, _, err = run(["compress", src, src / "zs"], capsys)
    assert rc == 2 and one_error_line(err) == f"zipserv: error: {src / 'zs'}: the destination is inside the source checkpoint {src}"
    rc, _, err = run(["decompress", zs, zs, "--overwrite"], capsys)
    assert rc == 2 and one_error_line(err) == f"zipserv: error: {zs}: the destination is the source checkpoint"
    assert not (src / "zs").exists() and no_staging_left(src) and no_staging_left(zs.parent)


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_bad_thread_setting_is_one_line(small, tmp_path, capsys, monkeypatch, value):
    src, zs = small
    monkeypatch.setenv("ZIPSERV_THREADS", value)
    for args in (["compress", src, tmp_path / "o"], ["verify", zs], ["decompress", zs, tmp_path / "d"]):
        rc, _, err = run(args, capsys)
        assert rc == 2 and one_error_line(err) == (f"zipserv: error: ZIPSERV_THREADS must be an integer >= 1, "
                                                   f"got {value!r}"), err
    assert not (tmp_path / "o").exists() and not (tmp_path / "d").exists() and no_staging_left(tmp_path)
    monkeypatch.setenv("ZIPSERV_THREADS", "2")
    assert run(["verify", zs], capsys)[0] == 0


@pytest.mark.parametrize("shape", [(0, 64), (64, 0)])
def test_weight_with_a_zero_dimension_is_kept_as_is(tmp_path, capsys, shape):
    """An empty 2-D weight has nothing to compress: copied unchanged, named with the reason (no traceback)."""
    src = build_tiny_model(tmp_path / "src", **SMALL)
    t = load_all(src)
    t["model.layers.0.extra.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    rc, out, err = run(["compress", src, tmp_path / "zs"], capsys)
    assert rc == 0, err
    assert "Traceback" not in err and f"an empty weight (shape {list(shape)}): nothing to compress" in out, out
    assert "model.layers.0.extra.weight" in out
    got = load_all(tmp_path / "zs")
    assert got["model.layers.0.extra.weight"].shape == shape
    assert run(["verify", tmp_path / "zs", "--against", src], capsys)[0] == 0


def test_verify_says_when_no_crc_is_stored(small, tmp_path, capsys):
    """A zs_meta without its CRC-32 is never reported as "decoded with matching CRC-32"."""
    src, zs = small

    def drop_crc(t):
        t[f"{Q}.zs_meta"][4] = -1  # as a writer that stored no CRC would (its checksum agrees)
        t[f"{Q}.zs_meta"][5] = spec.meta_checksum(t[f"{Q}.zs_meta"].tolist())

    bad = mutate(zs, tmp_path, drop_crc)
    rc, out, err = run(["verify", bad], capsys)
    assert rc == 0, err
    assert "decoded with matching CRC-32" not in out
    assert f"1 with no CRC stored ({Q}.weight; its tiles checked against zs_crc; NOT compared with a CRC-32)" in out, out

    def flip_too(t):  # no CRC and a flipped byte: the tile checksums still catch it
        drop_crc(t)
        t[f"{Q}.zs_sm"][3] ^= 0x01

    bad2 = mutate(zs, tmp_path / "b2", flip_too)
    rc, _, err = run(["verify", bad2], capsys)
    assert rc == 1 and f"zipserv: verify: {Q}.weight: tile (0, 0) does not match its checksum" in err, err


def test_verify_refuses_a_checkpoint_where_only_some_matrices_have_tile_checksums(small, tmp_path, capsys):
    _, zs = small
    bad = mutate(zs, tmp_path, lambda t: t.pop(f"{Q}.zs_crc"))
    rc, _, err = run(["verify", bad], capsys)
    assert rc == 1 and f"zipserv: verify: {Q}.zs_crc is missing, while " in err and "damaged or edited" in err, err
    everywhere = mutate(zs, tmp_path / "old", lambda t: [t.pop(k) for k in [k for k in t if k.endswith(".zs_crc")]])
    assert run(["verify", everywhere], capsys)[0] == 0  # a checkpoint from before tile checksums: fine
