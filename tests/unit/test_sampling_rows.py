"""The worker's persistent sampling rows: a reused row starts clean, penalties count only their
own request's tokens, min_new_tokens bans lift at the right count, releases are idempotent."""

from __future__ import annotations

import numpy as np
import torch

from pyserve.forward_batch_info import SamplingRow
from pyserve.layers.sampler import apply_logit_adjustments
from pyserve.model_executor.sampling_rows import SamplingRows
from pyserve.sampling_params import SamplingParams

VOCAB = 6


def gather(rows: SamplingRows, batch: list[int]):
    rows_np = np.array(batch, dtype=np.int32)
    return rows.batch_info(rows_np, torch.from_numpy(rows_np).long(), all_greedy=False)


def test_a_reused_row_keeps_nothing_of_its_previous_request():
    rows = SamplingRows(8, VOCAB, "cpu")
    rows.set_rows(
        [
            SamplingRow(
                3,
                SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25),
                frozenset(),
                seen_ids=np.array([0, 1], dtype=np.int32),
            )
        ]
    )
    rows.record_sampled(np.array([3], dtype=np.int32), torch.tensor([3]), torch.tensor([4]))
    rows.release_rows([3])
    rows.release_rows([3])  # idempotent
    assert rows.num_live == 0
    # row 3 reused by a request without penalties, beside one (row 5) that has some
    rows.set_rows(
        [
            SamplingRow(3, SamplingParams(), frozenset()),
            SamplingRow(
                5,
                SamplingParams(repetition_penalty=2.0, frequency_penalty=0.1),
                frozenset(),
                seen_ids=np.array([2], dtype=np.int32),
            ),
        ]
    )
    info = gather(rows, [3, 5])
    assert info.repetition_penalties.tolist() == [1.0, 2.0]
    assert info.frequency_penalties.tolist() == [0.0, 0.10000000149011612]
    assert info.presence_penalties.tolist() == [0.0, 0.0]
    assert info.output_token_counts[1].tolist() == [0.0] * VOCAB  # row 5 counted nothing yet
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, -1.0, 2.0]] * 2)
    out = apply_logit_adjustments(logits, info)
    assert torch.equal(out[0], logits[0])  # row 3: untouched
    assert out[1].tolist() == [1.0, -2.0, 1.5, 0.5, -1.0, 2.0]  # row 5: only its own token 2


def test_min_new_tokens_ban_lifts_after_enough_tokens():
    rows = SamplingRows(4, VOCAB, "cpu")
    rows.set_rows([SamplingRow(1, SamplingParams(min_new_tokens=2), frozenset({5}))])
    assert gather(rows, [1]).banned_ids.tolist() == [5]
    rows.record_sampled(np.array([1], dtype=np.int32), torch.tensor([1]), torch.tensor([0]))
    assert gather(rows, [1]).banned_ids.tolist() == [5]
    rows.record_sampled(np.array([1], dtype=np.int32), torch.tensor([1]), torch.tensor([0]))
    assert gather(rows, [1]).banned_ids is None


def test_optional_parts_follow_the_live_rows_that_use_them():
    rows = SamplingRows(4, VOCAB, "cpu")
    rows.set_rows(
        [
            SamplingRow(0, SamplingParams(min_p=0.2), frozenset()),
            SamplingRow(1, SamplingParams(presence_penalty=0.5), frozenset()),
            SamplingRow(2, SamplingParams(repetition_penalty=1.5), frozenset()),
            SamplingRow(3, SamplingParams(), frozenset()),
        ]
    )
    assert (rows.num_min_p, rows.num_counts, rows.num_seen) == (1, 1, 1)
    info = gather(rows, [3, 0, 1, 2])
    assert info.min_ps.tolist() == [0.0, 0.20000000298023224, 0.0, 0.0]
    assert info.presence_penalties.tolist() == [0.0, 0.0, 0.5, 0.0]
    assert info.repetition_penalties.tolist() == [1.0, 1.0, 1.0, 1.5]
    plain = gather(rows, [3])  # a batch of rows without them gathers none of them
    assert plain.min_ps is None and plain.presence_penalties is None and plain.repetition_penalties is None
    # the penalties count the tokens of their own rows only
    rows.record_sampled(np.array([1, 2, 3], dtype=np.int32), torch.tensor([1, 2, 3]), torch.tensor([4, 5, 4]))
    assert rows.output_counts[1].tolist() == [0, 0, 0, 0, 1, 0] and rows.output_counts[3].tolist() == [0] * VOCAB
    assert rows.seen_mask[2].tolist() == [False] * 5 + [True]
    rows.release_rows([0, 1, 2, 0])
    assert (rows.num_min_p, rows.num_counts, rows.num_seen) == (0, 0, 0)
    rows.set_rows([SamplingRow(0, SamplingParams(), frozenset())])  # reused without them
    info = gather(rows, [0, 3])
    assert info.min_ps is None and info.presence_penalties is None and info.repetition_penalties is None
