"""Qwen2 / Qwen2.5 (Qwen team, "Qwen2 Technical Report", 2024): the Llama decoder with a
bias on the q/k/v projections (none on o_proj). Sliding-window layers follow config.layer_types.
"""

from __future__ import annotations

from pyserve.models.decoder_spec import DecoderSpec
from pyserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """See `LlamaForCausalLM`; weights use the HF parameter names of this family."""

    spec = DecoderSpec(qkv_bias=True, o_bias=False)
