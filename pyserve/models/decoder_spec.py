"""`DecoderSpec`: what one architecture family changes in the shared Llama decoder
(pyserve.models.llama), and the per-layer sliding window its config sets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# (config, layer_id, dtype, device, tp) -> the layer's feed-forward, or None for the dense
# LlamaMLP; tp: the rank's TensorParallelGroup or None
MlpFactory = Callable[[Any, int, torch.dtype, "torch.device | str", Any], "nn.Module | None"]


@dataclass(frozen=True)
class DecoderSpec:
    """What one architecture family changes in the shared decoder.

    qkv_bias: q/k/v projections have a bias (None: read config.attention_bias).
    o_bias:   o projection has a bias (None: read config.attention_bias).
    qk_norm:  RMSNorm over head_dim applied to q and k per head before rotary (Qwen3).
    qk_norm_full: RMSNorm over all of q's (and all of k's) heads at once before rotary, then
              q, k and v clipped to +-config.clip_qkv when set (OLMoE).
    mlp:      the layer's feed-forward, mlp(config, layer_id, dtype, device, tp): a mixture of
              experts (pyserve.models.moe) or None for the dense `LlamaMLP`; None: dense.
    """

    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False
    qk_norm_full: bool = False
    mlp: MlpFactory | None = None


def layer_sliding_window(config: Any, layer_id: int) -> int | None:
    """Sliding-window size of layer `layer_id` in tokens, or None for full attention.

    A config with `layer_types` uses the window only on "sliding_attention" layers (Qwen2/3,
    whose config sets sliding_window to None unless use_sliding_window); otherwise a non-None
    `sliding_window` applies to every layer (Mistral). A query at position p then sees keys at
    positions p - window + 1 .. p, as in HF transformers' sliding-window mask.
    """
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_id] == "sliding_attention" else None
    return int(window)


DENSE = DecoderSpec()  # Llama's own: biases per config, no q/k norm, dense MLPs
