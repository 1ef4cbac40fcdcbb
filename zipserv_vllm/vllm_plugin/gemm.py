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
"""

from __future__ import annotations

import torch


class _GemmHolder:
    """The attributes ``dispatch_cpu_unquantized_gemm`` reads and writes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight
        # The dispatcher may convert the bias in place (.data = bias.float()); use a private handle.
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)


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
    """Eager: :func:`exact_linear` directly (no op-dispatch cost); traced: through the op."""
    if torch.compiler.is_compiling():
        return exact_linear_op(x, weight, bias)
    return exact_linear(x, weight, bias)
