"""Mistral (Jiang et al., "Mistral 7B", 2023): the Llama decoder without attention biases and
with sliding-window attention over config.sliding_window tokens on every layer (None: full).
"""

from __future__ import annotations

from pyserve.models.decoder_spec import DecoderSpec
from pyserve.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """See `LlamaForCausalLM`; weights use the HF parameter names of this family."""

    spec = DecoderSpec(qkv_bias=False, o_bias=False)
