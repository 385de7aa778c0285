"""The KV cache tensors: one K and one V buffer per layer, indexed by KV slot.

Slot allocation (which request owns which slot) lives in the Rust `TokenToKVPoolAllocator`;
this module only owns the bytes. Slots come in pages of `page_size`; page 0 (slots
0..page_size-1) is reserved and slot 0 is the padding slot that never holds a real token (padded
batches write there harmlessly); real slots are page_size..size + page_size - 1.
Only the worker thread touches these tensors.
"""

from __future__ import annotations

import torch

from pyserve_kernels import store_kv


class MHATokenToKVPool:
    """Per-layer K/V buffers for multi-head (incl. grouped-query) attention.

    k_buffer[layer], v_buffer[layer]: [size + page_size, num_kv_heads, head_dim] `dtype` on
    `device`, zero-initialised (`size` real slots plus the reserved page 0).

    Raises ValueError if any dimension is not positive.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        page_size: int = 1,
    ) -> None:
        for name, value in (
            ("size", size),
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("page_size", page_size),
        ):
            least = 0 if name == "num_layers" else 1  # (no layers: an encoder's slots, no memory)
            if int(value) < least:
                raise ValueError(f"MHATokenToKVPool: {name} must be >= {least}, got {value}")
        self.size = int(size)
        self.page_size = int(page_size)
        self.num_slot_rows = self.size + self.page_size
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (self.num_slot_rows, self.num_kv_heads, self.head_dim)
        self.k_buffer = [self._alloc(shape) for _ in range(num_layers)]
        self.v_buffer = [self._alloc(shape) for _ in range(num_layers)]

    def _alloc(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """One layer's K or V rows. Only the reserved padding page is ever read before it is
        written (padded rows point at slot 0), so only it is zeroed: on CPU the rest of a
        large buffer is then memory the OS commits page by page as tokens are stored, and an
        idle server with a large pool holds little of it."""
        if self.device.type == "cuda":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        buf[: self.page_size].zero_()
        return buf

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token's K and V take across all layers (used to size the pool)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * elem

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K plus V per token slot across all layers."""
        return self.bytes_per_token_for(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def total_bytes(self) -> int:
        """Bytes held by all buffers, reserved page 0 included."""
        return self.bytes_per_token * self.num_slot_rows

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of `layer_id`: [size + page_size, num_kv_heads, head_dim] (a view, not a copy)."""
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of `layer_id`: [size + page_size, num_kv_heads, head_dim] (a view, not a copy)."""
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K buffer, V buffer) of `layer_id`."""
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K and V into their slots (mutates this layer's buffers).

        loc: [num_tokens] int32 (or int64) slot ids in 0..size + page_size - 1, on the pool
             device
        k, v: [num_tokens, num_kv_heads, head_dim]; cast to the pool dtype.
        Raises IndexError for a slot outside the pool.
        """
        store_kv(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, k, v)
