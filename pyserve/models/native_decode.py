"""Decode steps of a Llama-family model whose projections all run on quantized blocks (a GGUF
served on CPU): one native call per decoder layer (`pyserve_kernels._cpu.QuantDecoderLayer`,
kernels/cpu/src/decoder_layer.rs) instead of the ten or so calls of the Python layer.

The native layer calls the same kernels in the same order, so logits are the same bits as the
Python path's (tests/unit/test_native_decode.py); what it removes is the Python around them,
about 4 of a SmolLM2-135M decode step's ~12 ms on the 2-core test machine. Layers with q/k norms
(Qwen3, OLMoE) and mixtures of quantized experts (OLMoE, Qwen3-MoE, Mixtral from GGUF) run
natively too; biases (Qwen2, Qwen2-MoE), shared experts, q/k clipping and ranks keep the
Python layers. Only pure DECODE
batches on `CpuAttnBackend` take it; every other batch runs the Python layers. Runs on the
worker thread, as the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from pyserve.layers.moe import SparseMoeBlock
from pyserve_kernels._native import _cpu
from pyserve_kernels.quant import QuantizedWeight


class DecoderStack(Protocol):
    """What native decode reads of a Llama-style decoder (`LlamaModel`): its layers (each with
    `self_attn`, `mlp` and the two RMS norms) and its final norm."""

    @property
    def norm(self) -> nn.Module: ...

    def decoder_layers(self) -> Iterable[Any]: ...


def build_native_layers(model: DecoderStack) -> list[Any] | None:
    """One `QuantDecoderLayer` per decoder layer, or None when some layer cannot run natively:
    a projection kept in float, a bias, q/k clipping, a mixture whose experts or router are
    not what the native layer takes, or no native module."""
    if _cpu is None or not hasattr(_cpu, "QuantDecoderLayer"):
        return None
    layers: list[Any] = []
    for layer in model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        ffn = _moe_args(mlp) if isinstance(mlp, SparseMoeBlock) else _dense_args(mlp)
        weights = [attn.qkv_packed, attn.o_packed, *(ffn[:2] if ffn is not None else ())]
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        eps = layer.input_layernorm.eps
        qk = _qk_norm_args(attn, eps)
        if (
            ffn is None
            or qk is None
            or not all(isinstance(w, QuantizedWeight) for w in weights)
            or attn.qkv_bias is not None
            or attn.o_proj.bias is not None
            or not all(_cpu_f32(n) for n in norms)
            or eps != layer.post_attention_layernorm.eps
        ):
            return None
        args: list[Any] = [norms[0].numpy(), norms[1].numpy(), float(eps)]
        for w in weights:
            assert isinstance(w, QuantizedWeight)
            args += [w.data, w.type_id]
        layers.append(_cpu.QuantDecoderLayer(*args, attn.num_heads, attn.num_kv_heads, attn.head_dim, **qk, **ffn[2]))
    return layers


def _cpu_f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


_Ffn = tuple[Any, Any, dict[str, Any]]  # (gate_up, down, the constructor's keyword arguments)


def _dense_args(mlp: Any) -> _Ffn | None:
    if mlp.gate_up_bias is not None or mlp.down_proj.bias is not None:
        return None
    return mlp.gate_up_packed, mlp.down_packed, {}


def _moe_args(block: SparseMoeBlock) -> _Ffn | None:
    """A mixture's native arguments: its quantized stacked experts and float32 router, with
    no shared expert, all experts held and no tensor parallelism (those run in Python)."""
    experts, router = block.experts, block.gate.weight
    if (
        experts.gate_up_quant is None
        or experts.down_quant is None
        or block.shared_expert is not None
        or block.expert_range is not None
        or block.tp is not None
        or not _cpu_f32(router)
    ):
        return None
    return (
        experts.gate_up_quant,
        experts.down_quant,
        {
            "router": router.contiguous().numpy(),
            "top_k": block.top_k,
            "renormalize": block.renormalize,
        },
    )


def _qk_norm_args(attn: Any, eps: float) -> dict[str, Any] | None:
    """The attention's q/k norm arguments ({} without them), or None when the native layer
    cannot norm them: another eps, float weights off CPU, or clipping (OLMoE's clip_qkv)."""
    if attn.q_norm is None:
        return {}
    if (
        attn.clip_qkv is not None
        or not (_cpu_f32(attn.q_norm.weight) and _cpu_f32(attn.k_norm.weight))
        or attn.q_norm.eps != eps
        or attn.k_norm.eps != eps
    ):
        return None
    return {
        "q_norm": attn.q_norm.weight.numpy(),
        "k_norm": attn.k_norm.weight.numpy(),
        "qk_norm_per_head": not attn.qk_norm_full,
    }


def native_decode(
    model: DecoderStack, layers: list[Any], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: Any
) -> torch.Tensor:
    """Runs every decoder layer natively and the final norm: hidden [B, hidden] float32 (the
    embedded new tokens), cos/sin [B, head_dim], metadata the backend's `NativeDecodeMetadata`.
    Returns the normed hidden states [B, hidden]. Writes the new tokens' K/V into the pool."""
    x = hidden.contiguous().numpy()
    residual = np.empty_like(x)
    cos_np, sin_np = cos.contiguous().numpy(), sin.contiguous().numpy()
    for i, (native, layer) in enumerate(zip(layers, model.decoder_layers(), strict=True)):
        attn = layer.self_attn
        native.forward(
            x,
            residual,
            i == 0,
            cos_np,
            sin_np,
            metadata.k_views[i],
            metadata.v_views[i],
            metadata.out_cache_loc,
            metadata.kv_indptr,
            metadata.kv_indices,
            attn.scaling,
            attn.sliding_window,
            metadata.num_threads,
            _expert_counts(layer.mlp),
        )
    if not layers:
        return model.norm(hidden)
    return model.norm(torch.from_numpy(x), torch.from_numpy(residual))[0]


def _expert_counts(mlp: Any) -> list[np.ndarray]:
    """The count rows a mixture's native layer adds its routing to: the layer's row of the
    model's ExpertLoad totals (on CPU the memory `ExpertLoad.add` adds to)."""
    load = getattr(mlp, "load", None)
    return [] if load is None else [load.total[mlp.load_row]]
