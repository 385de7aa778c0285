"""A mixture of experts' routed feed-forward on the native CPU kernel (kernels/cpu/src/moe.rs):
the step's (token, expert) assignments grouped by expert and only the experts reached run, over
float32 or GGUF-quantized stacked SwiGLU experts, in one call per layer."""

from __future__ import annotations

import torch

from pyserve_kernels._native import _cpu, as_int_array, native_applies
from pyserve_kernels.quant import QuantizedWeight


def moe_native_applies(x: torch.Tensor, gate_up: torch.Tensor | QuantizedWeight) -> bool:
    """Whether `moe_experts` can run these: the native module built, x float32 on CPU, and the
    experts float32 CPU tensors or quantized blocks."""
    if isinstance(gate_up, QuantizedWeight):
        return _cpu is not None and x.device.type == "cpu"
    return native_applies(x, gate_up)


def moe_router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ gate [E, H]^T -> [T, E] float32, each logit the same bits at any T (the expert
    products' dot kernel), so a token's routing does not depend on its batch. x: any float dtype
    (computed in float32); gate: float32 CPU. Raises ValueError (shapes), RuntimeError without
    the native module."""
    if _cpu is None:
        raise RuntimeError("pyserve_kernels._cpu is not built")
    x = x.to(torch.float32).contiguous()
    out = x.new_empty(x.shape[0], gate.shape[0])
    _cpu.moe_router_logits(x.numpy(), gate.contiguous().numpy(), out.numpy(), torch.get_num_threads())
    return out


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64) of router `logits` [T, E] float32 CPU: softmax
    in float32, the k most probable experts in descending order (ties to the lower id), divided
    by their sum when `renormalize` — `pyserve.layers.moe.route`'s contract, computed by the
    same native code as the native decoder layer (QuantDecoderLayer), so both route alike to the
    bit. Raises ValueError (shapes, top_k outside 1..E), RuntimeError without the native module."""
    if _cpu is None:
        raise RuntimeError("pyserve_kernels._cpu is not built")
    logits = logits.to(torch.float32).contiguous()
    weights = logits.new_empty(logits.shape[0], top_k)
    ids = torch.empty(logits.shape[0], top_k, dtype=torch.int32)
    _cpu.moe_route(logits.numpy(), top_k, renormalize, weights.numpy(), ids.numpy())
    return weights, ids.long()


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor | QuantizedWeight,
    down: torch.Tensor | QuantizedWeight,
    expert_start: int = 0,
    total_experts: int | None = None,
) -> torch.Tensor:
    """out [T, H] float32 with out[t] = Σ_j weights[t, j] · down_e(silu(gate_e(x[t])) · up_e(x[t])),
    e = ids[t, j].

    x: [T, H] CPU, float32 (or, with quantized experts, any float dtype: computed in float32 and
    returned in x's dtype); ids: [T, k] integer expert ids (global); weights: [T, k] float32
    routing weights, applied as given. gate_up: [E, 2I, H] float32 (each expert's gate rows then
    its up rows) or a QuantizedWeight of E·2I rows of H; down: [E, H, I] float32 or a
    QuantizedWeight of E·H rows of I. The experts held are expert_start .. expert_start + E of
    total_experts (None: E); assignments to the others are skipped (expert parallelism).
    A token's expert outputs are added in ascending expert order and every product's bits are
    independent of the batch, so a token's result is the same at any batch size. Quantized
    experts round activations to int8 per block of 32 first (error bound: quant.quantized_linear).
    Runs on torch's intra-op threads. Raises ValueError (shapes, dtypes), IndexError (an id
    outside 0..total_experts), RuntimeError without the native module.
    """
    if _cpu is None:
        raise RuntimeError("pyserve_kernels._cpu is not built")
    dtype = x.dtype
    x = x.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    ids_np = as_int_array(ids, torch.int32, "ids")
    weights_np = weights.to(torch.float32).contiguous().numpy()
    threads = torch.get_num_threads()
    if isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight):
        _cpu.moe_experts_quant(
            x.numpy(),
            ids_np,
            weights_np,
            gate_up.data,
            gate_up.type_id,
            down.data,
            down.type_id,
            out.numpy(),
            expert_start,
            total_experts,
            threads,
        )
    elif isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor):
        _cpu.moe_experts(
            x.numpy(),
            ids_np,
            weights_np,
            gate_up.contiguous().numpy(),
            down.contiguous().numpy(),
            out.numpy(),
            expert_start,
            total_experts,
            threads,
        )
    else:
        raise ValueError("gate_up and down must both be float32 tensors or both quantized")
    return out.to(dtype)
