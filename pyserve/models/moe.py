"""Mixture-of-experts decoders on the shared Llama decoder: Qwen2-MoE, Qwen3-MoE, Mixtral and
OLMoE. Each is `LlamaForCausalLM` with its attention spec and a feed-forward factory that makes
the layer's `SparseMoeBlock` (pyserve.layers.moe) where the family's config puts experts.

- Qwen2-MoE (Qwen team, "Qwen2 Technical Report", 2024): experts on every
  `decoder_sparse_step`-th layer not in `mlp_only_layers` (dense `intermediate_size` MLPs on
  the others), `moe_intermediate_size` per expert, a shared expert of
  `shared_expert_intermediate_size` scaled by a sigmoid gate, q/k/v biases, weights
  renormalised by `norm_topk_prob`.
- Qwen3-MoE ("Qwen3 Technical Report", 2025): the same placement without a shared expert,
  Qwen3's per-head q/k norms, no attention biases.
- Mixtral (Jiang et al., "Mixtral of Experts", 2024): every layer sparse,
  `num_local_experts` experts of `intermediate_size`, top-k weights always renormalised.
- OLMoE (Muennighoff et al., "OLMoE", 2024): every layer sparse, q and k normed across all
  heads, optional q/k/v clipping, `norm_topk_prob`.

Experts are held stacked and loaded from per-expert checkpoint tensors
(pyserve.models.expert_weights). Under `--tp-size` N each rank holds 1/N of every expert's
intermediate size (or, `--ep-size`, E/N whole experts); OLMoE's ranks norm q and k together
(pyserve.models.llama.LlamaAttention).
"""

from __future__ import annotations

from typing import Any

import torch

from pyserve.distributed.group import TensorParallelGroup
from pyserve.forward_batch_info import ForwardBatch
from pyserve.layers.activation import get_act_fn
from pyserve.layers.attention.base import AttentionBackend
from pyserve.layers.expert_load import ExpertLoad
from pyserve.layers.moe import SparseMoeBlock, StackedExperts
from pyserve.models.decoder_spec import DecoderSpec
from pyserve.models.llama import LlamaForCausalLM, LlamaMLP, _linear
from pyserve_kernels._triton import triton_available


def _block(
    config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    num_experts: int,
    inter: int,
    renormalize: bool,
    tp: TensorParallelGroup | None,
    shared_inter: int = 0,
) -> SparseMoeBlock:
    hidden = config.hidden_size
    full_inter = inter
    if tp is not None:  # the rank's slice of each expert (ShardLayout checks it divides)
        inter //= tp.size
    top_k = int(config.num_experts_per_tok)
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be in 1..{num_experts} (the layer's experts)")
    shared = shared_gate = None
    if shared_inter:
        shared = LlamaMLP(config, dtype, device, tp, intermediate_size=shared_inter)
        shared_gate = _linear(hidden, 1, False, dtype, device)
    return SparseMoeBlock(
        gate=_linear(hidden, num_experts, False, dtype, device),
        experts=StackedExperts(num_experts, hidden, inter, dtype, device, full_inter),
        top_k=top_k,
        renormalize=renormalize,
        act=get_act_fn(getattr(config, "hidden_act", "silu")),
        shared_expert=shared,
        shared_expert_gate=shared_gate,
        tp=tp,
    )


def _qwen_sparse(config: Any, layer_id: int) -> bool:
    """Whether a Qwen-MoE layer has experts (the others are dense)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_dense = getattr(config, "mlp_only_layers", None) or []
    return config.num_experts > 0 and layer_id not in only_dense and (layer_id + 1) % step == 0


def qwen2_moe_mlp(
    config: Any, layer_id: int, dtype: torch.dtype, device: torch.device | str, tp: TensorParallelGroup | None
) -> SparseMoeBlock | None:
    if not _qwen_sparse(config, layer_id):
        return None
    return _block(
        config,
        dtype,
        device,
        config.num_experts,
        config.moe_intermediate_size,
        bool(config.norm_topk_prob),
        tp,
        shared_inter=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
    )


def qwen3_moe_mlp(
    config: Any, layer_id: int, dtype: torch.dtype, device: torch.device | str, tp: TensorParallelGroup | None
) -> SparseMoeBlock | None:
    if not _qwen_sparse(config, layer_id):
        return None
    return _block(
        config, dtype, device, config.num_experts, config.moe_intermediate_size, bool(config.norm_topk_prob), tp
    )


def mixtral_mlp(
    config: Any, layer_id: int, dtype: torch.dtype, device: torch.device | str, tp: TensorParallelGroup | None
) -> SparseMoeBlock:
    return _block(config, dtype, device, config.num_local_experts, config.intermediate_size, True, tp)


def olmoe_mlp(
    config: Any, layer_id: int, dtype: torch.dtype, device: torch.device | str, tp: TensorParallelGroup | None
) -> SparseMoeBlock:
    return _block(config, dtype, device, config.num_experts, config.intermediate_size, bool(config.norm_topk_prob), tp)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-style decoder whose spec puts `SparseMoeBlock`s in some layers; their routing
    is counted in `expert_load` (pyserve.layers.expert_load.ExpertLoad: SGLang's expert distribution
    record and /metrics). Tensor-parallel (`--tp-size`): every rank holds its slice of each
    expert's intermediate size (pyserve.distributed.shard) and the whole router; with
    `--ep-size` its whole experts (`expert_parallel`)."""

    supports_expert_parallel = True

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tp: TensorParallelGroup | None = None,
        expert_parallel: bool = False,
    ) -> None:
        """expert_parallel: with `tp`, rank r holds experts r * E / N .. (r + 1) * E / N - 1
        whole (`first_expert` is the first) instead of a slice of each (--ep-size)."""
        super().__init__(config, dtype, device, tp)
        sparse = [
            (i, layer.mlp)
            for i, layer in enumerate(self.model.decoder_layers())
            if isinstance(layer.mlp, SparseMoeBlock)
        ]
        num_experts = sparse[0][1].gate.weight.shape[0] if sparse else 0
        self.expert_load = ExpertLoad([i for i, _ in sparse], num_experts, device)
        for row, (_, block) in enumerate(sparse):
            block.load, block.load_row = self.expert_load, row
            if expert_parallel and tp is not None:
                self._hold_whole_experts(block, tp, dtype, device)

    def forward(self, forward_batch: ForwardBatch, attn_backend: AttentionBackend) -> torch.Tensor:
        """LlamaForCausalLM's forward, the step's padding rows (a captured graph's) left out of
        the expert load."""
        self.expert_load.set_valid(forward_batch.out_cache_loc)
        try:
            return super().forward(forward_batch, attn_backend)
        finally:
            self.expert_load.valid = None

    def graph_capturable(self) -> bool:
        """Whether a decode step reads nothing back to the host, so CUDA graphs can capture
        it: the experts run on the Triton kernel (torch's per-expert loop reads the counts) and
        every sparse layer holds all its experts (expert parallelism picks its assignments on
        the host)."""
        return triton_available() and all(
            m.expert_range is None for m in self.modules() if isinstance(m, SparseMoeBlock)
        )

    def _hold_whole_experts(
        self, block: SparseMoeBlock, tp: TensorParallelGroup, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        """Replace `block`'s width-split experts by this rank's whole ones (nothing was
        loaded yet: the replaced tensors were never written)."""
        experts = block.experts
        local = experts.num_experts // tp.size
        hidden = experts.down_proj.shape[1]
        block.experts = StackedExperts(local, hidden, experts.full_inter, dtype, device)
        self.first_expert = tp.rank * local
        block.expert_range = (self.first_expert, self.first_expert + local)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """See the module docstring; weights use the HF parameter names of this family."""

    spec = DecoderSpec(qkv_bias=True, o_bias=False, mlp=qwen2_moe_mlp)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """See the module docstring; weights use the HF parameter names of this family."""

    spec = DecoderSpec(qk_norm=True, mlp=qwen3_moe_mlp)


class MixtralForCausalLM(MoeForCausalLM):
    """See the module docstring; Mixtral's `block_sparse_moe` tensors load as the layer's `mlp`."""

    spec = DecoderSpec(qkv_bias=False, o_bias=False, mlp=mixtral_mlp)


class OlmoeForCausalLM(MoeForCausalLM):
    """See the module docstring; weights use the HF parameter names of this family."""

    spec = DecoderSpec(qk_norm_full=True, mlp=olmoe_mlp)
