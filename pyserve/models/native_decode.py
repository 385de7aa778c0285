"""Decode steps of a Llama-family model whose projections all run on quantized blocks (a GGUF
served on CPU): one native call per decoder layer (`pyserve_kernels._cpu.QuantDecoderLayer`,
kernels/cpu/src/decoder_layer.rs) instead of the ten or so calls of the Python layer.

The native layer calls the same kernels in the same order, so logits are the same bits as the
Python path's (tests/kernels/test_native_decode.py); what it removes is the Python around them,
about 4 of a SmolLM2-135M decode step's ~12 ms on the 2-core test machine. Only pure DECODE
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
    a projection kept in float, a bias, per-head q/k norms, or no native module."""
    if _cpu is None or not hasattr(_cpu, "QuantDecoderLayer"):
        return None
    layers: list[Any] = []
    for layer in model.decoder_layers():
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(mlp, SparseMoeBlock):  # no native experts yet: the Python layers run
            return None
        weights = [attn.qkv_packed, attn.o_packed, mlp.gate_up_packed, mlp.down_packed]
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if (
            not all(isinstance(w, QuantizedWeight) for w in weights)
            or attn.qkv_bias is not None
            or attn.o_proj.bias is not None
            or mlp.gate_up_bias is not None
            or mlp.down_proj.bias is not None
            or attn.q_norm is not None
            or any(n.dtype != torch.float32 or n.device.type != "cpu" for n in norms)
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps
        ):
            return None
        args: list[Any] = [norms[0].numpy(), norms[1].numpy(), float(layer.input_layernorm.eps)]
        for w in weights:
            assert isinstance(w, QuantizedWeight)
            args += [w.data, w.type_id]
        layers.append(_cpu.QuantDecoderLayer(*args, attn.num_heads, attn.num_kv_heads, attn.head_dim))
    return layers


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
        )
    if not layers:
        return model.norm(hidden)
    return model.norm(torch.from_numpy(x), torch.from_numpy(residual))[0]
