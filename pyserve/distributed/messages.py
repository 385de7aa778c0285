"""What rank 0 sends the other tensor-parallel ranks (`TensorParallelGroup.send_object`): the
request tables to build (`RankStart`), each step's plan (`rank_plan`), and the stop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pyserve.forward_batch_info import StepPlan


@dataclass(frozen=True)
class RankStart:
    """New request tables every rank mirrors from now on: `num_rows` rows of `row_width` KV
    slots (`DeviceState`), for a vocabulary of `vocab_size`; `capture_graphs`: capture the
    decode CUDA graphs over them now, as rank 0's worker does (CUDA only)."""

    num_rows: int
    row_width: int
    vocab_size: int
    capture_graphs: bool = False


def rank_plan(plan: StepPlan) -> StepPlan:
    """`plan` as the other ranks get it: without the sampling rows (their parameters and
    grammars), which only rank 0, the one that samples, holds."""
    return dataclasses.replace(plan, new_sampling_rows=[], released_rows=[])


# the end of serving: the ranks leave their step loop and exit with status 0
STOP_RANKS = "stop"
