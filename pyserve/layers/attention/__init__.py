"""Attention backends: store new K/V into the paged KV pool and attend over each request's
cached tokens. `torch_native` is the reference backend (CPU and CUDA); `cpu` runs decode
through the native CPU kernel (float32 on CPU)."""

from pyserve.layers.attention.cpu_backend import CpuAttnBackend
from pyserve.layers.attention.torch_native_backend import TorchNativeAttnBackend

__all__ = ["CpuAttnBackend", "TorchNativeAttnBackend"]
