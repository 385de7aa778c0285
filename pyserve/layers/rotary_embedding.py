"""Rotary position embedding: inverse frequencies for the supported rope types, a cos/sin
cache indexed by absolute position, and application via `pyserve_kernels`."""

from __future__ import annotations

import math
from typing import Any

import torch

from pyserve_kernels import apply_rotary_pos_emb


def compute_inv_freq(head_dim: int, rope: dict[str, Any], seq_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 on CPU for `rope` (a dict with rope_type,
    rope_theta and the type's parameters).

    default: theta ** (-2i / head_dim) (RoFormer, Su et al. 2021).
    linear:  default / factor (position interpolation, Chen et al. 2023).
    llama3:  low frequencies divided by factor, high frequencies kept, a smooth ramp between,
             as published with Meta's Llama 3.1 reference code.
    dynamic: "dynamic NTK" scaling (bloc97 / emozilla, 2023): for a sequence of `seq_len`
             tokens beyond max_position_embeddings the base grows to
             theta * (factor * seq_len / max_pos - (factor - 1)) ** (d / (d - 2)); up to
             max_position_embeddings it equals default. `rope` must then carry
             max_position_embeddings; `seq_len` is the longest sequence of the batch.
    Raises ValueError for any other rope_type.
    """
    base = float(rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "dynamic":
        max_pos = int(rope["max_position_embeddings"])
        seq = max(int(seq_len or max_pos), max_pos)
        factor = float(rope["factor"])
        base = base * ((factor * seq / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low_ff = float(rope.get("low_freq_factor", 1.0))
        high_ff = float(rope.get("high_freq_factor", 4.0))
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low_ff, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high_ff) & (wavelen <= old_len / low_ff)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, linear, dynamic, llama3")


class RotaryEmbedding(torch.nn.Module):
    """Applies rotate-half rotary embedding to q and k at given absolute positions.

    Holds a float32 cos/sin cache [max_position, head_dim] on `device`, grown on demand when a
    position beyond it is requested (worker thread only).
    forward(positions [T] int32 (or int64), q [T, H, D], k [T, H_kv, D]) -> (q, k) rotated, same shapes.
    """

    def __init__(
        self, head_dim: int, max_position: int, rope: dict[str, Any], device: str | torch.device | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = dict(rope)
        self.is_dynamic = rope.get("rope_type") == "dynamic"
        if self.is_dynamic:
            self.rope.setdefault("max_position_embeddings", int(max_position))
            self.original_max_position = int(self.rope["max_position_embeddings"])
        self.inv_freq = compute_inv_freq(head_dim, self.rope).to(device)
        self._build_cache(max(1, int(max_position)))
        self.bounded = False  # set by `reserve`: positions never pass the cache, no check

    def reserve(self, context_len: int) -> None:
        """Promise that positions stay below `context_len` (the runner's context length):
        the cache is built that far once, and `get_cos_sin` of a non-dynamic rope then never
        reads positions on the host, so a forward can be captured in a CUDA graph."""
        if context_len > self.cos_cache.shape[0]:
            self._build_cache(int(context_len))
        self.bounded = True

    def _build_cache(self, max_position: int) -> None:
        t = torch.arange(max_position, device=self.inv_freq.device, dtype=torch.int64).float()
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = emb.cos()
        self.sin_cache = emb.sin()

    def get_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] float32 for positions [T] int32 or int64 (computed once per
        forward and shared by all layers). Grows the cache if a position is beyond it; that
        check reads positions.max() on the host, unless `reserve` made it needless.

        Dynamic rope: when the batch's longest sequence (max position + 1) exceeds
        max_position_embeddings, cos/sin are computed from that length's frequencies for the
        whole batch, as HF transformers does for one forward call."""
        if self.is_dynamic and positions.numel():
            seq_len = int(positions.max()) + 1
            if seq_len > self.original_max_position:
                inv_freq = compute_inv_freq(self.head_dim, self.rope, seq_len).to(positions.device)
                freqs = positions.float()[:, None] * inv_freq[None, :]
                emb = torch.cat((freqs, freqs), dim=-1)
                return emb.cos(), emb.sin()
        if not self.bounded and positions.numel() and int(positions.max()) >= self.cos_cache.shape[0]:
            self._build_cache(2 * int(positions.max()) + 1)
        return self.cos_cache[positions], self.sin_cache[positions]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.get_cos_sin(positions)
        return apply_rotary_pos_emb(q, k, cos, sin)
