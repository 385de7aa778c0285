"""Qwen3 (Qwen team, "Qwen3 Technical Report", 2025): the Llama decoder with an RMSNorm over
head_dim applied to each query and key head before rotary (q_norm / k_norm), biases per
config.attention_bias. Sliding-window layers follow config.layer_types.
"""

from __future__ import annotations

from pyserve.models.decoder_spec import DecoderSpec
from pyserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """See `LlamaForCausalLM`; weights use the HF parameter names of this family."""

    spec = DecoderSpec(qk_norm=True)
