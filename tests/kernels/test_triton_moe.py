"""The Triton fused-expert kernel (pyserve_kernels.triton_ops.moe) against the fp32 torch
reference `pyserve_kernels.reference.fused_experts`: the block-aligned sort of the assignments,
values at decode and prefill sizes with experts left without tokens, and the launcher's errors.
Off CUDA it runs on CPU tensors under TRITON_INTERPRET=1 (float32; float16 and bfloat16 are
checked on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pyserve_kernels import reference  # noqa: E402
from pyserve_kernels.triton_ops.moe import align_block_size, fused_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}


def test_align_block_size_groups_each_expert_in_whole_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]], device=DEVICE)
    sorted_ids, block_expert = align_block_size(ids, num_experts=5, block_m=4)
    total = ids.numel()  # 8 assignments; padding rows hold 8
    # assignment t·k + j: expert 0 gets 1, 4; expert 2: 0, 2, 5, 7; expert 3: 3, 6; 1 and 4 none
    assert sorted_ids.tolist()[:12] == [1, 4, total, total, 0, 2, 5, 7, 3, 6, total, total]
    assert (sorted_ids[12:] == total).all()
    assert sorted_ids.numel() == 24  # the static bound 8 + 5 * 3 = 23, rounded up to a block
    assert block_expert.tolist() == [0, 2, 3, -1, -1, -1]


def experts(e: int, h: int, inter: int, t: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    gate_up = torch.randn(e, 2 * inter, h, generator=gen) / h**0.5
    down = torch.randn(e, h, inter, generator=gen) / inter**0.5
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    return [
        v.to(device=DEVICE, dtype=dtype) if v.is_floating_point() else v.to(DEVICE)
        for v in (x, gate_up, down, weights, ids)
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (3, 8, 3), (37, 6, 2)])
def test_fused_experts_equal_the_reference(dtype, t: int, e: int, k: int) -> None:
    x, gate_up, down, weights, ids = experts(e, 48, 40, t, k, dtype, seed=t)
    got = fused_experts(x, gate_up, down, weights, ids)
    want = reference.fused_experts(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    rtol, atol = TOLERANCE[dtype]
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


def test_launcher_errors() -> None:
    x, gate_up, down, weights, ids = experts(4, 32, 16, 2, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="share a float dtype"):
        fused_experts(x.double(), gate_up, down, weights, ids)
    with pytest.raises(ValueError, match="do not fit"):
        fused_experts(x, gate_up, down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="below tl.dot's 16 rows"):
        fused_experts(x, gate_up, down, weights, ids, block_m=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_experts_on_cuda_at_a_model_like_shape(dtype) -> None:
    x, gate_up, down, weights, ids = experts(16, 512, 256, 64, 4, dtype, seed=9)
    got = fused_experts(x, gate_up, down, weights, ids)
    want = reference.fused_experts(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)
