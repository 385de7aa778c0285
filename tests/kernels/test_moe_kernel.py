"""The mixture-of-experts kernel (kernels/cpu/src/moe.rs, pyserve_kernels.moe): float32 experts
against a per-token float64 loop; quantized experts equal to the dense quantized kernels composed
per token and expert (bit for bit); a token's result the same bits alone and in any batch;
expert-parallel halves summing to the whole; the router's logits; and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyserve_kernels.activation import silu_and_mul
from pyserve_kernels.moe import moe_experts, moe_router_logits
from pyserve_kernels.quant import QuantizedWeight, quantized_linear
from tests.kernels.test_quant_kernels import random_weight

E, H, INTER, K = 6, 64, 32, 2


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)])
    weights = torch.rand(t, K, generator=gen)
    return x, ids, weights


def reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    """The formula per token in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e].double() @ x[t].double()
            act = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
            out[t] += float(weights[t, j]) * (down[e].double() @ act)
    return out


def test_float32_experts_equal_the_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * INTER, H, generator=gen) * 0.2, torch.randn(E, H, INTER, generator=gen) * 0.2
    x, ids, weights = routing(5, 1)
    got = moe_experts(x, ids, weights, gate_up, down)
    assert got.dtype == torch.float32 and got.shape == (5, H)
    torch.testing.assert_close(got.double(), reference(x, ids, weights, gate_up, down), atol=1e-5, rtol=1e-5)


def quantized_experts(qtype: str) -> tuple[QuantizedWeight, QuantizedWeight]:
    return random_weight(qtype, E * 2 * INTER, H // 32, 1), random_weight(qtype, E * H, INTER // 32, 2)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_experts_are_the_dense_quantized_kernels_composed(qtype: str) -> None:
    gate_up, down = quantized_experts(qtype)
    x, ids, weights = routing(4, 2)
    got = moe_experts(x, ids, weights, gate_up, down)
    for t in range(4):
        want = torch.zeros(H)
        for j in sorted(range(K), key=lambda j: int(ids[t, j])):  # ascending expert order
            e = int(ids[t, j])
            gu = QuantizedWeight(gate_up.data[e * 2 * INTER : (e + 1) * 2 * INTER], qtype)
            dn = QuantizedWeight(down.data[e * H : (e + 1) * H], qtype)
            y = quantized_linear(silu_and_mul(quantized_linear(x[t : t + 1], gu)), dn)[0]
            want = want + weights[t, j] * y
        assert torch.equal(got[t], want), t


@pytest.mark.parametrize("kind", ["float32", "Q4_0"])
def test_a_token_gives_the_same_bits_alone_and_in_any_batch(kind: str) -> None:
    if kind == "float32":
        gen = torch.Generator().manual_seed(3)
        experts = (torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen))
    else:
        experts = quantized_experts(kind)
    x, ids, weights = routing(12, 4)
    whole = moe_experts(x, ids, weights, *experts)
    for t in range(12):
        assert torch.equal(moe_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], *experts), whole[t : t + 1])
    for batch in (2, 7):
        assert torch.equal(moe_experts(x[:batch], ids[:batch], weights[:batch], *experts), whole[:batch])
    gate = torch.randn(E, H)
    logits = moe_router_logits(x, gate)
    for t in range(12):
        assert torch.equal(moe_router_logits(x[t : t + 1], gate), logits[t : t + 1])
    torch.testing.assert_close(logits.double(), x.double() @ gate.double().T, atol=1e-5, rtol=1e-5)


def test_expert_parallel_halves_sum_to_the_whole() -> None:
    gen = torch.Generator().manual_seed(5)
    gate_up, down = torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen)
    x, ids, weights = routing(7, 6)
    whole = moe_experts(x, ids, weights, gate_up, down)
    half = E // 2
    low = moe_experts(x, ids, weights, gate_up[:half], down[:half], expert_start=0, total_experts=E)
    high = moe_experts(x, ids, weights, gate_up[half:], down[half:], expert_start=half, total_experts=E)
    torch.testing.assert_close(low + high, whole, atol=1e-4, rtol=1e-5)


def test_quantized_experts_take_and_return_bfloat16() -> None:
    gate_up, down = quantized_experts("Q8_0")
    x, ids, weights = routing(3, 7)
    got = moe_experts(x.bfloat16(), ids, weights, gate_up, down)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, moe_experts(x.bfloat16().float(), ids, weights, gate_up, down).bfloat16())


def test_errors_leave_no_output() -> None:
    gen = torch.Generator().manual_seed(8)
    gate_up, down = torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER, generator=gen)
    x, ids, weights = routing(2, 9)
    with pytest.raises(IndexError, match="expert id 6 is outside the model's experts"):
        moe_experts(x, torch.tensor([[0, 6], [1, 2]]), weights, gate_up, down)
    with pytest.raises(ValueError, match="do not fit"):
        moe_experts(x, ids[:1], weights, gate_up, down)
    with pytest.raises(ValueError, match="are not"):
        moe_experts(x, ids, weights, gate_up[:, :-1], down)
    q_gate_up, q_down = quantized_experts("Q8_0")
    with pytest.raises(ValueError, match="both be float32 tensors or both quantized"):
        moe_experts(x, ids, weights, q_gate_up, down)
    with pytest.raises(ValueError, match="do not make experts"):
        moe_experts(x, ids, weights, q_gate_up, QuantizedWeight(q_down.data[:-1], "Q8_0"))
    with pytest.raises(ValueError, match="not \\[T, H\\], \\[E, H\\], \\[T, E\\]"):
        moe_router_logits(x, torch.randn(E, H + 1))
    assert np.isfinite(moe_experts(x, ids, weights, gate_up, down).numpy()).all()
