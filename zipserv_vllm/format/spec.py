"""TCA-TBE format v1: the layout constants, mirrored from docs/FORMAT.md.

This module is the single Python definition of the format. Its C++ twin is
``csrc/include/zipserv/format.h``; ``tests/test_spec_agreement.py`` checks that
the two agree.
"""

MAGIC = 0x5A535442  # "ZSTB"
VERSION = 1
SUPPORTED_VERSIONS = (1,)

TILE = 64  # a tile is TILE x TILE elements
TILE_ELEMS = TILE * TILE
FRAG = 8  # a FragTile is FRAG x FRAG
FRAG_ELEMS = FRAG * FRAG
FRAGS_PER_TILE = TILE_ELEMS // FRAG_ELEMS  # 64
PLANES = 3  # bit-planes of the 3-bit code
WINDOW = 7  # exponents covered per tile
MIN_WINDOW_START = 1  # exponent 0 is never coded
MAX_WINDOW_START = 255 - WINDOW + 1  # 249
SM_ALIGN = 16  # sign-mantissa segment alignment, bytes
FB_ALIGN = 8  # fallback segment alignment, elements (16 bytes)
PAD_CODE = 1  # code of a padding element
PAD_SM = 0  # its sign-mantissa byte
META_LEN = 6  # zs_meta: magic, version, M, K, crc32, meta checksum (minor version 1: FORMAT.md section 6)
META_LEN_MINOR0 = 5  # zs_meta of minor version 0 (no meta checksum): read by its own rules
META_LENS = (META_LEN_MINOR0, META_LEN)
NO_CRC = -1

# Names of the stored arrays of one compressed matrix, in spec order.
SUFFIXES = ("zs_meta", "zs_bitmaps", "zs_base", "zs_offsets", "zs_sm", "zs_fb")
# Optional arrays (section 6): the per-tile CRC-32 of the stored bytes.
TILE_CRC = "zs_crc"
OPTIONAL_SUFFIXES = (TILE_CRC,)
ALL_SUFFIXES = SUFFIXES + OPTIONAL_SUFFIXES
TILE_BITMAP_BYTES = PLANES * FRAGS_PER_TILE * 8  # 1536: the first bytes a tile checksum covers


def meta_checksum(values) -> int:
    """The 6th zs_meta value: the zlib CRC-32 of the first five as little-endian int64 bytes."""
    import struct
    import zlib

    return zlib.crc32(struct.pack("<5q", *(int(v) for v in values[:5])))


def frag_row0(f: int) -> int:
    """Row of the top-left element of FT ``f`` inside its tile."""
    return (f // 16) * 16 + (f % 2) * 8


def frag_col0(f: int) -> int:
    """Column of the top-left element of FT ``f`` inside its tile."""
    return ((f // 4) % 4) * 16 + ((f % 4) // 2) * 8


def round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def sm_segment_len(h: int) -> int:
    """Bytes of the sign-mantissa segment of a tile with ``h`` high-frequency elements."""
    return round_up(h, SM_ALIGN)


def fb_segment_len(h: int) -> int:
    """Elements of the fallback segment of a tile with ``h`` high-frequency elements."""
    return round_up(TILE_ELEMS - h, FB_ALIGN)


def constants() -> dict:
    """Every constant, by the name the C++ header exports it under."""
    return {
        "magic": MAGIC,
        "version": VERSION,
        "tile": TILE,
        "frag": FRAG,
        "frags_per_tile": FRAGS_PER_TILE,
        "planes": PLANES,
        "window": WINDOW,
        "min_window_start": MIN_WINDOW_START,
        "max_window_start": MAX_WINDOW_START,
        "sm_align": SM_ALIGN,
        "fb_align": FB_ALIGN,
        "pad_code": PAD_CODE,
        "pad_sm": PAD_SM,
        "meta_len": META_LEN,
        "meta_len_minor0": META_LEN_MINOR0,
        "no_crc": NO_CRC,
        "tile_bitmap_bytes": TILE_BITMAP_BYTES,
        "frag_row0": [frag_row0(f) for f in range(FRAGS_PER_TILE)],
        "frag_col0": [frag_col0(f) for f in range(FRAGS_PER_TILE)],
    }
