"""Stream the tensors of a GGUF file as (HF parameter name, tensor) pairs.

A mixture's experts are stacked in GGUF (`blk.N.ffn_{gate,up,down}_exps`, [E, rows, cols]):
dequantized, they come out as HF's per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, ...,
views of the one dequantized array), which load and shard as an HF checkpoint's do; kept
quantized, as one `QuantizedWeight` of E·rows rows named `mlp.experts.gate_proj.weight`.

Quantized tensors are dequantized with `gguf.quants.dequantize` to float32 (the same routine
transformers uses, so the values are identical) and then cast to the run dtype, or, with
`keep_quantized`, the projection and embedding matrices of a type with native kernels come out
as their blocks (`QuantizedWeight`, pyserve_kernels.quant).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from pyserve.model_loader.gguf_reader import gguf_architecture, open_gguf
from pyserve_kernels.quant import QUANT_TYPES, QuantizedWeight

# llama.cpp tensor names (gguf-py constants.py TENSOR_NAMES) -> HF Llama parameter names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Matrices that may stay quantized: the token embedding (only its looked-up rows are
# dequantized), the LM head, the projections and a mixture's experts (not its router).
_QUANTIZABLE = ("token_embd.weight", "output.weight") + tuple(
    f".{kind}{part}.weight"
    for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    for part in ("", "_exps", "_shexp")
    if not part or kind.startswith("ffn")
)
# The architectures whose converter permutes q/k rows for ggml's adjacent-pair rope (the others
# keep HF's rotate-half order, which ggml runs as its NEOX rope).
_PERMUTED_QK = ("llama",)


def gguf_name_to_hf(name: str) -> str:
    """Map a llama.cpp tensor name (e.g. `blk.3.attn_q.weight`) to its HF Llama name
    (`model.layers.3.self_attn.q_proj.weight`). Raises ValueError for an unknown name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.match(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"GGUF tensor {name!r} has no Llama equivalent")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the row permutation llama.cpp's convert_hf_to_gguf.py applies to Llama q/k weights.

    The converter stores, within each head, the two rotary halves interleaved (rows
    0, h, 1, h+1, ... with h = head_dim / 2), because ggml's rope pairs adjacent dims. HF's
    rotate-half convention pairs dim i with i + h, so the rows are put back in half-major order.

    weight: [num_heads * head_dim, in_features] (or [num_heads * head_dim] for a bias)
    num_heads: query heads for q_proj, key/value heads for k_proj.
    Returns a new tensor of the same shape. Raises ValueError if rows do not split into heads
    of even size.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot split {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def iter_gguf_weights(
    path: str,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    progress: bool = True,
    keep_quantized: bool = False,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield (hf_name, tensor) for every tensor of the GGUF file at `path`, in file order.

    Tensors come out with their HF shape ([out_features, in_features] for linear weights;
    GGUF lists dims innermost first, the dequantized numpy array is already row-major
    [rows, cols]), dequantized to float32 then cast to `dtype`, on CPU.
    q_proj/k_proj rows are unpermuted (see `unpermute_qk`) where the architecture's converter
    permuted them (Llama, Mixtral). Stacked experts come out per expert when dequantized (see
    the module doc); a [H] shared-expert gate as HF's [1, H].
    keep_quantized: matrices of `_QUANTIZABLE` in a type of QUANT_TYPES are yielded as a
      `QuantizedWeight` of their blocks (copied out of the memory-mapped file, rows unpermuted
      as above) instead of a float tensor.
    progress: show a tqdm bar (it hides itself when stderr is not a TTY).
    Raises ValueError for an unknown tensor name, for `rope_freqs` (Llama 3 rope factors,
    not supported) and for a quantization type gguf-py cannot dequantize (naming the tensor
    and the type).
    """
    reader = open_gguf(path)
    permuted = gguf_architecture(path) in _PERMUTED_QK
    bar = tqdm(reader.tensors, desc="Loading GGUF tensors", unit="tensor", disable=not progress or None)
    for tensor in bar:
        if tensor.name == "rope_freqs.weight":
            raise ValueError("GGUF rope_freqs (Llama 3 rope scaling) is not supported")
        hf_name = gguf_name_to_hf(tensor.name)
        if keep_quantized and tensor.tensor_type.name in QUANT_TYPES and tensor.name.endswith(_QUANTIZABLE):
            yield hf_name, _quantized(tensor, hf_name, num_heads if permuted else 0, num_kv_heads if permuted else 0)
            continue
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:  # gguf-py has no dequantizer for this type
            raise ValueError(
                f"GGUF tensor {tensor.name}: quantization type {tensor.tensor_type.name} is not supported ({exc})"
            ) from exc
        # GGUF shapes list the innermost dim first; HF wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        # Copy only when the array is a read-only view of the memory-mapped file (F32 tensors).
        owned = np.require(array, dtype=np.float32, requirements=["C", "W", "O"])
        weight = torch.from_numpy(owned).reshape(shape)
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_qk(weight, num_heads)
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_qk(weight, num_kv_heads)
        elif hf_name.endswith("shared_expert_gate.weight") and weight.ndim == 1:
            weight = weight.unsqueeze(0)
        if ".experts." in hf_name:  # [E, rows, cols]: one HF tensor per expert
            stem, proj = hf_name.rsplit(".experts.", 1)
            for expert, part in enumerate(weight.to(dtype)):
                yield f"{stem}.experts.{expert}.{proj}", part
            continue
        yield hf_name, weight.to(dtype)


def _quantized(tensor: gguf.ReaderTensor, hf_name: str, num_heads: int, num_kv_heads: int) -> QuantizedWeight:
    """The blocks of a quantized matrix ([rows, row_bytes] uint8, an owned copy so that the
    file's mapping can be dropped after loading; stacked experts' E matrices as E·rows rows),
    q/k rows unpermuted (num_heads / num_kv_heads 0: they were not permuted)."""
    data = np.array(tensor.data, dtype=np.uint8, order="C")
    weight = QuantizedWeight(data.reshape(-1, data.shape[-1]), tensor.tensor_type.name)
    if not num_heads:
        return weight
    if hf_name.endswith("q_proj.weight"):
        heads = num_heads
    elif hf_name.endswith("k_proj.weight"):
        heads = num_kv_heads
    else:
        return weight
    rows = unpermute_qk(torch.arange(weight.shape[0]).unsqueeze(1), heads).squeeze(1).numpy()
    return weight.take_rows(rows)
