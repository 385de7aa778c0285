"""Sampling: greedy, top-k / top-p filtering and per-request seeded generators."""

from __future__ import annotations

import pytest
import torch

from pyserve.forward_batch_info import SamplingBatchInfo
from pyserve.layers.sampler import sample, top_k_top_p_probs


def _info(temps, top_ps, top_ks, generators=()) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=torch.tensor(temps, dtype=torch.float32),
        top_ps=torch.tensor(top_ps, dtype=torch.float32),
        top_ks=torch.tensor(top_ks, dtype=torch.int64),
        generators=list(generators),
    )


LOGITS = torch.tensor(
    [
        [0.0, 3.0, 1.0, 2.0, -1.0],
        [5.0, 0.0, 0.0, 4.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 9.0],
    ]
)


def test_all_greedy_is_argmax() -> None:
    out = sample(LOGITS, _info([0, 0, 0], [1, 1, 1], [5, 5, 5]))
    assert out.dtype == torch.int64 and out.tolist() == [1, 0, 4]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for _ in range(20):
        assert sample(LOGITS, _info([1.0, 0.7, 2.0], [1, 1, 1], [1, 1, 1], gens)).tolist() == [1, 0, 4]
        assert sample(LOGITS, _info([1.0, 0.7, 2.0], [1e-6] * 3, [5, 5, 5])).tolist() == [1, 0, 4]


def test_mixed_greedy_and_sampled_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(50):
        out = sample(LOGITS, _info([0.0, 5.0, 0.0], [1, 1, 1], [5, 5, 5], [None, gen, None])).tolist()
        assert out[0] == 1 and out[2] == 4
        seen.add(out[1])
    assert len(seen) > 1  # the hot row really samples


def test_top_k_top_p_filter_exact() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    kept, ids = top_k_top_p_probs(probs, torch.tensor([4]), torch.tensor([0.7]))
    assert ids.tolist() == [[1, 3, 2, 0]]
    assert kept.tolist() == [[0.5, 0.30000001192092896, 0.0, 0.0]]
    kept, _ = top_k_top_p_probs(probs, torch.tensor([1]), torch.tensor([1.0]))
    assert kept.tolist() == [[0.5, 0.0, 0.0, 0.0]]


def test_top_k_limits_support() -> None:
    logits = torch.zeros(1, 8)
    logits[0, [2, 5, 7]] = 1.0
    gen = torch.Generator().manual_seed(1)
    draws = {int(sample(logits, _info([1.0], [1.0], [3], [gen]))[0]) for _ in range(100)}
    assert draws == {2, 5, 7}


def test_seeded_generators_reproduce() -> None:
    logits = torch.zeros(2, 64)

    def run(seed_a: int, seed_b: int) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(seed_a), torch.Generator().manual_seed(seed_b)]
        return [sample(logits, _info([1.0, 1.0], [1, 1], [64, 64], gens)).tolist() for _ in range(10)]

    assert run(7, 8) == run(7, 8)
    assert run(7, 8) != run(9, 8)
    assert [r[1] for r in run(7, 8)] == [r[1] for r in run(9, 8)]  # rows are independent


def test_row_count_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="batch size 3"):
        sample(LOGITS, _info([0, 0], [1, 1], [5, 5]))


def test_penalties_match_hf_processors_and_openai_formula() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    from pyserve.layers.sampler import apply_logit_adjustments

    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, -1.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    info = _info([0, 0], [1, 1], [6, 6])
    # row 0: repetition 1.5 over prompt+output ids {0, 1, 3}; row 1: none
    info.repetition_penalties = torch.tensor([1.5, 1.0])
    info.seen_token_mask = torch.zeros(2, 6, dtype=torch.bool)
    info.seen_token_mask[0, [0, 1, 3]] = True
    ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[0, 1, 3]]), logits[:1].clone())
    out = apply_logit_adjustments(logits, info)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], logits[1])
    # frequency 0.5 / presence 0.25 over row 1's outputs [4, 4, 2]
    info = _info([0, 0], [1, 1], [6, 6])
    info.frequency_penalties = torch.tensor([0.0, 0.5])
    info.presence_penalties = torch.tensor([0.0, 0.25])
    info.output_token_counts = torch.zeros(2, 6)
    info.output_token_counts[1, 4] = 2.0
    info.output_token_counts[1, 2] = 1.0
    out = apply_logit_adjustments(logits, info)
    assert out[1].tolist() == [0.0, 1.0, 2.0 - 0.5 - 0.25, 3.0, 4.0 - 1.0 - 0.25, 5.0]
    assert torch.equal(out[0], logits[0])
    # logit bias and banned ids; greedy follows the adjusted logits
    info = _info([0, 0], [1, 1], [6, 6])
    info.logit_bias_rows, info.logit_bias_ids = torch.tensor([0]), torch.tensor([4])
    info.logit_bias_values = torch.tensor([10.0])
    info.banned_rows, info.banned_ids = torch.tensor([1]), torch.tensor([5])
    assert sample(logits, info).tolist() == [4, 4]
    assert logits[0, 4] == -1.0  # input not mutated


def test_min_p_filter_exact() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    kept, ids = top_k_top_p_probs(probs, torch.tensor([4]), torch.tensor([1.0]), torch.tensor([0.5]))
    assert ids.tolist() == [[1, 3, 2, 0]]
    assert kept.tolist() == [[0.5, 0.30000001192092896, 0.0, 0.0]]


def test_seeded_row_independent_of_batch() -> None:
    torch.manual_seed(0)
    row = torch.randn(1, 50)
    gen = torch.Generator().manual_seed(5)
    alone = [sample(row, _info([0.9], [0.95], [40], [gen])).item() for _ in range(20)]
    gen = torch.Generator().manual_seed(5)
    others = torch.randn(7, 50)
    batched = []
    for _ in range(20):
        logits = torch.cat((others[:3], row, others[3:]))
        temps = [1.0, 0.0, 0.5, 0.9, 1.3, 0.0, 0.7, 2.0]
        out = sample(
            logits,
            _info(
                temps,
                [1.0] * 3 + [0.95] + [0.8] * 4,
                [50] * 3 + [40] + [10] * 4,
                [None, None, torch.Generator().manual_seed(1), gen] + [None] * 4,
            ),
        )
        batched.append(out[3].item())
    assert batched == alone and len(set(alone)) > 1


@pytest.mark.parametrize("greedy", [True, False])
def test_rows_with_nothing_to_sample_are_reported_not_raised(greedy) -> None:
    """A row whose logits are all -inf, or hold a NaN or +inf, fails alone: it is marked, and
    the other rows' tokens are what they would be without it."""
    from pyserve.layers.sampler import sample_checked, unsampleable_rows

    torch.manual_seed(0)
    logits = torch.randn(4, 16)
    logits[1] = float("-inf")
    logits[2, 3] = float("inf")
    logits[3, 5] = float("nan")
    assert unsampleable_rows(logits).tolist() == [False, True, True, True]
    temp = 0.0 if greedy else 0.7
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    ids, failed = sample_checked(logits, _info([temp] * 4, [1.0] * 4, [16] * 4, gens))
    assert failed.tolist() == [False, True, True, True]
    alone, none_failed = sample_checked(logits[:1], _info([temp], [1.0], [16], [torch.Generator().manual_seed(0)]))
    assert none_failed.tolist() == [False] and ids[0].item() == alone[0].item()


def test_a_logit_that_overflows_at_its_temperature_fails_only_its_row() -> None:
    """bias 1e38 is finite, but divided by temperature 0.01 it is +inf: that row fails alone,
    and the other rows draw what they draw without it (seeded)."""
    from pyserve.layers.sampler import sample_checked

    torch.manual_seed(0)
    logits = torch.randn(3, 16)
    logits[1, 4] = 1e38
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(3)]  # noqa: E731
    ids, failed = sample_checked(logits, _info([0.7, 0.01, 0.0], [1.0] * 3, [16] * 3, gens()))
    assert failed.tolist() == [False, True, False]
    clean = logits.clone()
    clean[1, 4] = 0.0
    ref, ref_failed = sample_checked(clean, _info([0.7, 0.01, 0.0], [1.0] * 3, [16] * 3, gens()))
    assert ref_failed.tolist() == [False, False, False]
    assert ids[0].item() == ref[0].item() and ids[2].item() == ref[2].item() == int(logits[2].argmax())
