"""CompressedTensor: stored arrays, validation messages, cat/narrow argument checks.

These use the reference codec so they hold with or without the native build.
(Equality of cat/narrow with re-encoding over many shapes is in the codec tests.)
"""

import pytest
import torch

from zipserv_vllm import CompressedTensor, FormatError, compress_tensor, decompress_tensor
from zipserv_vllm.format import spec


def _w(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 0.02).to(torch.bfloat16)


def _ref(w):
    return compress_tensor(w, backend="reference")


def test_arrays_roundtrip_and_nbytes():
    ct = _ref(_w(70, 130))
    arrays = ct.arrays()
    assert list(arrays) == list(spec.SUFFIXES)
    first = [spec.MAGIC, spec.VERSION, 70, 130, spec.NO_CRC]
    assert arrays["zs_meta"].tolist() == first + [spec.meta_checksum(first)]
    assert ct.nbytes == sum(t.numel() * t.element_size() for t in arrays.values())
    # Size formula of FORMAT.md section 6.
    g = ct.grid[0] * ct.grid[1]
    assert ct.nbytes == 8 * spec.META_LEN + g * (1536 + 1 + 16) + ct.sm.numel() + 2 * ct.fb.numel()
    again = CompressedTensor.from_arrays(arrays)
    assert again.same_encoding(ct)


def test_unknown_version_and_magic_refused():
    arrays = _ref(_w(64, 64)).arrays()
    arrays["zs_meta"] = arrays["zs_meta"].clone()
    arrays["zs_meta"][1] = 7  # a later format, written with its checksum
    arrays["zs_meta"][5] = spec.meta_checksum(arrays["zs_meta"].tolist())
    with pytest.raises(FormatError, match=r"w\.q: format version 7 is not supported"):
        CompressedTensor.from_arrays(arrays, name="w.q")
    arrays["zs_meta"][1] = spec.VERSION
    arrays["zs_meta"][0] = 1234
    with pytest.raises(FormatError, match="bad magic"):
        CompressedTensor.from_arrays(arrays)


@pytest.mark.parametrize("index,value", [(1, 7), (2, 65), (3, 128), (4, 12345), (5, 0)])
def test_damaged_meta_is_refused_by_its_checksum(index, value):
    """Minor version 1: zs_meta's shape and CRC-32 are covered by its 6th value."""
    arrays = _ref(_w(64, 64)).arrays()
    arrays["zs_meta"] = arrays["zs_meta"].clone()
    arrays["zs_meta"][index] = value
    with pytest.raises(FormatError, match=r"w\.q: zs_meta does not match its checksum .*: its shape or CRC-32 is "
                                          r"damaged"):
        CompressedTensor.from_arrays(arrays, name="w.q")


def test_minor_version_0_meta_is_read_by_its_rules():
    """A zs_meta of 5 values (written before the checksum) still loads."""
    ct = _ref(_w(64, 128))
    arrays = ct.arrays()
    arrays["zs_meta"] = arrays["zs_meta"][:5].clone()
    again = CompressedTensor.from_arrays(arrays)
    assert again.same_encoding(ct) and again.crc32 == ct.crc32
    arrays["zs_meta"] = torch.cat([arrays["zs_meta"], torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(FormatError, match=r"zs_meta must be int64 \[6\] \(or \[5\] before its checksum\)"):
        CompressedTensor.from_arrays(arrays)


def test_missing_array_refused():
    arrays = _ref(_w(64, 64)).arrays()
    del arrays["zs_fb"]
    with pytest.raises(FormatError, match="missing zs_fb"):
        CompressedTensor.from_arrays(arrays, name="layer")


def test_truncated_stream_refused():
    arrays = _ref(_w(128, 64)).arrays()
    arrays["zs_sm"] = arrays["zs_sm"][:-16]
    with pytest.raises(FormatError, match="truncated or corrupt"):
        CompressedTensor.from_arrays(arrays)


def test_misaligned_offset_refused():
    arrays = _ref(_w(128, 64)).arrays()
    arrays["zs_offsets"] = arrays["zs_offsets"].clone()
    arrays["zs_offsets"][1, 0, 0] += 1
    with pytest.raises(FormatError, match=r"tile \(1, 0\)"):
        CompressedTensor.from_arrays(arrays)


def test_wrong_grid_refused():
    arrays = _ref(_w(128, 64)).arrays()
    arrays["zs_meta"] = arrays["zs_meta"].clone()
    arrays["zs_meta"][2] = 300  # claims 5 tile rows, stores 2 (and its checksum agrees)
    arrays["zs_meta"][5] = spec.meta_checksum(arrays["zs_meta"].tolist())
    with pytest.raises(FormatError, match="zs_bitmaps must be"):
        CompressedTensor.from_arrays(arrays)


def test_narrow_requires_tile_alignment():
    ct = _ref(_w(130, 200))
    with pytest.raises(ValueError, match="not tile-aligned"):
        ct.narrow(0, 32, 64)
    with pytest.raises(ValueError, match="not tile-aligned"):
        ct.narrow(1, 0, 100)
    with pytest.raises(ValueError, match="out of range"):
        ct.narrow(1, 192, 64)
    tail = ct.narrow(1, 192, 8)  # reaches the end: allowed
    assert tail.shape == (130, 8)
    w = decompress_tensor(ct, backend="reference")
    assert torch.equal(decompress_tensor(tail, backend="reference").view(torch.int16),
                       w[:, 192:].contiguous().view(torch.int16))


def test_cat_checks():
    a, b = _ref(_w(70, 64)), _ref(_w(64, 64, 1))
    with pytest.raises(ValueError, match="not a multiple of 64"):
        CompressedTensor.cat([a, b])
    with pytest.raises(ValueError, match="columns"):
        CompressedTensor.cat([b, _ref(_w(64, 128))])
    joined = CompressedTensor.cat([b, a])
    assert joined.same_encoding(_ref(torch.cat([_w(64, 64, 1), _w(70, 64)])))


def test_compress_refuses_non_bf16_and_bad_shapes():
    with pytest.raises(TypeError, match="not be lossless"):
        compress_tensor(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D"):
        compress_tensor(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="empty"):
        compress_tensor(torch.zeros(0, 4, dtype=torch.bfloat16))


def test_to_device_keeps_encoding():
    ct = _ref(_w(64, 65))
    assert ct.to("cpu").same_encoding(ct)
