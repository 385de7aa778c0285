"""The Triton kernels of pyserve_kernels.triton_ops (KV store, RMSNorm plain and fused with the
residual add, rotary embedding, SiLU-and-mul) against the fp32 torch references in
pyserve_kernels.reference: values, in-place contracts, strided views, and launcher errors. On a
machine without CUDA they run on CPU tensors under TRITON_INTERPRET=1 (float32 and float16; the
interpreter's bfloat16 math is not trusted, so bfloat16 is checked only on CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pyserve.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq  # noqa: E402
from pyserve_kernels import reference  # noqa: E402
from pyserve_kernels.triton_ops import activation, kv_store, norm, rotary  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (rtol, atol) against the fp32 reference rounded to the dtype.
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- store_kv


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "k_dtype,pool_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float16)],
)
def test_store_kv_writes_strided_rows_of_fused_qkv_into_their_slots(loc_dtype, k_dtype, pool_dtype) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim, num_slots = 5, 4, 2, 16, 12
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=k_dtype, seed=1)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    _, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous() and k.stride() == (qkv.shape[1], head_dim, 1)
    k_buffer = randn(num_slots, num_kv_heads, head_dim, dtype=pool_dtype, seed=2)
    v_buffer = randn(num_slots, num_kv_heads, head_dim, dtype=pool_dtype, seed=3)
    loc = torch.tensor([7, 0, 11, 3, 4], dtype=loc_dtype, device=DEVICE)
    k_expected, v_expected = k_buffer.clone(), v_buffer.clone()
    reference.store_kv(k_expected, v_expected, loc, k, v)

    assert kv_store.store_kv(k_buffer, v_buffer, loc, k, v) is None

    # a copy with a cast: exact, and the slots not in loc keep their old bits
    assert torch.equal(k_buffer, k_expected)
    assert torch.equal(v_buffer, v_expected)


def test_store_kv_splits_many_heads_over_programs_and_skips_slots_outside_the_pool() -> None:
    # 40 heads of 128 exceed one program's tile, so the head dim is split across programs.
    num_tokens, num_kv_heads, head_dim, num_slots = 3, 40, 128, 6
    k = randn(num_tokens, num_kv_heads, head_dim, seed=4)
    v = randn(num_tokens, num_kv_heads, head_dim, seed=5)
    k_buffer = torch.zeros(num_slots, num_kv_heads, head_dim, device=DEVICE)
    v_buffer = torch.zeros_like(k_buffer)
    loc = torch.tensor([2, num_slots, 5], device=DEVICE)  # the middle slot is out of range

    kv_store.store_kv(k_buffer, v_buffer, loc, k, v)

    k_expected = torch.zeros_like(k_buffer)
    v_expected = torch.zeros_like(v_buffer)
    k_expected[[2, 5]] = k[[0, 2]]
    v_expected[[2, 5]] = v[[0, 2]]
    assert torch.equal(k_buffer, k_expected)
    assert torch.equal(v_buffer, v_expected)


def test_store_kv_with_no_tokens_writes_nothing() -> None:
    k_buffer = randn(4, 2, 8, seed=6)
    before = k_buffer.clone()
    empty = torch.empty(0, 2, 8, device=DEVICE)
    kv_store.store_kv(k_buffer, k_buffer.clone(), torch.empty(0, dtype=torch.int64, device=DEVICE), empty, empty)
    assert torch.equal(k_buffer, before)


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [96, 576, 64])
def test_rms_norm_matches_reference_into_a_poisoned_out(dtype, hidden) -> None:
    x = randn(6, hidden, dtype=dtype, seed=7) * 3
    weight = randn(hidden, dtype=dtype, seed=8)
    x_before = x.clone()
    out = torch.full_like(x, float("nan"))

    result = norm.rms_norm(x, weight, 1e-6, out=out)

    assert result is out
    assert_close(out, reference.rms_norm(x_before, weight, 1e-6))
    assert torch.equal(x, x_before)


def test_rms_norm_allocates_the_promoted_dtype_and_takes_higher_dims() -> None:
    x = randn(2, 3, 96, dtype=torch.float16, seed=9)
    weight = randn(96, seed=10)  # float32 weight: the reference promotes to float32

    out = norm.rms_norm(x, weight, 1e-5)

    assert out.shape == (2, 3, 96) and out.dtype == torch.float32
    assert_close(out, reference.rms_norm(x, weight, 1e-5))


def test_rms_norm_in_place_into_x() -> None:
    x = randn(4, 576, seed=11)
    weight = randn(576, seed=12)
    expected = reference.rms_norm(x, weight, 1e-6)
    assert norm.rms_norm(x, weight, 1e-6, out=x) is x
    assert_close(x, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [96, 576])
def test_rms_norm_chunked_rows(monkeypatch, dtype, hidden) -> None:
    # A block smaller than the row walks it in chunks (the path of rows > MAX_BLOCK_SIZE).
    monkeypatch.setattr(norm, "MAX_BLOCK_SIZE", 64)
    x = randn(3, hidden, dtype=dtype, seed=13)
    weight = randn(hidden, dtype=dtype, seed=14)
    out = torch.full_like(x, float("nan"))
    norm.rms_norm(x, weight, 1e-6, out=out)
    assert_close(out, reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("chunk", [None, 64], ids=["one-block", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [96, 576])
def test_fused_add_rms_norm_writes_normed_into_x_and_sum_into_residual(monkeypatch, chunk, dtype, hidden) -> None:
    if chunk is not None:
        monkeypatch.setattr(norm, "MAX_BLOCK_SIZE", chunk)
    x = randn(5, hidden, dtype=dtype, seed=15)
    residual = randn(5, hidden, dtype=dtype, seed=16) * 2
    weight = randn(hidden, dtype=dtype, seed=17)
    normed_expected, sum_expected = reference.fused_add_rms_norm(x, residual, weight, 1e-6)

    normed, new_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-6)

    assert normed is x and new_residual is residual
    # the sum is rounded once to the dtype, as torch's x + residual
    assert torch.equal(residual, sum_expected)
    assert_close(x, normed_expected)


def test_fused_add_rms_norm_on_row_views_and_higher_dims() -> None:
    # x: every other row of a bigger tensor (stride(0) = 2 * hidden); residual: [2, 3, hidden]
    base = randn(12, 96, seed=18)
    x = base[::2]
    residual = randn(2, 3, 96, seed=19)
    weight = randn(96, seed=20)
    normed_expected, sum_expected = reference.fused_add_rms_norm(x, residual.view(6, 96), weight, 1e-6)
    odd_rows = base[1::2].clone()

    norm.fused_add_rms_norm(x, residual.view(6, 96), weight, 1e-6)

    assert torch.equal(residual.view(6, 96), sum_expected)
    assert_close(base[::2], normed_expected)
    assert torch.equal(base[1::2], odd_rows)


# ---------------------------------------------------------------- rotary embedding


def rope_cos_sin(head_dim: int, rope: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] float32 from pyserve's own cache for `rope`."""
    return RotaryEmbedding(head_dim, 64, rope, device=DEVICE).get_cos_sin(positions.to(DEVICE))


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0, "max_position_embeddings": 64},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 80])
def test_rotary_rotates_q_and_k_of_a_fused_row_and_leaves_v_bit_equal(dtype, head_dim) -> None:
    num_tokens, num_heads, num_kv_heads = 5, 4, 2
    positions = torch.tensor([0, 1, 7, 30, 63])
    cos, sin = rope_cos_sin(head_dim, ROPES["default"], positions)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=21)
    q, k, v = (t.clone().view(num_tokens, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    q_expected, k_expected = reference.apply_rotary_pos_emb(q, k, cos, sin)

    assert rotary.rotary_embedding_(qkv, cos, sin, num_heads + num_kv_heads, head_dim) is qkv

    q_out, k_out, v_out = qkv.split([q_size, kv_size, kv_size], dim=-1)
    assert_close(q_out.reshape(q_expected.shape), q_expected)
    assert_close(k_out.reshape(k_expected.shape), k_expected)
    assert torch.equal(v_out.reshape(v.shape), v)


def test_rotary_on_a_column_slice_rotates_only_the_k_heads() -> None:
    # The caller may rotate q and k separately through views with a storage offset.
    num_tokens, num_heads, num_kv_heads, head_dim = 4, 4, 2, 32
    positions = torch.tensor([3, 9, 17, 40])
    cos, sin = rope_cos_sin(head_dim, ROPES["default"], positions)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, seed=22)
    before = qkv.clone()
    k_expected = reference.rotary(before[:, q_size : q_size + kv_size].view(num_tokens, -1, head_dim), cos, sin)

    rotary.rotary_embedding_(qkv[:, q_size:], cos, sin, num_kv_heads, head_dim)

    assert torch.equal(qkv[:, :q_size], before[:, :q_size])
    assert_close(qkv[:, q_size : q_size + kv_size].reshape(k_expected.shape), k_expected)
    assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])


@pytest.mark.parametrize("rope_name", list(ROPES))
def test_rotary_with_each_rope_variants_cos_sin(rope_name) -> None:
    num_tokens, num_heads, head_dim = 6, 3, 64
    # positions past max_position_embeddings (64) so dynamic NTK rescales its base
    positions = torch.tensor([0, 5, 31, 63, 90, 127])
    rope = ROPES[rope_name]
    cos, sin = rope_cos_sin(head_dim, rope, positions)
    if rope_name != "default":  # the variant's frequencies really differ from the default's
        assert not torch.allclose(
            compute_inv_freq(head_dim, rope, seq_len=128), compute_inv_freq(head_dim, ROPES["default"])
        )
        assert not torch.allclose(cos, rope_cos_sin(head_dim, ROPES["default"], positions)[0])
    x = randn(num_tokens, num_heads * head_dim, seed=23)
    expected = reference.rotary(x.view(num_tokens, num_heads, head_dim), cos, sin)

    rotary.rotary_embedding_(x, cos, sin, num_heads, head_dim)

    assert_close(x.view(expected.shape), expected)


def test_rotary_splits_many_heads_over_programs() -> None:
    num_tokens, num_heads, head_dim = 2, 40, 128  # more pairs than one program's tile
    positions = torch.tensor([1, 50])
    cos, sin = rope_cos_sin(head_dim, ROPES["default"], positions)
    x = randn(num_tokens, num_heads * head_dim, seed=24)
    expected = reference.rotary(x.view(num_tokens, num_heads, head_dim), cos, sin)
    rotary.rotary_embedding_(x, cos, sin, num_heads, head_dim)
    assert_close(x.view(expected.shape), expected)


# ---------------------------------------------------------------- SiLU and mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("intermediate", [96, 576, 1500])
def test_silu_and_mul_matches_reference_into_a_poisoned_out(dtype, intermediate) -> None:
    x = randn(4, 2 * intermediate, dtype=dtype, seed=25) * 4
    x_before = x.clone()
    out = torch.full((4, intermediate), float("nan"), dtype=dtype, device=DEVICE)

    assert activation.silu_and_mul(x, out=out) is out

    assert_close(out, reference.silu_and_mul(x_before))
    assert torch.equal(x, x_before)


def test_silu_and_mul_allocates_out_for_higher_dims_and_strided_rows() -> None:
    wide = randn(2, 3, 2 * 96 + 10, seed=26)
    x = wide[..., : 2 * 96]  # rows strided past the gate|up part
    out = activation.silu_and_mul(x)
    assert out.shape == (2, 3, 96) and out.dtype == torch.float32
    assert_close(out, reference.silu_and_mul(x))


# ---------------------------------------------------------------- bfloat16 on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hidden", [96, 576])
def test_bf16_on_cuda(hidden) -> None:
    dtype, head_dim = torch.bfloat16, 64
    x = randn(5, hidden, dtype=dtype, seed=27)
    residual = randn(5, hidden, dtype=dtype, seed=28)
    weight = randn(hidden, dtype=dtype, seed=29)
    assert_close(norm.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    normed_expected, sum_expected = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, sum_expected)
    assert_close(x, normed_expected)

    gate_up = randn(5, 2 * hidden, dtype=dtype, seed=30)
    assert_close(activation.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))

    cos, sin = rope_cos_sin(head_dim, ROPES["llama3"], torch.arange(5) * 20)
    q = randn(5, 3 * head_dim, dtype=dtype, seed=31)
    expected = reference.rotary(q.view(5, 3, head_dim), cos, sin)
    rotary.rotary_embedding_(q, cos, sin, 3, head_dim)
    assert_close(q.view(expected.shape), expected)

    k = randn(5, 2, head_dim, seed=32)
    k_buffer = torch.zeros(8, 2, head_dim, dtype=dtype, device=DEVICE)
    v_buffer = torch.zeros_like(k_buffer)
    loc = torch.tensor([1, 3, 5, 7, 0], dtype=torch.int32, device=DEVICE)
    kv_store.store_kv(k_buffer, v_buffer, loc, k, k)
    assert torch.equal(k_buffer[loc.long()], k.to(dtype))


# ---------------------------------------------------------------- launcher errors


def _kv(num_tokens=3, heads=2, head_dim=8, dtype=torch.float32):
    return torch.zeros(num_tokens, heads, head_dim, dtype=dtype, device=DEVICE)


def _buf():
    return torch.zeros(6, 2, 8, device=DEVICE)


def _loc(dtype=torch.int64, n=3):
    return torch.arange(n, dtype=dtype, device=DEVICE)


ERRORS = {
    "store_kv float loc": (
        lambda: kv_store.store_kv(_buf(), _buf(), _loc(torch.float32), _kv(), _kv()),
        r"store_kv: loc must hold int32 or int64 slot ids, got torch.float32",
    ),
    "store_kv loc length": (
        lambda: kv_store.store_kv(_buf(), _buf(), _loc(n=2), _kv(), _kv()),
        r"store_kv: buffers \(6, 2, 8\) / \(6, 2, 8\), k \(3, 2, 8\), v \(3, 2, 8\), "
        r"loc \(2,\) do not fit",
    ),
    "store_kv head_dim": (
        lambda: kv_store.store_kv(_buf(), _buf(), _loc(), _kv(head_dim=4), _kv(head_dim=4)),
        r"store_kv: buffers .* k \(3, 2, 4\), .* do not fit",
    ),
    "store_kv k != v": (
        lambda: kv_store.store_kv(_buf(), _buf(), _loc(), _kv(), _kv(heads=1)),
        r"store_kv: .* v \(3, 1, 8\), .* do not fit",
    ),
    "store_kv int k": (
        lambda: kv_store.store_kv(_buf(), _buf(), _loc(), _kv(dtype=torch.int32), _kv()),
        r"store_kv: k must be a float tensor, got torch.int32",
    ),
    "rms_norm hidden": (
        lambda: norm.rms_norm(randn(2, 96), randn(64), 1e-6),
        r"rms_norm: x \(2, 96\) does not fit weight \(64,\)",
    ),
    "rms_norm out shape": (
        lambda: norm.rms_norm(randn(2, 96), randn(96), 1e-6, out=randn(3, 96)),
        r"rms_norm: out \(3, 96\) torch.float32, want \(2, 96\) torch.float32",
    ),
    "rms_norm out dtype": (
        lambda: norm.rms_norm(randn(2, 96), randn(96), 1e-6, out=randn(2, 96, dtype=torch.float16)),
        r"rms_norm: out \(2, 96\) torch.float16, want \(2, 96\) torch.float32",
    ),
    "rms_norm float64": (
        lambda: norm.rms_norm(randn(2, 96, dtype=torch.float64), randn(96), 1e-6),
        r"rms_norm: x must be float32, float16 or bfloat16, got torch.float64",
    ),
    "rms_norm not viewable": (
        lambda: norm.rms_norm(randn(4, 3, 96).transpose(0, 1), randn(96), 1e-6),
        r"rms_norm: x \(3, 4, 96\) with strides .* cannot be viewed as \[rows, hidden\]",
    ),
    "fused residual shape": (
        lambda: norm.fused_add_rms_norm(randn(2, 96), randn(3, 96), randn(96), 1e-6),
        r"fused_add_rms_norm: x \(2, 96\) torch.float32 != residual \(3, 96\) torch.float32",
    ),
    "fused residual dtype": (
        lambda: norm.fused_add_rms_norm(randn(2, 96), randn(2, 96, dtype=torch.float16), randn(96), 1e-6),
        r"fused_add_rms_norm: x \(2, 96\) torch.float32 != residual \(2, 96\) torch.float16",
    ),
    "rotary odd head_dim": (
        lambda: rotary.rotary_embedding_(randn(2, 14), randn(2, 7), randn(2, 7), 2, 7),
        r"rotary_embedding_: head_dim 7 must be even and positive",
    ),
    "rotary short row": (
        lambda: rotary.rotary_embedding_(randn(2, 24), randn(2, 8), randn(2, 8), 4, 8),
        r"rotary_embedding_: x \(2, 24\), cos \(2, 8\), sin \(2, 8\) do not fit 4 heads of 8",
    ),
    "rotary cos tokens": (
        lambda: rotary.rotary_embedding_(randn(2, 32), randn(3, 8), randn(3, 8), 4, 8),
        r"rotary_embedding_: x \(2, 32\), cos \(3, 8\), sin \(3, 8\) do not fit",
    ),
    "rotary 3-D x": (
        lambda: rotary.rotary_embedding_(randn(2, 4, 8), randn(2, 8), randn(2, 8), 4, 8),
        r"rotary_embedding_: x \(2, 4, 8\), .* do not fit",
    ),
    "rotary int cos": (
        lambda: rotary.rotary_embedding_(randn(2, 32), randn(2, 8).int(), randn(2, 8), 4, 8),
        r"rotary_embedding_: cos / sin must be float, got torch.int32 / torch.float32",
    ),
    "silu odd": (lambda: activation.silu_and_mul(randn(2, 7)), r"silu_and_mul: last dim of x \(2, 7\) must be even"),
    "silu out shape": (
        lambda: activation.silu_and_mul(randn(2, 8), out=randn(2, 8)),
        r"silu_and_mul: out \(2, 8\) torch.float32, want \(2, 4\) torch.float32",
    ),
    "silu out dtype": (
        lambda: activation.silu_and_mul(randn(2, 8), out=randn(2, 4, dtype=torch.float16)),
        r"silu_and_mul: out \(2, 4\) torch.float16, want \(2, 4\) torch.float32",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_launchers_raise_value_error(case) -> None:
    call, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_launchers_reject_tensors_on_different_devices() -> None:
    # "meta" tensors stand in for a second device on a CPU-only machine.
    meta = torch.device("meta")
    with pytest.raises(ValueError, match=r"store_kv: tensors on different devices: .*loc meta"):
        kv_store.store_kv(_buf(), _buf(), _loc().to(meta), _kv(), _kv())
    with pytest.raises(ValueError, match=r"rms_norm: tensors on different devices: .*weight meta"):
        norm.rms_norm(randn(2, 96), randn(96).to(meta), 1e-6)
    with pytest.raises(
        ValueError,
        match=r"fused_add_rms_norm: tensors on different devices: "
        r".*residual meta",
    ):
        norm.fused_add_rms_norm(randn(2, 96), randn(2, 96).to(meta), randn(96), 1e-6)
    with pytest.raises(
        ValueError,
        match=r"rotary_embedding_: tensors on different devices: "
        r".*sin meta",
    ):
        rotary.rotary_embedding_(randn(2, 32), randn(2, 8), randn(2, 8).to(meta), 4, 8)
    with pytest.raises(ValueError, match=r"silu_and_mul: x on (cpu|cuda:0), out on meta"):
        activation.silu_and_mul(randn(2, 8), out=torch.empty(2, 4, device=meta))


REFUSE_CPU = """
import torch
from pyserve_kernels.triton_ops import activation, kv_store, norm, rotary
x, w, cs = torch.zeros(2, 8), torch.ones(8), torch.zeros(2, 8)
kv, loc = torch.zeros(2, 1, 8), torch.arange(2)
calls = [lambda: kv_store.store_kv(torch.zeros(4, 1, 8), torch.zeros(4, 1, 8), loc, kv, kv),
         lambda: norm.rms_norm(x, w, 1e-6), lambda: norm.fused_add_rms_norm(x, x.clone(), w, 1e-6),
         lambda: rotary.rotary_embedding_(x, cs, cs, 1, 8), lambda: activation.silu_and_mul(x)]
for call in calls:
    try:
        call()
        print("no error")
    except ValueError as e:
        print(e)
"""


def test_launchers_refuse_cpu_tensors_without_the_interpreter() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", REFUSE_CPU], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    ops = ["store_kv", "rms_norm", "fused_add_rms_norm", "rotary_embedding_", "silu_and_mul"]
    lines = result.stdout.splitlines()
    assert len(lines) == len(ops), result.stdout + result.stderr
    for op, line in zip(ops, lines):
        assert line.startswith(f"{op}: ") and line.endswith(
            "the Triton kernel needs CUDA tensors (CPU tensors only under TRITON_INTERPRET=1)"
        ), line
