"""Greedy decoding's row argmax `pyserve_kernels.row_argmax`: the native CPU kernel against
`torch.argmax` / `torch.amax` (the reference) on odd shapes, ties, NaN, +inf and all -inf
rows, with 1 and 2 threads, and its argument errors."""

from __future__ import annotations

import pytest
import torch

import pyserve_kernels as K
from pyserve_kernels import _native

native = pytest.mark.skipif(not _native.native_available(), reason="native CPU module not built")


def special_rows(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Random rows with a tie at the max (row 0), a NaN after the max (row 1), +inf (row 2), all
    -inf (row 3), a NaN at the end (row 4); rows past those random."""
    x = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))
    if batch > 0:
        x[0, vocab - 1] = x[0, 0] = 50.0
    if batch > 1:
        x[1, vocab // 2] = float("nan")
    if batch > 2:
        x[2, vocab // 3] = float("inf")
    if batch > 3:
        x[3] = float("-inf")
    if batch > 4:
        x[4, vocab - 1] = float("nan")
    return x


@native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch,vocab", [(1, 1), (5, 15), (6, 16), (7, 17), (3, 4099), (64, 49152), (0, 8)])
def test_native_equals_torch(batch: int, vocab: int, threads: int) -> None:
    x = special_rows(batch, vocab, seed=batch * 1000 + vocab)
    before = x.clone()
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ids, maxes = K.row_argmax(x)
    finally:
        torch.set_num_threads(prev)
    assert ids.dtype == torch.int64 and maxes.dtype == torch.float32
    assert ids.shape == maxes.shape == (batch,)
    if batch:
        assert torch.equal(ids, torch.argmax(x, dim=-1))
        # equal bits, NaN included
        assert torch.equal(maxes.view(torch.int32), x.amax(dim=-1).view(torch.int32))
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # not mutated


def test_ties_pick_the_lowest_index_on_every_path() -> None:
    x = torch.zeros(2, 40)
    x[0, 7] = x[0, 31] = x[0, 39] = 1.0
    x[1] = -1.0  # every value the max
    ids, maxes = K.row_argmax(x)
    assert ids.tolist() == [7, 0] and maxes.tolist() == [1.0, -1.0]
    ids, maxes = K.row_argmax(x.to(torch.float64))  # the torch path
    assert ids.tolist() == [7, 0] and maxes.tolist() == [1.0, -1.0]


@native
@pytest.mark.parametrize("first,second", [(-0.0, 0.0), (0.0, -0.0)])
@pytest.mark.parametrize("at", [(2, 10), (8, 18), (30, 46)])
def test_zeros_of_both_signs_tie_and_the_pick_gives_the_sign(first: float, second: float, at) -> None:
    """+0 and -0 as the max, anywhere in the 16-wide lanes: the first is picked, and the max
    reported is that element itself."""
    x = torch.full((1, 47), -1.0)
    x[0, at[0]], x[0, at[1]] = first, second
    ids, maxes = K.row_argmax(x)
    assert ids.tolist() == [at[0]]
    assert maxes.view(torch.int32).tolist() == x[0, at[0]].view(torch.int32).reshape(1).tolist()


@pytest.mark.parametrize("shape", [(3,), (2, 0), (2, 3, 4)])
def test_rejects_logits_that_are_not_a_batch_of_rows(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="row_argmax takes logits"):
        K.row_argmax(torch.zeros(shape))


@native
def test_native_rejects_outputs_that_do_not_fit() -> None:
    x = torch.zeros(3, 10)
    with pytest.raises(ValueError, match="row_argmax"):
        _native._cpu.row_argmax(x.numpy(), torch.zeros(2, dtype=torch.int64).numpy(), torch.zeros(3).numpy(), 1)
    with pytest.raises(ValueError, match="maxes overlaps logits"):
        _native._cpu.row_argmax(x.numpy(), torch.zeros(3, dtype=torch.int64).numpy(), x[0, :3].numpy(), 1)
