"""The worker's DeviceState turns host-only plans into ForwardBatches: an extend writes its
requests' whole rows into req_to_token, a decode adds one slot per request and reads its
inputs from the token table, and a plan that would spill past a row is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyserve.forward_batch_info import ForwardMode, SamplingRow, StepPlan
from pyserve.model_executor.device_state import DeviceState
from pyserve.sampling_params import SamplingParams


def i32(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int32)


def test_extend_then_decode_write_exact_rows_and_inputs():
    state = DeviceState(num_rows=4, row_width=6, vocab_size=16, device="cpu")
    # row 2: one cached token (slot 10) + two new; row 0: two new
    extend = StepPlan(
        ForwardMode.EXTEND,
        req_pool_indices=i32(2, 0),
        seq_lens=i32(3, 2),
        positions=i32(1, 2, 0, 1),
        out_cache_loc=i32(11, 12, 21, 22),
        input_ids=i32(5, 6, 7, 8),
        prefix_lens=i32(1, 0),
        extend_lens=i32(2, 2),
        row_slots=i32(10, 11, 12, 21, 22),
        new_sampling_rows=[
            SamplingRow(2, SamplingParams(temperature=0.5, top_p=0.9), frozenset()),
            SamplingRow(0, SamplingParams(temperature=0), frozenset()),
        ],
        all_greedy=False,
    )
    with torch.inference_mode():
        batch = state.forward_batch(extend)
    assert state.req_to_token.tolist() == [[21, 22, 0, 0, 0, 0], [0] * 6, [10, 11, 12, 0, 0, 0], [0] * 6]
    assert batch.input_ids.tolist() == [5, 6, 7, 8] and batch.input_ids.dtype == torch.int32
    assert batch.positions.tolist() == [1, 2, 0, 1] and batch.out_cache_loc.tolist() == [11, 12, 21, 22]
    assert batch.kv_indptr.tolist() == [0, 3, 5] and batch.kv_indices.dtype == torch.int32
    assert batch.kv_indices.tolist() == [10, 11, 12, 21, 22]
    assert batch.extend_prefix_lens.tolist() == [1, 0] and batch.extend_seq_lens.tolist() == [2, 2]
    assert batch.seq_lens.tolist() == [3, 2] and batch.req_pool_indices.tolist() == [2, 0]
    assert batch.max_extend_len == 2
    info = batch.sampling_info
    assert info.temperatures.tolist() == [0.5, 0.0] and info.top_ps.tolist() == [pytest.approx(0.9), 1.0]
    assert info.greedy_rows.tolist() == [False, True]

    state.token_table[2], state.token_table[0] = 9, 4  # what the extend sampled
    decode = StepPlan(
        ForwardMode.DECODE,
        req_pool_indices=i32(0, 2),
        seq_lens=i32(3, 4),
        positions=i32(2, 3),
        out_cache_loc=i32(23, 13),
        all_greedy=False,
    )
    with torch.inference_mode():
        batch = state.forward_batch(decode)
    assert state.req_to_token[2].tolist() == [10, 11, 12, 13, 0, 0]
    assert state.req_to_token[0].tolist() == [21, 22, 23, 0, 0, 0]
    assert batch.input_ids.tolist() == [4, 9]  # from the token table, in the plan's order
    assert batch.kv_indices is None and batch.extend_seq_lens is None
    assert batch.sampling_info.temperatures.tolist() == [0.0, 0.5]


def test_plans_that_disagree_or_spill_past_a_row_are_refused():
    state = DeviceState(num_rows=2, row_width=4, vocab_size=8, device="cpu")
    state.sampling.set_rows([SamplingRow(0, SamplingParams(), frozenset())])
    # the plan also says row 0's request left: refused or not, its sampling row is released
    spill = StepPlan(
        ForwardMode.DECODE,
        req_pool_indices=i32(1),
        seq_lens=i32(5),
        positions=i32(4),
        out_cache_loc=i32(7),
        released_rows=[0],
    )
    with torch.inference_mode(), pytest.raises(ValueError, match="5 tokens exceed its row of 4"):
        state.forward_batch(spill)
    assert state.sampling.num_live == 0 and not state.sampling.live[0]
    short = StepPlan(
        ForwardMode.EXTEND,
        req_pool_indices=i32(0),
        seq_lens=i32(2),
        positions=i32(0, 1),
        out_cache_loc=i32(3, 4),
        input_ids=i32(1, 2),
        prefix_lens=i32(0),
        extend_lens=i32(2),
        row_slots=i32(3),
    )
    with torch.inference_mode(), pytest.raises(ValueError, match="row_slots does not hold seq_lens slots"):
        state.forward_batch(short)
    assert state.req_to_token.tolist() == [[0] * 4, [0] * 4]  # nothing was written
