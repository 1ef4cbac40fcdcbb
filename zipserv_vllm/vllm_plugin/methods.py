"""zipserv's vLLM quantize methods: every linear layer, the embedding and lm_head.

Two ways in, one runtime:

* **pre-compressed** (``ZipServConfig.precompressed``): placeholders record the
  checkpoint's ``.zs_*`` tensors and the first ``process_weights_after_loading``
  loads each rank's tiles into the paged arena (see :mod:`.loading`).
* **pack at load** (a BF16 checkpoint with ``--quantization zipserv``): the
  weight is created on the meta device and vLLM's layer-wise loading
  (``uses_meta_device`` + ``initialize_online_processing``) materialises one layer
  at a time; ``process_weights_after_loading`` compresses it into the arena and
  drops the BF16 copy, so the peak is about the compressed model plus one layer.

At run time ``apply()`` computes ``x @ W.T + b`` from the compressed parts:

* ``exact``: decode (``zipserv::decompress``) and run the GEMM vLLM's
  unquantized layer would run (:func:`.gemm.exact_linear`): bit-identical
  outputs to the BF16 model in eager mode;
* ``fast``: ``zipserv_vllm.linear(x, ct, bias, mode="fast")`` (``zipserv::gemm``),
  where fused decode-GEMM kernels plug in. On the CPU the layers are held in
  the byte-split layout (``PackedTensor``, ``zipserv::packed_gemm``; see
  :mod:`.layouts`), unless ``ZIPSERV_CPU_LAYOUT=v1``; on a GPU with
  ``ZIPSERV_GPU_LAYOUT=bytesplit`` or ``prefer: speed``.

The embedding (``zipserv::embedding``, :mod:`zipserv_vllm.kernels.embedding`) decodes
only what the batch's ids touch: on the CPU each id's row (the 8 FTs per tile that
hold it), elsewhere the tile rows (64 vocabulary rows each) they fall in, then
gathers. Every op used here is a torch.library custom op with a fake
implementation, so vLLM's torch.compile path traces ``apply``/``embedding``.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.nn import Parameter

from ..kernels import embedding as _embedding_op
from ..kernels import ops
from . import compat, errors, layouts, loading, weight_loaders
from .gemm import exact_gemm, note_shape
from .log import logger

LinearMethodBase = compat.find("LinearMethodBase")
UnquantizedLinearMethod = compat.find("UnquantizedLinearMethod")
QuantizeMethodBase = compat.find("QuantizeMethodBase")
UnquantizedEmbeddingMethod = compat.find("UnquantizedEmbeddingMethod")
initialize_online_processing = compat.find("initialize_online_processing")
set_weight_attrs = compat.find("set_weight_attrs")

_STATE = "_zs_state"


def _state(layer) -> loading.LayerState:
    return layer.__dict__[_STATE]


def _full_weight(st: loading.LayerState) -> torch.Tensor:
    """The rank's BF16 weight rebuilt from its parts (zero rows for vocab padding)."""
    ws = [ops.decode(p) for p in st.parts]
    pad = st.rows - st.compressed_rows
    if pad:
        ws.append(torch.zeros(pad, st.cols, dtype=torch.bfloat16, device=ws[0].device))
    return ws[0] if len(ws) == 1 else torch.cat(ws)


def compressed_linear(st: loading.LayerState, x: torch.Tensor, bias: torch.Tensor | None, mode: str) -> torch.Tensor:
    """``x @ W.T + bias`` for the compressed layer ``st`` in ``mode``."""
    if not st.parts:
        raise RuntimeError(f"zipserv: layer {st.prefix} was never loaded")
    if mode == "exact":
        return exact_gemm(x, _full_weight(st), bias)
    if len(st.parts) == 1 and st.parts[0].shape[0] == st.rows:  # (most layers: one part, no padding)
        return ops.linear(x, st.parts[0], bias, mode="fast")
    outs, row = [], 0
    for p in st.parts:
        b = None if bias is None else bias[row : row + p.shape[0]]
        outs.append(ops.linear(x, p, b, mode="fast"))
        row += p.shape[0]
    pad = st.rows - row
    if pad:
        tail = x.new_zeros((*x.shape[:-1], pad))
        if bias is not None:
            tail = tail + bias[row:]
        outs.append(tail)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def compressed_embedding(st: loading.LayerState, ids: torch.Tensor, mode: str = "fast") -> torch.Tensor:
    """Rows ``ids`` of the compressed table (``zipserv::embedding``: decodes only what they touch).

    Exact mode under torch.compile decodes the whole table and gathers with ``F.embedding``, as the BF16
    layer does: Inductor then fuses the gather into its consumers exactly as in the BF16 model's graph
    (it recomputes a gather inside the following residual-add / RMSNorm kernels, whereas an opaque op's
    output is a stored buffer; the two fusions keep different intermediates in fp32, and the logprobs
    differed by up to 2.5e-4 on the tiny Qwen2 model). Eager exact mode needs no such care."""
    if not st.parts:
        raise RuntimeError(f"zipserv: embedding {st.prefix} was never loaded")
    if len(st.parts) != 1 or (mode == "exact" and torch.compiler.is_compiling()):
        return F.embedding(ids, _full_weight(st))
    return _embedding_op.compressed_embedding(ids, st.parts[0], st.rows)


# =========================================================================== base
class _ZipServMethodBase:
    """Shared by the linear and embedding methods."""

    requires_device_loading = False  # zipserv allocates on the target device itself
    kind = "linear"

    def __init__(self, config):
        self.config = config

    def _new_state(self, layer, rows: int, cols: int, expected, orig_loader) -> loading.LayerState:
        st = loading.LayerState(
            prefix=getattr(layer, "prefix", "") or getattr(layer, "_zs_prefix", ""),
            kind=self.kind, rows=rows, cols=cols, device=torch.empty(0).device,
            expected_shards=list(expected), orig_loader=orig_loader, layer_ref=weakref.ref(layer),
        )
        layer.__dict__[_STATE] = st
        self.config.register_state(st)
        return st

    @staticmethod
    def _expected_shards(layer):
        ids = getattr(layer, "shard_ids", None)  # vLLM >= 0.34: every stacked layer names its shards
        if isinstance(ids, tuple) and ids:
            return list(ids)
        if isinstance(layer, compat.find("QKVParallelLinear")):
            return ["q", "k", "v"]
        if isinstance(layer, compat.find("MergedColumnParallelLinear")):
            return list(range(len(layer.output_sizes)))
        return [None]

    # ------------------------------------------------------------ creation
    def _create_precompressed(self, layer, rows, cols, extra) -> None:
        orig = extra.pop("weight_loader", None)
        st = self._new_state(layer, rows, cols, self._expected_shards(layer), orig)
        for name in (*loading.ALL_SUFFIXES, loading.WEIGHT):
            p = Parameter(torch.empty(0, dtype=loading.ARRAY_DTYPES[name]), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, {"weight_loader": weight_loaders.recorder(st, name),
                                 "weight_loader_numel": weight_loaders.RELOAD_NUMEL})
        st.device = layer.weight.device

    def _create_online(self, layer, rows, cols, extra) -> None:
        orig = extra.get("weight_loader")
        st = self._new_state(layer, rows, cols, self._expected_shards(layer), orig)
        st.device = torch.empty(0).device
        w = Parameter(torch.empty(rows, cols, dtype=torch.bfloat16, device="meta"), requires_grad=False)
        layer.register_parameter("weight", w)
        set_weight_attrs(w, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(w, extra)
        if orig is not None:
            w.weight_loader = loading.shard_noting_loader(st, orig)  # which shards arrive (checked before packing)
        # A zipserv checkpoint's arrays cannot update a layer compressed while loading: one clear line.
        for name in loading.ALL_SUFFIXES:
            p = Parameter(torch.empty(0, dtype=loading.ARRAY_DTYPES[name]), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, {"weight_loader": weight_loaders.refuse_arrays(st)})
        initialize_online_processing(layer)

    # ---------------------------------------------------------- processing
    def _process(self, layer) -> None:
        st = _state(layer)
        w = layer.__dict__.get("_parameters", {}).get("weight")
        if st.done and not st.bf16 and st.tied_to is None and w is not None and not w.is_meta \
                and w.numel() == st.rows * st.cols and st.parts:
            # vLLM's layer-wise reload materialised this pack-at-load layer's BF16 weight and
            # loaded the new values into it: encode them, and give the layer its placeholder back.
            loading.check_shards_arrived(st)  # a reload of some shards only would leave rows unset
            weight_loaders.reencode(st, w.data)
            self._placeholder(layer, st, w)
            return
        if st.done:
            st.__dict__.pop("_seen", None)  # a reload has finished this layer
            self.config.finish_loading()  # every layer has been processed once: loading is over
        elif st.tied_to is not None:
            st.done = True
        elif self.config.precompressed:
            self.config.execute_plan()  # loads every recorded layer at once
        if st.bf16 and not getattr(layer, "_zs_unq_done", False):
            self._bf16_process(layer)
        if self.config.mode == "exact" and not st.bf16 and self.kind == "linear":
            # how vLLM's BF16 layer of this shape computes, for the traced GEMM (an embedding's table only
            # meets a GEMM as the lm_head, in vLLM's logits step, which is not compiled)
            note_shape(st.rows, st.cols)
        if st.done:
            return
        w = layer.weight
        if w.is_meta:
            raise loading.ZipServLoadError(f"zipserv: no weights were loaded for {st.prefix}.weight "
                                           f"(the checkpoint has no tensor for this layer)")
        loading.check_shards_arrived(st)
        try:
            reason = self.config.speed_reason([(st.rows, st.cols)])
            if reason:  # the measuring dispatcher's prefer=speed
                logger.info("zipserv: %s kept BF16 (%s)", st.prefix, reason)
                raise ValueError(reason)
            layouts.pack_layer(st, w.data, self.config.arena(w.device),
                               packed=layouts.uses_packed(w.device, self.config.mode))
        except (TypeError, ValueError) as exc:
            st.bf16, st.done, st.path, st.bf16_reason = True, True, "bf16", str(exc)
            self._bf16_process(layer)
            return
        self._placeholder(layer, st, w)

    @staticmethod
    def _placeholder(layer, st: loading.LayerState, w) -> None:
        """The loaded layer's 0-size ``weight``: its loader takes weight updates."""
        layer.weight = Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)
        set_weight_attrs(layer.weight, {"weight_loader": weight_loaders.update_loader(st)})

    def _bf16_process(self, layer) -> None:
        raise NotImplementedError


# ========================================================================= linear
class ZipServLinearMethod(_ZipServMethodBase, LinearMethodBase):
    """Pre-compressed checkpoint: record the ``.zs_*`` tensors, load tiles later."""

    online = False

    def __init__(self, config):
        _ZipServMethodBase.__init__(self, config)
        self._unq: UnquantizedLinearMethod | None = None

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        rows, cols = sum(output_partition_sizes), input_size_per_partition
        if params_dtype != torch.bfloat16:
            # Not a BF16 weight: compressing would not be lossless. vLLM's own path runs it.
            self.config.note_plain(getattr(layer, "prefix", "?"), f"dtype {params_dtype}, not bfloat16")
            self._unq = UnquantizedLinearMethod()
            layer.__dict__[_STATE] = None
            self._unq.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                     output_size, params_dtype, **extra_weight_attrs)
            return
        if self.online:
            self._create_online(layer, rows, cols, extra_weight_attrs)
        else:
            self._create_precompressed(layer, rows, cols, extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        if layer.__dict__.get(_STATE) is None:
            if self._unq is not None and not getattr(layer, "_zs_unq_done", False):
                layer._zs_unq_done = True
                self._unq.process_weights_after_loading(layer)
            return
        try:
            self._process(layer)
        except Exception as exc:
            raise errors.report(exc)

    def _bf16_process(self, layer) -> None:
        if self._unq is None:
            self._unq = UnquantizedLinearMethod()
        layer._zs_unq_done = True
        self._unq.process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        st = layer.__dict__.get(_STATE)
        if st is None or st.bf16:
            return self._unq.apply(layer, x, bias)
        return compressed_linear(st, x, bias, self.config.mode)


class ZipServOnlineLinearMethod(ZipServLinearMethod):
    """Pack at load: BF16 checkpoint compressed layer by layer while vLLM loads it."""

    online = True
    uses_meta_device = True


# ====================================================================== embedding
class ZipServEmbeddingMethod(_ZipServMethodBase, QuantizeMethodBase):
    """``VocabParallelEmbedding`` (input embedding) and ``ParallelLMHead``."""

    online = False
    kind = "embedding"

    def __init__(self, config):
        _ZipServMethodBase.__init__(self, config)
        self._unq = UnquantizedEmbeddingMethod()

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        rows, cols = sum(output_partition_sizes), input_size_per_partition
        if params_dtype != torch.bfloat16:
            self.config.note_plain(getattr(layer, "prefix", "?") or type(layer).__name__,
                                   f"dtype {params_dtype}, not bfloat16")
            layer.__dict__[_STATE] = None
            self._unq.create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                     output_size, params_dtype, **extra_weight_attrs)
            return
        # Llama-style models build the input embedding without a prefix (vllm-plugin-notes section 4).
        layer._zs_prefix = "embed_tokens"
        if self.online:
            self._create_online(layer, rows, cols, extra_weight_attrs)
        else:
            self._create_precompressed(layer, rows, cols, extra_weight_attrs)
        _state(layer).expected_shards = [None]

    def process_weights_after_loading(self, layer) -> None:
        st = layer.__dict__.get(_STATE)
        if st is None:
            if not getattr(layer, "_zs_unq_done", False):
                layer._zs_unq_done = True
                self._unq.process_weights_after_loading(layer)
            return
        try:
            self._process(layer)
        except Exception as exc:
            raise errors.report(exc)

    def _bf16_process(self, layer) -> None:
        layer._zs_unq_done = True
        self._unq.process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        st = layer.__dict__.get(_STATE)
        if st is None or st.bf16:
            return self._unq.apply(layer, x, bias)
        src = st.source()
        if src.bf16:
            return self._unq.apply(src.layer, x, bias)
        return compressed_linear(src, x, bias, self.config.mode)

    def embedding(self, layer, input_):
        st = layer.__dict__.get(_STATE)
        if st is None or st.bf16:
            return self._unq.embedding(layer, input_)
        return compressed_embedding(st.source(), input_, self.config.mode)

    def tie_weights(self, layer, embed_tokens):
        """lm_head shares the embedding's compressed table (no copy)."""
        st, src = layer.__dict__.get(_STATE), embed_tokens.__dict__.get(_STATE)
        if st is None or src is None:
            return self._unq.tie_weights(layer, embed_tokens)
        st.tied_to = src
        st.expected_shards = []
        # Replace the head's own placeholders: nothing is loaded into a tied head.
        for name in list(layer._parameters):
            if name == "weight" or name in loading.ALL_SUFFIXES:
                delattr(layer, name)
        p = Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
        layer.register_parameter("weight", p)
        set_weight_attrs(p, {"weight_loader": weight_loaders.ignore_loader})
        return layer


class ZipServOnlineEmbeddingMethod(ZipServEmbeddingMethod):
    online = True
    uses_meta_device = True
