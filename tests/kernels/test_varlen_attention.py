"""The native varlen (encoder) attention kernel against the torch reference and against
per-sequence SDPA: values on ragged batches of odd lengths and head sizes, thread counts that
give the same bits, and the errors a bad call raises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyserve_kernels import reference, varlen_attention


def ragged(lens: list[int], heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lens), 3 * heads * head_dim, generator=gen) * 2
    return qkv, torch.tensor([0] + lens).cumsum(0)


@pytest.mark.parametrize(
    ("lens", "heads", "head_dim"),
    [([1], 1, 16), ([5, 1, 17, 64, 65, 130], 12, 32), ([7, 33, 2], 2, 24), ([200, 3, 129], 4, 64), ([9, 12], 3, 8)],
)
def test_matches_per_sequence_sdpa(lens: list[int], heads: int, head_dim: int) -> None:
    """As close to float64 SDPA as torch's own float32 reference is (at most 1.5x its largest
    error, plus 1e-6): scores of these inputs reach |x| ~ 20, so float32 rounding shows."""
    qkv, cu = ragged(lens, heads, head_dim, seed=sum(lens))
    out = varlen_attention(qkv, cu, heads)
    rows = []
    for start, end in zip(cu.tolist(), cu.tolist()[1:]):
        q, k, v = (t.view(end - start, heads, head_dim).transpose(0, 1) for t in qkv[start:end].double().chunk(3, 1))
        rows.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(end - start, heads * head_dim))
    exact = torch.cat(rows)
    torch_error = (reference.varlen_attention(qkv, cu, heads, head_dim**-0.5).double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 1.5 * torch_error + 1e-6


def test_scaling_and_an_empty_sequence() -> None:
    qkv, _ = ragged([4, 6], 2, 16, seed=3)
    cu = torch.tensor([0, 4, 4, 10])  # the middle sequence is empty
    out = varlen_attention(qkv, cu, 2, scaling=0.3)
    torch.testing.assert_close(out, reference.varlen_attention(qkv, cu, 2, 0.3), atol=2e-6, rtol=0)


def test_thread_counts_give_the_same_bits() -> None:
    qkv, cu = ragged([40, 300, 7, 90, 64], 4, 32, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = varlen_attention(qkv, cu, 4)
        torch.set_num_threads(2)
        two = varlen_attention(qkv, cu, 4)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_calls_raise() -> None:
    qkv, cu = ragged([3, 5], 2, 8, seed=1)
    with pytest.raises(IndexError, match="cu_seqlens must rise from 0 to the number of tokens, 8"):
        varlen_attention(qkv, torch.tensor([0, 3, 7]), 2)
    with pytest.raises(IndexError, match="cu_seqlens must rise"):
        varlen_attention(qkv, torch.tensor([0, 5, 3, 8]), 2)
    with pytest.raises(ValueError, match=r"qkv \(8, 48\) is not \[num_tokens, 3 \* 5 \* head_dim\]"):
        varlen_attention(qkv, cu, 5)
    with pytest.raises(ValueError, match="must be a C-contiguous float32 cpu tensor"):
        varlen_attention(qkv.double(), cu, 2)
    with pytest.raises(ValueError, match="cu_seqlens must hold integers"):
        varlen_attention(qkv, cu.float(), 2)
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D cpu tensor, got \(1, 3\)"):
        varlen_attention(qkv, cu.view(1, 3), 2)
    with pytest.raises(ValueError, match="num_heads must be positive, got 0"):
        varlen_attention(qkv, cu, 0)
    with pytest.raises(ValueError, match=r"qkv \(8, 0\) is not"):
        varlen_attention(qkv[:, :0].contiguous(), cu, 2)
