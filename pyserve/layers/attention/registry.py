"""The one place `--attention-backend` names become backends.

Each name maps to its class, imported only when chosen (the Triton backend imports triton).
"auto" takes the first backend of the device's preference list that supports the KV pool:
on CUDA `triton` then `torch_native`; on CPU `cpu` (float32 + the native kernel) then
`torch_native`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyserve.layers.attention.base import AttentionBackend
    from pyserve.mem_cache.memory_pool import MHATokenToKVPool

# name -> "module:Class"
BACKENDS: dict[str, str] = {
    "torch_native": "pyserve.layers.attention.torch_native_backend:TorchNativeAttnBackend",
    "cpu": "pyserve.layers.attention.cpu_backend:CpuAttnBackend",
    "triton": "pyserve.layers.attention.triton_backend:TritonAttnBackend",
}
AUTO_ORDER: dict[str, tuple[str, ...]] = {"cuda": ("triton", "torch_native"), "cpu": ("cpu", "torch_native")}


def backend_class(name: str) -> type[AttentionBackend]:
    """The class registered as `name`. Raises ValueError for an unknown name."""
    target = BACKENDS.get(name)
    if target is None:
        raise ValueError(f"attention backend {name!r} is not supported; supported: auto, " + ", ".join(BACKENDS))
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def create_attention_backend(name: str, kv_pool: MHATokenToKVPool) -> AttentionBackend:
    """The backend `name` ("auto" or a registered name) over `kv_pool`. Raises ValueError for
    an unknown name, or a backend that cannot serve the pool (its `requirement` says why)."""
    if name == "auto":
        device = kv_pool.get_key_buffer(0).device.type
        for candidate in AUTO_ORDER.get(device, ("torch_native",)):
            cls = backend_class(candidate)
            if cls.supported(kv_pool):
                return cls(kv_pool)
        raise ValueError(f"no attention backend supports a KV pool on {device}")
    cls = backend_class(name)
    if not cls.supported(kv_pool):
        raise ValueError(f"attention backend {name!r} cannot serve this KV pool: {cls.requirement}")
    return cls(kv_pool)


def capturable_backend(name: str, device_type: str) -> bool:
    """Whether the backend `name` would choose on `device_type` supports CUDA graphs ("auto":
    its first choice there, if that one is available); decided before the KV pool exists."""
    if name == "auto":
        order = AUTO_ORDER.get(device_type, ("torch_native",))
        cls = backend_class(order[0])
        return cls.supports_cuda_graph and cls.available()
    return backend_class(name).supports_cuda_graph
