"""Compressed checkpoints: reading, writing and converting Hugging Face safetensors directories.

A zipserv checkpoint (docs/FORMAT.md section 7) is a Hugging Face directory
whose ``config.json`` declares ``quantization_config.quant_method = "zipserv"``
and whose shards store each compressed ``P.weight`` as the six arrays
``P.zs_meta`` ... ``P.zs_fb``. The ``zipserv`` command (``zipserv_vllm.cli``)
is a thin layer over the functions exported here; the vLLM plugin uses
``compressible``, ``is_compressed_checkpoint`` and ``Checkpoint`` as well.
"""

from .convert import (
    DEFAULT_MAX_SHARD_BYTES,
    CompressReport,
    DecompressReport,
    KindStats,
    SizeSummary,
    VerifyReport,
    compress_checkpoint,
    coverage,
    crc32_of,
    decompress_checkpoint,
    inspect_checkpoint,
    iter_tensors,
    verify_checkpoint,
)
from .files import resolve_source, staged_directory
from .names import KINDS, QUANT_METHOD, compressible, layer_kind, module_name, parse_size, split_array_name
from .reader import Checkpoint, CheckpointError, Entry, is_compressed_checkpoint, zipserv_config
from .writer import ShardWriter

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES", "KINDS", "QUANT_METHOD", "Checkpoint", "CheckpointError", "CompressReport",
    "DecompressReport", "Entry", "KindStats", "ShardWriter", "SizeSummary", "VerifyReport", "compress_checkpoint",
    "compressible", "coverage", "crc32_of", "decompress_checkpoint", "inspect_checkpoint", "is_compressed_checkpoint",
    "iter_tensors", "layer_kind", "module_name", "parse_size", "resolve_source", "split_array_name",
    "staged_directory", "verify_checkpoint", "zipserv_config",
]
