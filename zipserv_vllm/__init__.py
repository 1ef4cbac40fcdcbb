"""zipserv-vllm: lossless TCA-TBE compressed BF16 weights for vLLM."""

from .codec import compress_tensor, decompress_tensor, native_available
from .format import CompressedTensor, FormatError
from .kernels.ops import linear

__version__ = "0.1.0"

__all__ = ["CompressedTensor", "FormatError", "compress_tensor", "decompress_tensor", "linear", "native_available", "__version__"]
