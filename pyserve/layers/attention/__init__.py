"""Attention backends: store new K/V into the paged KV pool and attend over each request's
cached tokens. All implement `AttentionBackend` (base.py); `registry.create_attention_backend`
turns an `--attention-backend` name into one. `torch_native` is the reference (CPU and CUDA),
`cpu` runs decode through the native CPU kernel (float32 on CPU), `triton` runs the Triton
kernels (the default on CUDA; on CPU only under TRITON_INTERPRET=1, for tests)."""

from pyserve.layers.attention.base import AttentionBackend, CapturableAttentionBackend
from pyserve.layers.attention.cpu_backend import CpuAttnBackend
from pyserve.layers.attention.registry import create_attention_backend
from pyserve.layers.attention.torch_native_backend import TorchNativeAttnBackend

__all__ = [
    "AttentionBackend",
    "CapturableAttentionBackend",
    "CpuAttnBackend",
    "TorchNativeAttnBackend",
    "create_attention_backend",
]
