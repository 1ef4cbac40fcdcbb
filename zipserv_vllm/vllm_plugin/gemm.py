"""Exact mode's GEMM: the very kernel vLLM's unquantized path would run.

vLLM's unquantized linear layers do not call ``F.linear`` on CPU: at load time
``dispatch_cpu_unquantized_gemm`` picks a kernel for the weight's shape and
CPU (SGL ``weight_packed_linear`` with AMX for small weights, a prepacked
oneDNN matmul otherwise, zentorch on Zen builds, ``F.linear`` as fallback) and
stores it as ``layer.cpu_linear`` (vllm-plugin-notes, pitfall 5). Exact mode
decodes the weight and hands it to that same dispatcher on a throw-away holder,
so the product is computed by the same kernel, with the same packing and bias
dtype, as in the BF16 model: outputs are bit-identical. On other platforms it
uses vLLM's ``dispatch_unquantized_gemm()`` the same way.

The packed copy lives only for the call (caching it would keep a BF16-sized
copy and undo the compression).

Under torch.compile the GEMM must also be *compiled* the way the BF16 model's
is. Where vLLM's dispatcher falls back to plain ``F.linear`` (a CPU whose oneDNN
cannot build a BF16 matmul, e.g. AVX2 without AVX512-BF16), the BF16 model's
traced graph holds an ``aten.addmm`` / ``aten.mm`` that Inductor lowers (and
may split its bias add into a neighbouring fused kernel); an opaque op doing
``F.linear`` eagerly would round differently. So exact mode learns at load time
which kernel vLLM picks for each weight shape (:func:`note_shape`) and, when
traced, emits the same ``F.linear`` on the decoded weight for the fallback, and
the opaque op (:func:`exact_linear_op`, the same prepacked kernel as the BF16
layer's own opaque call) otherwise.
"""

from __future__ import annotations

import torch


class _GemmHolder:
    """The attributes ``dispatch_cpu_unquantized_gemm`` reads and writes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight
        # The dispatcher may convert the bias in place (.data = bias.float()); use a private handle.
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)


# (rows, cols) of a BF16 weight -> True where vLLM's CPU dispatcher runs plain F.linear for it
_PLAIN_LINEAR: dict[tuple[int, int], bool] = {}


def _is_plain_linear(fn) -> bool:
    """``fn`` is vLLM's fallback ``lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)``
    (or F.linear itself): it computes with the weight it is given and torch.compile traces it."""
    if fn is torch.nn.functional.linear:
        return True
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_names == ("torch", "nn", "functional", "linear")


def note_shape(rows: int, cols: int) -> bool:
    """Which GEMM vLLM's unquantized layer runs for a ``[rows, cols]`` BF16 weight on this host
    (True: plain F.linear), found once per shape by running vLLM's dispatcher on a weight of that
    shape (the choice depends on the shape, the dtype and the CPU, never on the values)."""
    from . import compat

    key = (int(rows), int(cols))
    if key not in _PLAIN_LINEAR:
        if not compat.find("current_platform").is_cpu():
            # vLLM's GPU layers call the function dispatch_unquantized_gemm() returns, for every shape
            # (plain F.linear on CUDA; not run here: no GPU)
            _PLAIN_LINEAR[key] = _is_plain_linear(compat.find("dispatch_unquantized_gemm")())
        else:
            holder = _GemmHolder(torch.empty(key, dtype=torch.bfloat16), None)
            compat.find("dispatch_cpu_unquantized_gemm")(holder, remove_weight=False)
            _PLAIN_LINEAR[key] = _is_plain_linear(holder.cpu_linear)
    return _PLAIN_LINEAR[key]


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` by the kernel vLLM's unquantized layer would use."""
    from . import compat

    holder = _GemmHolder(weight, bias)
    if compat.find("current_platform").is_cpu():
        compat.find("dispatch_cpu_unquantized_gemm")(holder, remove_weight=False)
        return holder.cpu_linear(x, weight, holder.bias)
    return compat.find("dispatch_unquantized_gemm")()(holder, x, weight, bias)


def bf16_linear_factory(weight: torch.Tensor):
    """``f(x) = x @ weight.T`` by vLLM's own unquantized kernel, prepared once (prepacked, as a BF16
    layer's would be): the baseline the CPU dispatcher measures against (kernels/cpu_dispatch.py)."""
    from . import compat

    holder = _GemmHolder(weight, None)
    if compat.find("current_platform").is_cpu():
        compat.find("dispatch_cpu_unquantized_gemm")(holder, remove_weight=False)
        return lambda x: holder.cpu_linear(x, weight, None)
    gemm = compat.find("dispatch_unquantized_gemm")()
    return lambda x: gemm(holder, x, weight, None)


@torch.library.custom_op("zipserv::exact_linear", mutates_args=())
def exact_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`exact_linear` as an opaque op, so torch.compile can trace exact mode.

    vLLM's dispatcher probes the CPU (``torch.cpu._is_amx_tile_supported``, which
    dynamo refuses to trace) and prepacks the weight into oneDNN handles, neither
    of which can run on traced tensors. Inside the op it runs on the real decoded
    weight; the fake implementation only gives the output shape."""
    return exact_linear(x, weight, bias)


@exact_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def exact_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Eager: :func:`exact_linear` directly (no op-dispatch cost). Traced: ``F.linear`` where vLLM's
    BF16 layer of this shape runs plain ``F.linear`` (:func:`note_shape`, recorded at load time), so
    Inductor compiles both models' GEMMs alike; the opaque op otherwise."""
    if torch.compiler.is_compiling():
        if _PLAIN_LINEAR.get(tuple(weight.shape), False):
            return torch.nn.functional.linear(x, weight, bias)
        return exact_linear_op(x, weight, bias)
    return exact_linear(x, weight, bias)
