"""The TCA-TBE v1 format: constants, the reference codec and CompressedTensor.

Imports no vLLM and needs no native extension.
"""

from . import reference, spec
from .tensor import CompressedTensor, FormatError, grid, high_counts, parse_meta, segment_lengths

__all__ = ["CompressedTensor", "FormatError", "grid", "high_counts", "parse_meta", "reference", "segment_lengths", "spec"]
