"""Mixture-of-experts feed-forward: a router scores E experts per token, the top k run, and
the token's output is the routing-weighted sum of their SwiGLU MLPs (plus a shared expert
where the family has one).

Sparsely-gated experts: Shazeer et al., "Outrageously Large Neural Networks" (2017); top-k
routing over SwiGLU experts as in Mixtral (Jiang et al., "Mixtral of Experts", 2024), OLMoE
(Muennighoff et al., 2024) and Qwen2-/Qwen3-MoE. Each family's normalisation of the top-k
weights follows its HF implementation: softmax over all experts in float32, top k, then
divided by their sum when the family renormalises (Mixtral always; the others by
`norm_topk_prob`).

Experts are held stacked, as SGLang's fused kernels take them: `gate_up_proj` [E, 2I, H]
(each expert's gate rows, then its up rows) and `down_proj` [E, H, I]. `fused_experts` groups
a step's T * k (token, expert) assignments by expert with one stable sort and runs only the
experts that received tokens, each as two GEMMs over its own tokens: a decode step of B
requests runs at most B * k experts, so its cost follows the active parameters, not all of
them. Where the step runs: on CPU, the native kernel (pyserve_kernels.moe: one call per layer,
for float steps of up to NATIVE_F32_MAX_TOKENS tokens and for a GGUF's quantized experts); on
CUDA, the Triton grouped GEMMs (pyserve_kernels.triton_ops.moe); otherwise (longer float CPU
steps, expert parallelism on CUDA) `fused_experts`' per-expert torch GEMMs. Worker thread, as
the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pyserve_kernels._triton import triton_applies
from pyserve_kernels.moe import moe_experts, moe_native_applies, moe_route, moe_router_logits
from pyserve_kernels.quant import QuantizedWeight

if TYPE_CHECKING:
    from pyserve.distributed.group import TensorParallelGroup
    from pyserve.layers.expert_load import ExpertLoad


def triton_fused_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`fused_experts` on CUDA: pyserve_kernels.triton_ops.moe's grouped GEMMs (imported here:
    triton exists only where CUDA does)."""
    from pyserve_kernels.triton_ops.moe import fused_experts as triton_kernel

    return triton_kernel(x, gate_up, down, weights, ids)


# Float32 steps of up to this many tokens run on the native kernel; longer ones (prefill) on
# torch's GEMMs per expert, whose blocking beats the native kernel's row-at-a-time products
# once an expert has many tokens. Quantized experts always run natively.
NATIVE_F32_MAX_TOKENS = 16


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of `router_logits` [T, E]: softmax
    over the E experts in float32, the k largest, divided by their sum when `renormalize`.
    Ties go to the lower expert id (torch.topk's order, as the HF models)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Sum over k of weights[t, j] * expert_{ids[t, j]}(x[t]), [T, H] in x's dtype.

    x [T, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; weights [T, k] float32 and ids
    [T, k] int64 from `route`; act: the gated activation over an expert's [n, 2I] gate|up
    product, giving [n, I] (`pyserve.layers.activation.SiluAndMul` for every supported family).
    An expert computes silu(x W_gate^T) * (x W_up^T) W_down^T for the tokens routed to it."""
    top_k = ids.shape[1]
    tokens = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(top_k)
    return expert_sum(x, gate_up_proj, down_proj, tokens, ids.reshape(-1), weights.reshape(-1), act)


def expert_sum(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    tokens: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`fused_experts` over a list of A assignments: token `tokens[a]` ([A] int64) runs expert
    `experts[a]` ([A] int64, an index into the stacked weights) scaled by `weights[a]` ([A]
    float32). Returns [T, H]: each token's sum over its assignments (zeros for none), in
    ascending expert order per token, as the HF models add them."""
    order = torch.argsort(experts, stable=True)  # assignments grouped by expert, token order kept
    counts = torch.bincount(experts, minlength=gate_up_proj.shape[0]).tolist()  # a host read: no graph
    token_of = tokens.index_select(0, order)
    xs = x.index_select(0, token_of)
    out = torch.empty_like(xs)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        hidden = act(torch.mm(xs[start:end], gate_up_proj[expert].t()))
        torch.mm(hidden, down_proj[expert].t(), out=out[start:end])
        start = end
    out.mul_(weights.index_select(0, order).unsqueeze(1).to(out.dtype))
    result = torch.zeros_like(x)
    result.index_add_(0, token_of, out)
    return result


def _gate_logits(x: torch.Tensor, weight: torch.Tensor, native: bool) -> torch.Tensor:
    """x [T, H] @ weight [G, H]^T: on the native kernel's batch-invariant dot when the experts
    run natively (so that routing, like the experts, does not depend on the batch) and the
    weight is float32, else torch's linear."""
    if native and weight.dtype == torch.float32:
        return moe_router_logits(x, weight)
    return torch.nn.functional.linear(x, weight)


class StackedExperts(nn.Module):
    """E SwiGLU experts of intermediate size I over hidden size H, stacked:
    gate_up_proj [E, 2I, H], down_proj [E, H, I] (allocated, not initialised: the checkpoint
    or dummy weights fill them). full_inter: the model's expert intermediate size, of which a
    tensor-parallel rank holds I (None: I). A GGUF's experts run on their blocks instead:
    `gate_up_quant` (E·2I rows of H) and `down_quant` (E·H rows of I), the float parameters
    then empty."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        device: torch.device | str,
        full_inter: int | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.inter = num_experts, inter
        self.full_inter = full_inter or inter
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, inter, dtype=dtype, device=device), requires_grad=False
        )
        self.gate_up_quant: QuantizedWeight | None = None
        self.down_quant: QuantizedWeight | None = None

    def native_weights(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor | QuantizedWeight, torch.Tensor | QuantizedWeight] | None:
        """(gate_up, down) for the native kernel when it takes a step of `x` [T, H], else None."""
        if self.gate_up_quant is not None and self.down_quant is not None:
            return self.gate_up_quant, self.down_quant
        if x.shape[0] <= NATIVE_F32_MAX_TOKENS and moe_native_applies(x, self.gate_up_proj):
            return self.gate_up_proj, self.down_proj
        return None


class SparseMoeBlock(nn.Module):
    """The MoE feed-forward of one decoder layer: forward([T, H]) -> [T, H].

    gate: the router, [E, H] (HF's `mlp.gate.weight`); experts: StackedExperts; top_k,
    renormalize: see `route`. shared_expert (optional): a dense SwiGLU every token also runs
    (Qwen2-MoE), scaled by sigmoid(shared_expert_gate(x)) when that gate is given. tp: with
    tensor parallelism each rank holds its slice of every expert's intermediate size, or with
    expert parallelism (`expert_range`) its whole experts; the router is whole on every rank
    (each routes alike) and the ranks' outputs are summed."""

    def __init__(
        self,
        gate: nn.Linear,
        experts: StackedExperts,
        top_k: int,
        renormalize: bool,
        act: Callable[[torch.Tensor], torch.Tensor],
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Linear | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.act = act
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.tp = tp
        # expert parallelism: the experts [start, stop) this rank holds (None: all of them)
        self.expert_range: tuple[int, int] | None = None
        # where the routing is counted: the model's ExpertLoad and this layer's row of it
        self.load: ExpertLoad | None = None
        self.load_row = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.experts.native_weights(x)
        logits = _gate_logits(x, self.gate.weight, native is not None)
        if native is not None:  # routed by the same native code as the native decoder layer
            weights, ids = moe_route(logits, self.top_k, self.renormalize)
        else:
            weights, ids = route(logits, self.top_k, self.renormalize)
        if self.load is not None:  # over every expert, held here or not
            self.load.add(self.load_row, ids)
        if native is not None:
            start = 0 if self.expert_range is None else self.expert_range[0]
            out = moe_experts(x, ids, weights, *native, expert_start=start, total_experts=self.gate.weight.shape[0])
        elif self.expert_range is None and triton_applies(x):
            out = triton_fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        elif self.expert_range is None:
            out = fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, self.act)
        else:  # only the assignments to this rank's experts
            start, stop = self.expert_range
            rows, cols = ((ids >= start) & (ids < stop)).nonzero(as_tuple=True)
            local = ids[rows, cols] - start
            out = expert_sum(
                x, self.experts.gate_up_proj, self.experts.down_proj, rows, local, weights[rows, cols], self.act
            )
        if self.tp is not None:  # each rank ran its part: a slice of every expert, or its experts
            out = self.tp.all_reduce(out)
        if self.shared_expert is not None:  # (a LlamaMLP: it sums its ranks' parts itself)
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                logit = _gate_logits(x, self.shared_expert_gate.weight, native is not None).to(x.dtype)
                shared = torch.sigmoid(logit) * shared
            out = out + shared
        return out
