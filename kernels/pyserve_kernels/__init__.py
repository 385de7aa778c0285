"""pyserve-kernels: the op library of pyserve (import name `pyserve_kernels`).

Each op family has a slow fp32 torch reference in `reference.py` that defines its semantics.
The top-level ops run the Triton launchers (`pyserve_kernels.triton_ops`) on CUDA tensors
when triton is installed, the native CPU kernels (Rust, kernels/cpu, module
`pyserve_kernels._cpu`) on float32 CPU tensors, and the reference otherwise;
`decode_attention` and `varlen_attention` are the native CPU kernels only (on CUDA pyserve's triton attention backend
calls `triton_ops` itself). Tests check the kernels against the references (the Triton ones on
CPU under TRITON_INTERPRET=1). This package never imports pyserve.
"""

from pyserve_kernels._native import native_available
from pyserve_kernels.activation import silu_and_mul
from pyserve_kernels.argmax import row_argmax
from pyserve_kernels.decode_attention import decode_attention
from pyserve_kernels.kv_cache import store_kv
from pyserve_kernels.layernorm import fused_add_rms_norm, rms_norm
from pyserve_kernels.reference import apply_rotary_pos_emb, rotate_half
from pyserve_kernels.rotary import rotary_embedding_
from pyserve_kernels.token_bitmask import apply_token_bitmask_
from pyserve_kernels.varlen_attention import varlen_attention

__version__ = "0.1.0"

__all__ = [
    "apply_rotary_pos_emb",
    "apply_token_bitmask_",
    "decode_attention",
    "fused_add_rms_norm",
    "native_available",
    "rms_norm",
    "rotary_embedding_",
    "rotate_half",
    "row_argmax",
    "silu_and_mul",
    "store_kv",
    "varlen_attention",
    "__version__",
]
