"""Triton kernel of the grammar token mask (the CUDA path of
`pyserve_kernels.apply_token_bitmask_`; semantics: `pyserve_kernels.reference.apply_token_bitmask_`):
logits of the tokens a packed bitmask disallows become -inf."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyserve_kernels.reference import check_token_bitmask

# Mask words one program reads at most (32 tokens each): 4096 logits per program, so a
# 150k-token vocabulary is ~40 programs per masked row.
_MAX_WORDS = 128


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    batch,
    vocab,
    num_words,
    logits_s0,
    bitmask_s0,
    bitmask_s1,
    rows_s0,
    WORDS: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64)
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)[:, None]  # [WORDS, 1]
    bits = tl.arange(0, 32)[None, :]  # [1, 32]
    tokens = words * 32 + bits  # [WORDS, 32]
    # Every lane reads the row index (one broadcast load), so the range check below is a
    # tile-shaped mask (a scalar-and-tile mask trips TRITON_INTERPRET=1).
    row = tl.load(rows_ptr + k * rows_s0 + tokens * 0).to(tl.int64)
    word = tl.load(bitmask_ptr + k * bitmask_s0 + words * bitmask_s1, mask=words < num_words, other=-1)
    disallowed = ((word >> bits) & 1) == 0
    # A row outside the batch is skipped rather than written out of bounds: the launcher
    # cannot check row values without a host sync.
    mask = disallowed & (tokens < vocab) & (row >= 0) & (row < batch)
    # Only -inf is stored, and only where disallowed: allowed logits are never read or
    # rewritten, so they keep their bits exactly.
    neg_inf = tl.full([WORDS, 32], float("-inf"), tl.float32)
    tl.store(logits_ptr + row * logits_s0 + tokens, neg_inf, mask=mask)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """For each k, logits[rows[k], t] = -inf for every token t whose bit in bitmask[k] is 0
    (xgrammar's layout: bit j, least significant first, of int32 word w is token 32 w + j; bits
    of ids >= vocab are ignored). Mutates logits IN PLACE; returns None.

    logits:  [batch, vocab] float32, cuda, contiguous rows (any row stride)
    bitmask: [num_masked, ceil(vocab / 32)] int32, same device, any strides
    rows:    [num_masked] int32, same device: mask row k applies to logits row rows[k]

    One program per (mask row, block of up to 128 words), on the current CUDA stream. Reads
    only shapes and strides on the host, so it can be captured in a CUDA graph; for that reason
    row values are not checked: a row outside 0..batch is skipped (the reference raises
    ValueError), and a repeated row gets the union of its masks' -inf.
    Raises ValueError for what `reference.check_token_bitmask` rejects (dtypes, shapes, devices,
    non-contiguous rows) or CPU tensors outside TRITON_INTERPRET=1.
    """
    check_token_bitmask(logits, bitmask, rows)
    if logits.device.type != "cuda" and isinstance(_apply_token_bitmask_kernel, triton.runtime.JITFunction):
        raise ValueError(
            f"apply_token_bitmask_: tensors on {logits.device}; the Triton kernel needs CUDA "
            "tensors (CPU tensors only under TRITON_INTERPRET=1)"
        )
    batch, vocab = logits.shape
    num_masked, num_words = bitmask.shape
    if num_masked == 0 or vocab == 0:
        return
    words = min(triton.next_power_of_2(num_words), _MAX_WORDS)
    grid = (num_masked, triton.cdiv(num_words, words))
    _apply_token_bitmask_kernel[grid](
        logits,
        bitmask,
        rows,
        batch,
        vocab,
        num_words,
        logits.stride(0),
        *bitmask.stride(),
        rows.stride(0),
        WORDS=words,
    )
