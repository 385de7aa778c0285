"""The Llama decoder-only transformer (also SmolLM2, TinyLlama), computing only new tokens
against a paged KV cache. It is also the shared decoder of the Qwen2, Qwen3 and Mistral
families: their files subclass `LlamaForCausalLM` and change only what differs (attention
biases, q/k RMSNorm, sliding-window attention), through the class attributes of `DecoderSpec`.

Architecture: Touvron et al., "LLaMA" (2023) and "Llama 2" (2023): pre-norm RMSNorm, rotary
position embedding, grouped-query attention, SwiGLU MLP, optional tied LM head. Parameter
names follow the HF checkpoint layout so weights load by name; q/k/v and gate/up are kept as
separate projections (as in the checkpoint) so results match the reference bit for bit as far
as the matmul library allows.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn

from pyserve.distributed.group import TensorParallelGroup
from pyserve.distributed.shard import ShardLayout
from pyserve.forward_batch_info import ForwardBatch
from pyserve.layers.activation import get_act_fn
from pyserve.layers.attention.base import AttentionBackend
from pyserve.layers.layernorm import RMSNorm
from pyserve.layers.linear import linear
from pyserve.layers.logits_processor import LogitsProcessor
from pyserve.layers.rotary_embedding import RotaryEmbedding
from pyserve.model_loader.config import rope_parameters
from pyserve.models.decoder_spec import DENSE, DecoderSpec, layer_sliding_window
from pyserve.models.llama_weights import LlamaWeightsMixin
from pyserve.models.native_decode import build_native_layers, native_decode
from pyserve_kernels import rotary_embedding_
from pyserve_kernels.quant import QuantizedWeight, quantized_embedding

logger = logging.getLogger(__name__)


def _fuse_weight(layers: list[nn.Linear]) -> torch.Tensor:
    """`_fuse` of the layers' weights (which every nn.Linear has)."""
    fused = _fuse(layers, "weight")
    assert fused is not None
    return fused


def _fuse(layers: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """One tensor of the `attr` ("weight" or "bias") rows of all `layers` along dim 0, each
    layer's parameter becoming a view of its rows (loading into the parameters fills the
    fused tensor). The parameters are not initialised yet, so nothing is copied and the fused
    memory stays untouched until loaded. Returns None when the layers have no bias."""
    params = [getattr(layer, attr) for layer in layers]
    if any(p is None for p in params):
        return None
    first = params[0]
    fused = torch.empty(sum(p.shape[0] for p in params), *first.shape[1:], dtype=first.dtype, device=first.device)
    start = 0
    for p in params:
        rows = p.shape[0]
        p.data = fused[start : start + rows]
        start += rows
    return fused


def _linear(in_f: int, out_f: int, bias: bool, dtype: torch.dtype, device: torch.device | str) -> nn.Linear:
    """An nn.Linear whose parameters are allocated but not initialised: the checkpoint (or
    `init_dummy_weights`) fills them, and memory never written, such as the float weight of a
    projection that runs on quantized blocks, never becomes resident."""
    layer = nn.Linear(in_f, out_f, bias=bias, dtype=dtype, device="meta")
    layer.weight = nn.Parameter(torch.empty(out_f, in_f, dtype=dtype, device=device), requires_grad=False)
    if bias:
        layer.bias = nn.Parameter(torch.empty(out_f, dtype=dtype, device=device), requires_grad=False)
    return layer


def _row_parallel_linear(
    tp: TensorParallelGroup | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: Any,
) -> torch.Tensor:
    """`linear` of a row-parallel projection (o_proj, down_proj): with `tp` the ranks' partial
    products summed, then the bias (held whole by every rank) added once; without, `linear`."""
    if tp is None:
        return linear(x, weight, bias, packed)
    out = tp.all_reduce(linear(x, weight, None, packed))
    return out if bias is None else out + bias


class LlamaAttention(nn.Module):
    """Self-attention of one layer: q/k/v projections, rotary, paged attention, o projection.

    forward(hidden [T, hidden], cos/sin [T, head_dim], forward_batch, attn_backend)
    -> [T, hidden].

    With `tp` (tensor parallelism, `pyserve.distributed`) the layer holds its rank's query and
    KV heads (`ShardLayout`): q/k/v are column-parallel, o_proj row-parallel with an
    all-reduce; num_heads and num_kv_heads are then the rank's.
    """

    def __init__(
        self,
        config: Any,
        layer_id: int,
        dtype: torch.dtype,
        device: torch.device | str,
        spec: DecoderSpec = DENSE,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        total_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        if tp is None:
            self.num_heads = total_heads
            self.num_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        else:
            layout = ShardLayout.of(config, tp.rank, tp.size)
            self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.sliding_window = layer_sliding_window(config, layer_id)
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if spec.qkv_bias is None else spec.qkv_bias
        o_bias = bias if spec.o_bias is None else spec.o_bias
        hidden = config.hidden_size
        self.q_proj = _linear(hidden, self.num_heads * self.head_dim, qkv_bias, dtype, device)
        self.k_proj = _linear(hidden, self.num_kv_heads * self.head_dim, qkv_bias, dtype, device)
        self.v_proj = _linear(hidden, self.num_kv_heads * self.head_dim, qkv_bias, dtype, device)
        self.o_proj = _linear(self.num_heads * self.head_dim, hidden, o_bias, dtype, device)
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        self.qk_norm_full = spec.qk_norm_full
        self.clip_qkv: float | None = getattr(config, "clip_qkv", None) if spec.qk_norm_full else None
        if spec.qk_norm_full:  # over every head of q (k) at once: under tp, the rank's heads
            total_kv = getattr(config, "num_key_value_heads", None) or total_heads
            if tp is not None and total_kv % tp.size:  # a replicated KV head would count twice
                raise ValueError(f"--tp-size {tp.size} must divide the {total_kv} KV heads of a whole-k norm")
            q_width, k_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps, dtype, device)
        elif spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None
        self.fuse_projections()

    def fuse_projections(self) -> None:
        """Store q/k/v weights (and biases) in one [q + 2 kv, hidden] tensor, the projections'
        parameters becoming views of it: one GEMM instead of three (about 10% faster on CPU
        for prefill), same HF parameter names, no extra memory."""
        self.qkv_weight = _fuse_weight([self.q_proj, self.k_proj, self.v_proj])
        self.qkv_bias = _fuse([self.q_proj, self.k_proj, self.v_proj], "bias")
        # oneDNN-packed copies (LlamaForCausalLM.prepack_linear_weights) or the checkpoint's
        # quantized blocks (LlamaForCausalLM.load_weights), else None
        self.qkv_packed: torch.Tensor | QuantizedWeight | None = None
        self.o_packed: torch.Tensor | QuantizedWeight | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        forward_batch: ForwardBatch,
        attn_backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = linear(hidden, self.qkv_weight, self.qkv_bias, self.qkv_packed)
        if self.q_norm is not None:
            self._norm_qk_(qkv)
        # rotate the q and k heads in place in the fused row
        rotary_embedding_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attn_backend.forward(
            q, k, v, self.layer_id, self.scaling, forward_batch, sliding_window=self.sliding_window
        )
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return _row_parallel_linear(self.tp, out, self.o_proj.weight, self.o_proj.bias, self.o_packed)

    def _norm_qk_(self, qkv: torch.Tensor) -> None:
        """q and k of the fused rows qkv [T, q_size + 2 kv_size] RMS-normed in place: per head
        (Qwen3) or each token's q (k) whole (OLMoE, which then clips q, k and v to +-clip_qkv
        when its config sets it). The native decoder layer norms the same way
        (kernels/cpu/src/decoder_layer.rs), on the same kernel."""
        assert self.q_norm is not None and self.k_norm is not None
        num_tokens, hd = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        if self.qk_norm_full:
            if self.tp is None:
                q.copy_(self.q_norm(q.contiguous()))
                k.copy_(self.k_norm(k.contiguous()))
            else:
                self._norm_across_ranks_(q, k)
            if self.clip_qkv is not None:
                qkv.clamp_(-float(self.clip_qkv), float(self.clip_qkv))
        else:
            q.copy_(self.q_norm(q.reshape(num_tokens, self.num_heads, hd).contiguous()).view(num_tokens, q_size))
            k.copy_(self.k_norm(k.reshape(num_tokens, self.num_kv_heads, hd).contiguous()).view(num_tokens, kv_size))

    def _norm_across_ranks_(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """OLMoE's whole-q and whole-k RMSNorms when each rank holds some heads: the ranks'
        sums of squares added by one all-reduce ([T, 2] float32), then each rank scales its
        own columns (as pyserve_kernels.reference.rms_norm rounds)."""
        assert self.tp is not None and self.q_norm is not None and self.k_norm is not None
        qf, kf = q.float(), k.float()
        sums = self.tp.all_reduce(torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1)], dim=-1))
        for x, xf, norm, total in ((q, qf, self.q_norm, sums[:, :1]), (k, kf, self.k_norm, sums[:, 1:])):
            mean = total / (x.shape[-1] * self.tp.size)
            x.copy_(norm.weight * (xf * torch.rsqrt(mean + norm.eps)).to(x.dtype))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(act(gate(x)) * up(x)). forward([T, hidden]) -> [T, hidden].

    With `tp`, the rank's slice of the intermediate size: gate/up column-parallel, down
    row-parallel with an all-reduce. intermediate_size: in place of config.intermediate_size
    (a mixture's shared expert)."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallelGroup | None = None,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        bias = bool(getattr(config, "mlp_bias", False))
        hidden, inter = config.hidden_size, intermediate_size or config.intermediate_size
        if tp is not None:  # (ShardLayout.of checked at load that it divides)
            inter //= tp.size
        self.gate_proj = _linear(hidden, inter, bias, dtype, device)
        self.up_proj = _linear(hidden, inter, bias, dtype, device)
        self.down_proj = _linear(inter, hidden, bias, dtype, device)
        self.act_fn = get_act_fn(getattr(config, "hidden_act", "silu"))
        # gate and up as one GEMM whose output is already [gate | up] (parameters are views)
        self.gate_up_weight = _fuse_weight([self.gate_proj, self.up_proj])
        self.gate_up_bias = _fuse([self.gate_proj, self.up_proj], "bias")
        # oneDNN-packed copies or quantized blocks, as LlamaAttention's
        self.gate_up_packed: torch.Tensor | QuantizedWeight | None = None
        self.down_packed: torch.Tensor | QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)
        return _row_parallel_linear(
            self.tp, self.act_fn(gate_up), self.down_proj.weight, self.down_proj.bias, self.down_packed
        )


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)).

    As in SGLang and vLLM, the residual stream is carried beside the block's output and added
    inside the next norm (`fused_add_rms_norm`): forward(hidden, residual, ...) ->
    (mlp output, residual stream before it); residual=None for the first layer, whose input
    is the embedding. The sum of the pair is the block's output.
    """

    def __init__(
        self,
        config: Any,
        layer_id: int,
        dtype: torch.dtype,
        device: torch.device | str,
        spec: DecoderSpec = DENSE,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_id, dtype, device, spec, tp)
        sparse = spec.mlp(config, layer_id, dtype, device, tp) if spec.mlp is not None else None
        self.mlp: nn.Module = sparse if sparse is not None else LlamaMLP(config, dtype, device, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        forward_batch: ForwardBatch,
        attn_backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, forward_batch, attn_backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm. forward -> hidden [T, hidden].

    With `tp` the embedding is vocab-parallel: the rank's rows of the padded vocabulary
    (`ShardLayout.vocab`), each token looked up on the rank that holds it and summed over
    the ranks."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        spec: DecoderSpec = DENSE,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start = 0
        embed_rows = config.vocab_size
        if tp is not None:
            layout = ShardLayout.of(config, tp.rank, tp.size)
            self.vocab_start, embed_rows = layout.vocab_start, layout.vocab
        # allocated, not initialised (as `_linear`'s parameters); given as `_weight`, not made
        # on "meta" and replaced: initialising a meta embedding runs torch's Python
        # decompositions, which import torch._dynamo and with it triton (~70 MB resident in a
        # CPU server that never uses it)
        self.embed_tokens = nn.Embedding(
            embed_rows,
            config.hidden_size,
            _weight=torch.empty(embed_rows, config.hidden_size, dtype=dtype, device=device),
            _freeze=True,
        )
        # the checkpoint's quantized embedding (only the rows looked up are dequantized), else None
        self.embed_quantized: QuantizedWeight | None = None
        # built on the first DECODE batch (False: not yet; None: not possible)
        self._native_layers: list[Any] | None | bool = False
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype, device, spec, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(
            head_dim, config.max_position_embeddings, rope_parameters(config), device=device
        )

    def native_layers(self) -> list[Any] | None:
        """The layers as native `QuantDecoderLayer`s (`pyserve.models.native_decode`), built on
        first use; None when the model cannot run that way. `LlamaForCausalLM` drops them when
        its weights change."""
        if self._native_layers is False and self.tp is not None:
            self._native_layers = None  # the native layers have no all-reduce
        if self._native_layers is False:
            try:
                self._native_layers = build_native_layers(self)
            except ValueError as exc:  # a layer the native code refuses: the Python layers run
                logger.warning("decode steps keep the Python layers: %s", exc)
                self._native_layers = None
        return self._native_layers if isinstance(self._native_layers, list) and self._native_layers else None

    def _vocab_parallel_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden]: the rows this rank holds, zeros for the others, summed
        over the ranks (each id is held by exactly one)."""
        assert self.tp is not None
        weight = self.embed_tokens.weight
        local = input_ids.long() - self.vocab_start
        outside = (local < 0) | (local >= weight.shape[0])
        hidden = nn.functional.embedding(local.masked_fill(outside, 0), weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(hidden)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """The decoder layers, typed (nn.ModuleList yields plain Modules)."""
        return cast("list[LlamaDecoderLayer]", list(self.layers))

    def forward(self, forward_batch: ForwardBatch, attn_backend: AttentionBackend) -> torch.Tensor:
        if self.embed_quantized is not None:
            hidden = quantized_embedding(self.embed_quantized, forward_batch.input_ids, self.embed_tokens.weight.dtype)
        elif self.tp is not None:
            hidden = self._vocab_parallel_embedding(forward_batch.input_ids)
        else:
            hidden = self.embed_tokens(forward_batch.input_ids)
        cos, sin = self.rotary_emb.get_cos_sin(forward_batch.positions)
        native = self.native_layers()  # cached: None for a model that cannot run natively
        if native is not None and (metadata := attn_backend.native_decode_metadata()) is not None:
            return native_decode(self, native, hidden, cos, sin, metadata)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, forward_batch, attn_backend)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(LlamaWeightsMixin):
    """Llama with an LM head; computes the next-token logits of each request in a batch.

    LlamaForCausalLM(config, dtype, device, tp=None): config is an HF LlamaConfig (or any config
    with the same fields); parameters are created in `dtype` on `device` (uninitialised until
    `load_weights` or `init_dummy_weights`). Subclasses (other families) override `spec`.
    With `tp` (a `TensorParallelGroup`) the model holds its rank's shard (`ShardLayout`):
    `load_weights` then takes the rank's slices of the checkpoint (`pyserve.distributed.shard`),
    the GGUF blocks are not kept quantized, and the logits are gathered whole on every rank.
    Loading, quantized blocks, prepacking and dummy weights: `LlamaWeightsMixin` (llama_weights.py).
    """

    spec = DENSE
    supports_tensor_parallel = True  # `pyserve.models.loader.load_model` asks

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.model = LlamaModel(config, dtype, device, self.spec, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:  # with tp: the rank's rows of the padded vocabulary, as the embedding's
            rows = self.model.embed_tokens.weight.shape[0]
            self.lm_head = _linear(config.hidden_size, rows, False, dtype, device)
        self.logits_processor = LogitsProcessor(config.vocab_size, tp)
        self.lm_head_packed: torch.Tensor | QuantizedWeight | None = None

    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the embedding matrix when tied, else lm_head.weight."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch, attn_backend: AttentionBackend) -> torch.Tensor:
        """Run the new tokens of `forward_batch` through the model.

        attn_backend: e.g. TorchNativeAttnBackend over the KV pool, already given
          `init_forward_metadata(forward_batch)`; K/V of the new tokens are written into the
          pool at forward_batch.out_cache_loc (mutates the pool).
        Returns logits [B, vocab] float32 of the last new token of each request.
        """
        hidden = self.model(forward_batch, attn_backend)
        return self.logits_processor(hidden, self.lm_head_weight(), forward_batch, self.lm_head_packed)
