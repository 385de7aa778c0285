"""Triton kernel that writes new tokens' K and V into their KV-pool slots (the CUDA path of
`pyserve_kernels.store_kv`; semantics: `pyserve_kernels.reference.store_kv`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Heads handled by one program at most: keeps a program's tile near 4096 elements whatever
# num_kv_heads * head_dim is.
_MAX_TILE = 4096


@triton.jit
def _store_kv_kernel(
    k_buffer_ptr,
    v_buffer_ptr,
    loc_ptr,
    k_ptr,
    v_ptr,
    num_slots,
    num_heads,
    head_dim,
    kb_s0,
    kb_s1,
    kb_s2,
    vb_s0,
    vb_s1,
    vb_s2,
    k_s0,
    k_s1,
    k_s2,
    v_s0,
    v_s1,
    v_s2,
    loc_s0,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # Every lane reads the token's slot (one broadcast load), so the pool check below is a
    # tile-shaped mask (a scalar-and-tile mask trips TRITON_INTERPRET=1).
    slot = tl.load(loc_ptr + token * loc_s0 + heads * 0 + dims * 0).to(tl.int64)
    # A slot outside the pool is dropped rather than written out of bounds: the launcher
    # cannot check slot values without a host sync.
    mask = (heads < num_heads) & (dims < head_dim) & (slot >= 0) & (slot < num_slots)

    k = tl.load(k_ptr + token * k_s0 + heads * k_s1 + dims * k_s2, mask=mask)
    tl.store(k_buffer_ptr + slot * kb_s0 + heads * kb_s1 + dims * kb_s2, k.to(k_buffer_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * v_s0 + heads * v_s1 + dims * v_s2, mask=mask)
    tl.store(v_buffer_ptr + slot * vb_s0 + heads * vb_s1 + dims * vb_s2, v.to(v_buffer_ptr.dtype.element_ty), mask=mask)


def _check(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    tensors = {"k_buffer": k_buffer, "v_buffer": v_buffer, "loc": loc, "k": k, "v": v}
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError(
            "store_kv: tensors on different devices: " + ", ".join(f"{n} {t.device}" for n, t in tensors.items())
        )
    if k_buffer.device.type != "cuda" and isinstance(_store_kv_kernel, triton.runtime.JITFunction):
        raise ValueError(
            f"store_kv: tensors on {k_buffer.device}; the Triton kernel needs CUDA "
            "tensors (CPU tensors only under TRITON_INTERPRET=1)"
        )
    if loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"store_kv: loc must hold int32 or int64 slot ids, got {loc.dtype}")
    for name, t in tensors.items():
        if name != "loc" and not t.is_floating_point():
            raise ValueError(f"store_kv: {name} must be a float tensor, got {t.dtype}")
    if (
        k_buffer.dim() != 3
        or v_buffer.shape != k_buffer.shape
        or k.dim() != 3
        or v.shape != k.shape
        or k.shape[1:] != k_buffer.shape[1:]
        or loc.dim() != 1
        or loc.shape[0] != k.shape[0]
    ):
        raise ValueError(
            f"store_kv: buffers {tuple(k_buffer.shape)} / {tuple(v_buffer.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, loc {tuple(loc.shape)} do not fit"
        )


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v, cast to the buffers' dtype (mutates the buffers
    IN PLACE; returns None).

    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim] float (fp32 / fp16 / bf16 / fp8),
                        cuda, any strides
    loc:  [num_tokens] int32 or int64 slot ids in 0..num_slots, same device
    k, v: [num_tokens, num_kv_heads, head_dim] float, same device; any strides, e.g. row views
          of a fused q|k|v projection (stride(0) > num_kv_heads * head_dim)

    One program per (token, block of heads). Reads only shapes and strides on the host, so it
    can be captured in a CUDA graph; for that reason slot values are not checked: a slot
    outside 0..num_slots is skipped (the reference raises IndexError), and with repeated slots
    which token's write lands is unspecified (the allocator never repeats one in a batch).
    Raises ValueError for mismatched shapes, a non-integer (or not int32 / int64) loc, non-float
    k / v / buffers, tensors on different devices, or CPU tensors outside TRITON_INTERPRET=1.
    """
    _check(k_buffer, v_buffer, loc, k, v)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0 or num_heads == 0 or head_dim == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _MAX_TILE // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        k_buffer,
        v_buffer,
        loc,
        k,
        v,
        k_buffer.shape[0],
        num_heads,
        head_dim,
        *k_buffer.stride(),
        *v_buffer.stride(),
        *k.stride(),
        *v.stride(),
        loc.stride(0),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
