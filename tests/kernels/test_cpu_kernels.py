"""The native CPU kernels of pyserve_kernels (Rust, kernels/cpu) against the torch references
in pyserve_kernels.reference, on float32 CPU tensors: values, edge cases, errors, and that the
thread count does not change results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pyserve_kernels as K
from pyserve_kernels import _native, reference


def test_native_module_is_built_and_runs_on_torchs_openmp_team() -> None:
    assert _native.native_available()
    # Linux x86 torch wheels run on libgomp; the kernels then share its thread team.
    if _native._torch_libgomp() is not None:
        assert _native._cpu._uses_openmp()


def paged_batch(seq_lens: list[int], num_slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_indptr [B + 1] int64 and kv_indices int32: distinct random slots per request (1..)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots - 1, generator=gen)[: sum(seq_lens)] + 1
    indptr = torch.tensor([0] + seq_lens).cumsum(0)
    return indptr, slots.to(torch.int32)


def sdpa_decode(q, k_buffer, v_buffer, indptr, indices, scaling, window=None) -> torch.Tensor:
    """Independent check of the reference: per request, torch SDPA with GQA heads."""
    out = []
    group = q.shape[1] // k_buffer.shape[1]
    for b in range(q.shape[0]):
        start, end = int(indptr[b]), int(indptr[b + 1])
        if window is not None:
            start = max(start, end - window)
        slots = indices[start:end].long()
        keys = k_buffer[slots].repeat_interleave(group, 1).transpose(0, 1)  # [H, n, D]
        values = v_buffer[slots].repeat_interleave(group, 1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[b][:, None], keys, values, scale=scaling)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 80), (8, 1, 8), (12, 2, 128), (6, 6, 32)])
def test_decode_attention_matches_reference(heads, kv_heads, head_dim, num_threads) -> None:
    # ragged lengths incl. 1 and a long one (splits across threads), several group sizes and
    # head_dims that are and are not multiples of the SIMD tile widths
    seq_lens = [1, 7, 300, 64, 33, 129, 2, 250]
    num_slots = sum(seq_lens) + 50
    torch.manual_seed(head_dim)
    q = torch.randn(len(seq_lens), heads, head_dim)
    k_buffer = torch.randn(num_slots, kv_heads, head_dim)
    v_buffer = torch.randn(num_slots, kv_heads, head_dim)
    indptr, indices = paged_batch(seq_lens, num_slots, seed=heads)
    scaling = head_dim**-0.5
    got = K.decode_attention(q, k_buffer, v_buffer, indptr, indices, scaling)
    want = reference.decode_attention(q, k_buffer, v_buffer, indptr, indices, scaling)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    torch.testing.assert_close(want, sdpa_decode(q, k_buffer, v_buffer, indptr, indices, scaling), atol=2e-6, rtol=0)


def test_decode_attention_sliding_window_and_empty_request() -> None:
    seq_lens = [20, 0, 5, 9]
    num_slots = 64
    torch.manual_seed(1)
    q = torch.randn(4, 4, 16)
    k_buffer, v_buffer = torch.randn(num_slots, 2, 16), torch.randn(num_slots, 2, 16)
    indptr, indices = paged_batch(seq_lens, num_slots, seed=2)
    got = K.decode_attention(q, k_buffer, v_buffer, indptr, indices, 0.25, sliding_window=8)
    ref = reference.decode_attention(q, k_buffer, v_buffer, indptr, indices, 0.25, sliding_window=8)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=0)
    assert torch.equal(got[1], torch.zeros(4, 16))  # no keys: zeros
    # request 0 sees only its last 8 keys: same as attending over those 8 slots alone
    last8 = indices[12:20]
    alone = K.decode_attention(q[:1], k_buffer, v_buffer, torch.tensor([0, 8]), last8, 0.25)
    torch.testing.assert_close(got[:1], alone, atol=1e-6, rtol=0)


def test_decode_attention_writes_into_out_and_leaves_inputs() -> None:
    torch.manual_seed(3)
    q, k_buffer, v_buffer = torch.randn(2, 2, 16), torch.randn(10, 1, 16), torch.randn(10, 1, 16)
    indptr, indices = torch.tensor([0, 3, 5]), torch.tensor([1, 2, 3, 4, 9], dtype=torch.int32)
    copies = [t.clone() for t in (q, k_buffer, v_buffer)]
    out = torch.full((2, 2, 16), 7.0)
    assert K.decode_attention(q, k_buffer, v_buffer, indptr, indices, 0.5, out=out) is out
    torch.testing.assert_close(
        out, reference.decode_attention(q, k_buffer, v_buffer, indptr, indices, 0.5), atol=1e-6, rtol=0
    )
    assert all(torch.equal(a, b) for a, b in zip(copies, (q, k_buffer, v_buffer)))


def test_decode_attention_rejects_bad_input_untouched() -> None:
    q, k_buffer, v_buffer = torch.randn(2, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    indptr, indices = torch.tensor([0, 3, 5]), torch.tensor([1, 2, 3, 4, 9], dtype=torch.int32)
    out = torch.full((2, 4, 16), 7.0)
    with pytest.raises(IndexError, match="slot 10 is outside the pool of 10 slots"):
        K.decode_attention(
            q, k_buffer, v_buffer, indptr, torch.tensor([1, 2, 3, 4, 10], dtype=torch.int32), 0.5, out=out
        )
    with pytest.raises(IndexError, match="kv_indptr must rise"):
        K.decode_attention(q, k_buffer, v_buffer, torch.tensor([0, 4, 3]), indices, 0.5, out=out)
    with pytest.raises(IndexError, match="kv_indptr must rise"):
        K.decode_attention(q, k_buffer, v_buffer, torch.tensor([0, 3, 6]), indices, 0.5, out=out)
    assert torch.equal(out, torch.full((2, 4, 16), 7.0))
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        K.decode_attention(torch.randn(2, 3, 16), k_buffer, v_buffer, indptr, indices, 0.5)
    with pytest.raises(ValueError, match="kv_indptr has 2 entries, expected batch \\+ 1 = 3"):
        K.decode_attention(q, k_buffer, v_buffer, torch.tensor([0, 3]), indices, 0.5)
    with pytest.raises(ValueError, match="must be float32 on cpu"):
        K.decode_attention(q.double(), k_buffer, v_buffer, indptr, indices, 0.5)
    with pytest.raises(ValueError, match="shapes do not fit"):
        K.decode_attention(q, k_buffer, v_buffer[:, :, :8], indptr, indices, 0.5)
    with pytest.raises(ValueError, match="k_buffer must be C-contiguous"):
        K.decode_attention(q, k_buffer.transpose(0, 1).contiguous().transpose(0, 1), v_buffer, indptr, indices, 0.5)


@pytest.mark.parametrize("shape", [(1, 7), (5, 576), (2048, 576), (3, 4, 64)])
def test_rms_norm_and_fused_add_match_reference(shape, num_threads) -> None:
    torch.manual_seed(shape[0])
    x, residual = torch.randn(shape) * 3, torch.randn(shape)
    weight = 1.0 + 0.2 * torch.randn(shape[-1])
    torch.testing.assert_close(K.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-6)
    want_normed, want_sum = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    normed, total = K.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    assert torch.equal(total, want_sum)  # the add is exact
    torch.testing.assert_close(normed, want_normed, atol=1e-6, rtol=1e-6)


def test_fused_add_rms_norm_works_in_place_on_native_path() -> None:
    x, residual, weight = torch.randn(4, 32), torch.randn(4, 32), torch.rand(32)
    want = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    normed, total = K.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert normed.data_ptr() == x.data_ptr() and total.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(normed, want[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="x \\(4, 32\\) != residual \\(4, 16\\)"):
        K.fused_add_rms_norm(x, residual[:, :16], weight, 1e-6)


def test_norms_fall_back_to_reference_off_the_native_path() -> None:
    x, weight = torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    assert torch.equal(K.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    strided = torch.randn(8, 3).t()  # not contiguous
    assert torch.equal(K.rms_norm(strided, torch.ones(8), 1e-6), reference.rms_norm(strided, torch.ones(8), 1e-6))
    with pytest.raises(ValueError, match="hidden 8 != weight 4"):
        K.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6)


@pytest.mark.parametrize("tokens", [1, 3000])
def test_rotary_in_place_equals_reference_bit_for_bit(tokens, num_threads) -> None:
    heads, kv_heads, head_dim = 9, 3, 64
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    angles = torch.rand(tokens, head_dim // 2) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    want_q, want_k = reference.apply_rotary_pos_emb(q, k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    out = K.rotary_embedding_(qkv, cos, sin, heads + kv_heads, head_dim)
    assert out is qkv
    assert torch.equal(qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim), want_q)
    assert torch.equal(
        qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim), want_k
    )
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


def test_rotary_fallback_and_errors() -> None:
    x = torch.randn(2, 24, dtype=torch.float64)
    cos, sin = torch.rand(2, 8, dtype=torch.float64), torch.rand(2, 8, dtype=torch.float64)
    want, _ = reference.apply_rotary_pos_emb(x[:, :16].reshape(2, 2, 8), x[:, :0].reshape(2, 0, 8), cos, sin)
    rest = x[:, 16:].clone()
    K.rotary_embedding_(x, cos, sin, 2, 8)
    assert torch.equal(x[:, :16].reshape(2, 2, 8), want) and torch.equal(x[:, 16:], rest)
    with pytest.raises(ValueError, match="rotary_embedding_"):
        K.rotary_embedding_(torch.randn(2, 24), torch.rand(2, 7), torch.rand(2, 7), 2, 7)
    with pytest.raises(ValueError, match="rotary_embedding_"):
        K.rotary_embedding_(torch.randn(2, 24), torch.rand(2, 8), torch.rand(2, 8), 4, 8)


@pytest.mark.parametrize("shape", [(1, 2 * 37), (64, 2 * 1536), (3, 5, 2 * 16)])
def test_silu_and_mul_matches_reference(shape, num_threads) -> None:
    torch.manual_seed(shape[0])
    x = torch.randn(shape) * 6
    x.view(-1)[:4] = torch.tensor([100.0, -100.0, 0.0, -0.0])
    torch.testing.assert_close(K.silu_and_mul(x), reference.silu_and_mul(x), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="last dim 7 is odd"):
        K.silu_and_mul(torch.randn(2, 7))


def test_store_kv_writes_rows_of_strided_views_and_refuses_bad_slots() -> None:
    k_buffer, v_buffer = torch.zeros(10, 3, 4), torch.zeros(10, 3, 4)
    qkv = torch.randn(5, 40)
    k, v = qkv[:, 16:28].view(5, 3, 4), qkv[:, 28:40].view(5, 3, 4)  # rows strided by 40
    loc = torch.tensor([3, 1, 9, 2, 0])
    K.store_kv(k_buffer, v_buffer, loc, k, v)
    want_k, want_v = torch.zeros(10, 3, 4), torch.zeros(10, 3, 4)
    reference.store_kv(want_k, want_v, loc, k, v)
    assert torch.equal(k_buffer, want_k) and torch.equal(v_buffer, want_v)
    before = k_buffer.clone()
    with pytest.raises(IndexError, match="slot 10 is outside the pool of 10 slots"):
        K.store_kv(k_buffer, v_buffer, torch.tensor([1, 2, 3, 4, 10]), k, v)
    with pytest.raises(IndexError, match="slot -1"):
        K.store_kv(k_buffer, v_buffer, torch.tensor([1, 2, 3, 4, -1]), k, v)
    assert torch.equal(k_buffer, before)
    with pytest.raises(ValueError, match="do not fit"):
        K.store_kv(k_buffer, v_buffer, loc[:4], k, v)


def test_fortran_ordered_arrays_are_refused_not_misread() -> None:
    import numpy as np

    k, v, q = torch.randn(16, 2, 8), torch.randn(16, 2, 8), torch.randn(2, 4, 8)
    fortran = k.permute(2, 1, 0).contiguous().permute(2, 1, 0)  # same values, column-major
    with pytest.raises(ValueError, match="k_buffer must be C-contiguous"):
        K.decode_attention(q, fortran, v, torch.tensor([0, 5, 9]), torch.arange(9), 0.3)
    x = np.random.rand(4, 6).astype(np.float32)
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        _native._cpu.rms_norm(np.asfortranarray(x), np.ones(6, np.float32), 1e-6, np.empty_like(x), 1)


def test_overlapping_tensors_are_refused_untouched() -> None:
    x, weight = torch.randn(4, 8), torch.rand(8)
    before = x.clone()
    with pytest.raises(ValueError, match="x overlaps residual in memory"):
        K.fused_add_rms_norm(x, x, weight, 1e-6)
    with pytest.raises(ValueError, match="x overlaps weight in memory"):
        K.fused_add_rms_norm(x, torch.randn(4, 8), x[0], 1e-6)
    assert torch.equal(x, before)
    k_buffer, v_buffer = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    k_before = k_buffer.clone()
    with pytest.raises(ValueError, match="k_buffer overlaps k in memory"):
        K.store_kv(k_buffer, v_buffer, torch.tensor([1, 2, 3]), k_buffer[0:3], torch.randn(3, 2, 8))
    assert torch.equal(k_buffer, k_before)
    q = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="out overlaps q in memory"):
        K.decode_attention(q, k_buffer, v_buffer, torch.tensor([0, 3, 5]), torch.arange(5), 0.3, out=q)


def test_indices_that_do_not_fit_int32_are_refused_not_wrapped() -> None:
    q, k_buffer, v_buffer = torch.randn(2, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    indptr = torch.tensor([0, 3, 5])
    with pytest.raises(IndexError, match="kv_indices holds 4294967299, outside torch.int32"):
        K.decode_attention(q, k_buffer, v_buffer, indptr, torch.tensor([0, 1, 2, 2**32 + 3, 4]), 0.3)
    with pytest.raises(ValueError, match="kv_indices must hold integers"):
        K.decode_attention(q, k_buffer, v_buffer, indptr, torch.tensor([0.0, 1.7, 2, 3, 4]), 0.3)
    with pytest.raises(ValueError, match="loc must hold integers"):
        K.store_kv(k_buffer, v_buffer, torch.tensor([1.9]), torch.randn(1, 2, 8), torch.randn(1, 2, 8))


def test_degenerate_shapes_are_no_ops() -> None:
    k_buffer = torch.randn(16, 2, 8)
    out = K.decode_attention(
        torch.zeros(2, 0, 8), k_buffer, k_buffer.clone(), torch.tensor([0, 3, 5]), torch.arange(5), 0.3
    )
    assert out.shape == (2, 0, 8)
    x = torch.zeros(3, 0)
    assert K.rotary_embedding_(x, torch.rand(3, 4), torch.rand(3, 4), 0, 4) is x
    with pytest.raises(IndexError, match="slot 7 is outside the pool of 5 slots"):
        _native._cpu.store_kv(
            *(t.numpy() for t in (torch.zeros(5, 0, 8), torch.zeros(5, 0, 8))),
            torch.tensor([7], dtype=torch.int32).numpy(),
            torch.zeros(1, 0, 8).numpy(),
            torch.zeros(1, 0, 8).numpy(),
        )
