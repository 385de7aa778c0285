"""The quantized-weight kernels (kernels/cpu/src/quant, pyserve_kernels.quant) against gguf-py:
dequantization bit for bit on random blocks of every type, products within the bound of the
int8 activation scheme, exact products where the activations are already on the int8 grid,
identical bits from every instruction-set path and thread count, and the errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pyserve_kernels.quant import (
    QUANT_TYPES,
    QuantizedWeight,
    dequantize,
    quantized_embedding,
    quantized_isas,
    quantized_linear,
)

# Byte offsets of each type's float16 scale / min fields in a block (ggml-common.h).
HALF_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def random_weight(qtype: str, rows: int, blocks: int, seed: int) -> QuantizedWeight:
    """Random bytes in every field; the float16 fields random finite values of either sign in
    [2^-8, 2^-1), so that products stay in a sane range."""
    rng = np.random.default_rng(seed)
    _, _, block_bytes = QUANT_TYPES[qtype]
    data = rng.integers(0, 256, size=(rows, blocks, block_bytes), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        magnitude = rng.uniform(2.0**-8, 2.0**-1, size=(rows, blocks)) * rng.choice([-1.0, 1.0], size=(rows, blocks))
        data[:, :, at : at + 2] = magnitude.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    return QuantizedWeight(data.reshape(rows, blocks * block_bytes), qtype)


def gguf_dequantize(weight: QuantizedWeight) -> np.ndarray:
    return gguf.quants.dequantize(weight.data, gguf.GGMLQuantizationType[weight.qtype]).astype(np.float32)


def activation_error_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[m, n]: sum over blocks of 32 of (max|x_block| / 254) * sum|w_block| (the int8 rounding
    of the activations, half a step of max|x| / 127 per element), in float64."""
    m, k = x.shape
    step = np.abs(x.reshape(m, k // 32, 32)).max(axis=2) / 254.0  # [m, blocks]
    wsum = np.abs(w.reshape(w.shape[0], k // 32, 32)).sum(axis=2)  # [n, blocks]
    return step @ wsum.T


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_dequantize_equals_gguf_py_bit_for_bit(qtype: str) -> None:
    weight = random_weight(qtype, rows=5, blocks=3, seed=1)
    got = dequantize(weight).numpy()
    want = gguf_dequantize(weight)
    assert got.shape == want.shape == (5, 3 * QUANT_TYPES[qtype][1])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_embedding_reads_the_rows_asked_for(qtype: str) -> None:
    weight = random_weight(qtype, rows=7, blocks=2, seed=2)
    ids = torch.tensor([[6, 0], [3, 3]])
    got = quantized_embedding(weight, ids)
    assert got.shape == (2, 2, weight.shape[1])
    np.testing.assert_array_equal(got.numpy(), gguf_dequantize(weight)[ids.numpy()])


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
@pytest.mark.parametrize("m,n,blocks", [(1, 1, 1), (3, 7, 2), (17, 33, 3), (5, 64, 1)])
def test_product_within_the_activation_rounding_bound(qtype: str, m: int, n: int, blocks: int, num_threads) -> None:
    weight = random_weight(qtype, rows=n, blocks=blocks, seed=m * 100 + n)
    w = gguf_dequantize(weight).astype(np.float64)
    x = torch.randn(m, weight.shape[1], generator=torch.Generator().manual_seed(n))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m))
    got = quantized_linear(x, weight, bias).numpy().astype(np.float64)
    want = x.numpy().astype(np.float64) @ w.T + bias.numpy()
    bound = activation_error_bound(x.numpy().astype(np.float64), w)
    magnitude = np.abs(x.numpy()).astype(np.float64) @ np.abs(w).T + np.abs(bias.numpy())
    err = np.abs(got - want)
    # float32 accumulation adds at most a few ulps of the magnitude on top of the bound
    assert (err <= bound + 1e-5 * magnitude).all(), f"worst excess {(err - bound - 1e-5 * magnitude).max()}"
    assert (bound > 0).all()


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_product_on_the_int8_grid_is_exact_up_to_float_rounding(qtype: str) -> None:
    # x = q / 64 with q int8 and one |q| = 127 per block: the activation scale is exactly
    # 1/64 and rounding changes nothing, so scales and mins are what remains to get right.
    weight = random_weight(qtype, rows=9, blocks=2, seed=3)
    rng = np.random.default_rng(4)
    q = rng.integers(-127, 128, size=(4, weight.shape[1]))
    q[:, ::32] = 127
    x = torch.from_numpy((q / 64.0).astype(np.float32))
    w = gguf_dequantize(weight).astype(np.float64)
    got = quantized_linear(x, weight).numpy().astype(np.float64)
    want = x.numpy().astype(np.float64) @ w.T
    magnitude = np.abs(x.numpy()).astype(np.float64) @ np.abs(w).T
    assert (np.abs(got - want) <= 1e-6 * magnitude).all()


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_every_instruction_set_gives_identical_bits(qtype: str, num_threads) -> None:
    weight = random_weight(qtype, rows=19, blocks=2, seed=5)
    x = torch.randn(6, weight.shape[1], generator=torch.Generator().manual_seed(6))
    isas = quantized_isas()
    assert isas[0] == "scalar"
    results = {isa: quantized_linear(x, weight, isa=isa) for isa in isas}
    for isa, out in results.items():
        assert torch.equal(out, results["scalar"]), isa
    # a row's result does not depend on the rows batched with it (decode beside prefill)
    for i in range(x.shape[0]):
        assert torch.equal(quantized_linear(x[i : i + 1], weight), results["scalar"][i : i + 1])


def test_shapes_and_dtypes_pass_through() -> None:
    weight = random_weight("Q4_1", rows=4, blocks=1, seed=7)
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    out = quantized_linear(x, weight)
    assert out.shape == (2, 3, 4) and out.dtype == torch.bfloat16
    assert quantized_linear(torch.empty(0, 32), weight).shape == (0, 4)


def test_errors() -> None:
    weight = random_weight("Q8_0", rows=3, blocks=1, seed=8)
    with pytest.raises(ValueError, match="x has 31 features, the weight 32"):
        quantized_linear(torch.zeros(1, 31), weight)
    with pytest.raises(IndexError, match="row 3 is outside 0..3"):
        quantized_embedding(weight, torch.tensor([3]))
    with pytest.raises(ValueError, match="unknown instruction set"):
        quantized_linear(torch.zeros(1, 32), weight, isa="sse9")
    with pytest.raises(ValueError, match="no quantized kernel for Q2_K"):
        QuantizedWeight(weight.data, "Q2_K")
    with pytest.raises(ValueError, match="not whole Q4_0 blocks"):
        QuantizedWeight(weight.data, "Q4_0")
    with pytest.raises(ValueError, match="one type and row length"):
        QuantizedWeight.concat([weight, random_weight("Q8_0", rows=1, blocks=2, seed=9)])


@pytest.mark.parametrize("m", [1, 2, 7])
def test_an_interleaved_q4_0_weight_gives_the_same_bits(m: int, num_threads) -> None:
    weight = random_weight("Q4_0", 48, 8, seed=m)
    fast = weight.interleave()
    assert fast.interleaved and fast.shape == weight.shape and fast.nbytes == weight.nbytes
    assert not np.array_equal(fast.data, weight.data)  # the same bytes, in another order
    assert torch.equal(dequantize(fast), dequantize(weight))
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    for isa in quantized_isas():
        assert torch.equal(quantized_linear(x, fast, isa=isa), quantized_linear(x, weight, isa=isa)), isa
    ids = torch.tensor([47, 0, 9])
    assert torch.equal(quantized_embedding(fast, ids), quantized_embedding(weight, ids))


def test_only_row_major_q4_0_in_groups_of_eight_interleaves() -> None:
    assert not random_weight("Q8_0", 16, 1, seed=0).can_interleave()
    assert not random_weight("Q4_0", 12, 1, seed=0).can_interleave()
    fast = random_weight("Q4_0", 16, 1, seed=0).interleave()
    assert not fast.can_interleave()
    with pytest.raises(ValueError, match="only a Q4_0 weight of whole groups of 8 rows"):
        random_weight("Q8_0", 16, 1, seed=0).interleave()
    with pytest.raises(ValueError, match="cannot be taken"):
        fast.take_rows(np.arange(2))
    with pytest.raises(ValueError, match="only row-major weights"):
        QuantizedWeight.concat([fast, fast])
