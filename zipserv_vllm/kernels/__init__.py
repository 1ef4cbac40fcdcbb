"""Everything that computes on compressed weights, and where each call goes.

* :mod:`.ops`       - the torch.library ops (``zipserv::gemm``, ``::decompress``,
  ``::packed_*``) with their CPU / composite implementations, and ``linear()``;
* :mod:`.embedding` - ``zipserv::embedding`` / ``::packed_embedding``;
* :mod:`.cpu`       - the fused CPU kernels (``zipserv_vllm._cpu_gemm``) and their dispatch;
* :mod:`.cuda`      - the CUDA implementations (``zipserv_vllm._cuda``), registered on the
  ops above for the CUDA dispatch key when the extension is built;
* :mod:`.dispatch`  - which CUDA path (fused ZipGEMM or decoupled) serves a call.

Registration goes one way: the backends import :mod:`.ops` and register on it;
:mod:`.ops` imports no backend at module level. Importing this package
registers everything available.
"""

from . import embedding, ops  # noqa: F401  (defines the ops)
from . import cuda  # noqa: F401,E402  (registers the CUDA kernels where _cuda is built)

__all__ = ["cuda", "embedding", "ops"]
