"""A step's logprobs: which prompt rows' logits a forward keeps for prompt logprobs
(`plan_input_logprobs`, before the forward) and the logprobs the step returns
(`fill_logprobs`, after sampling). Worker thread."""

from __future__ import annotations

import torch

from pyserve.forward_batch_info import ForwardBatch, ForwardMode, StepOutput
from pyserve.layers.logprobs import logprobs_of_rows


def plan_input_logprobs(batch: ForwardBatch) -> list[tuple[int, int, int] | None] | None:
    """For prompt logprobs: set batch.input_logits_rows to the token rows whose logits
    predict the wanted prompt tokens; returns per request (start, first row in
    input_logits, count) or None."""
    info = batch.logprob_info
    if info is None or batch.forward_mode != ForwardMode.EXTEND or all(s is None for s in info.input_logprob_starts):
        return None
    rows: list[int] = []
    groups: list[tuple[int, int, int] | None] = []
    token_start = 0
    assert batch.extend_seq_lens is not None  # input logprobs come from EXTEND batches
    for start, ext in zip(info.input_logprob_starts, batch.extend_seq_lens.tolist()):
        if start is None:
            groups.append(None)
        else:
            # token j of the extend range is predicted by row j - 1 (none for j == 0)
            first = max(start, 1)
            groups.append((start, len(rows), max(ext - first, 0)))
            rows.extend(range(token_start + first - 1, token_start + ext - 1))
        token_start += ext
    batch.input_logits_rows = torch.tensor(rows, dtype=torch.int64, device=batch.input_ids.device)
    return groups


def fill_logprobs(
    out: StepOutput,
    logits: torch.Tensor,
    batch: ForwardBatch,
    next_ids: torch.Tensor,
    groups: list[tuple[int, int, int] | None] | None,
) -> None:
    """Fill out.output_logprobs (of `next_ids` [B] under `logits` [B, vocab]) and
    out.input_logprobs (of the prompt tokens, from batch.input_logits and the `groups` that
    plan_input_logprobs returned for this batch) with what batch.logprob_info asks for;
    nothing when it asks for none. Worker thread, under inference mode."""
    info = batch.logprob_info
    if info is None or not any(info.return_logprob):
        return
    rows = [i for i, want in enumerate(info.return_logprob) if want]
    rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    picked = logprobs_of_rows(
        logits[rows_t],
        next_ids[rows_t],
        [info.top_logprobs_nums[i] for i in rows],
        [info.token_ids_logprob[i] for i in rows],
        [(k, 1) for k in range(len(rows))],
    )
    out.output_logprobs = [None] * batch.batch_size
    for i, item in zip(rows, picked):
        out.output_logprobs[i] = item
    if groups is not None and batch.input_logits is not None and batch.input_logits_rows is not None:
        targets = batch.input_ids[batch.input_logits_rows + 1]
        wanted = [(i, g) for i, g in enumerate(groups) if g is not None]
        items = logprobs_of_rows(
            batch.input_logits,
            targets,
            [info.top_logprobs_nums[i] for i, _ in wanted],
            [info.token_ids_logprob[i] for i, _ in wanted],
            [(first_row, count) for _, (_, first_row, count) in wanted],
        )
        out.input_logprobs = [None] * batch.batch_size
        for (i, (start, _, _)), item in zip(wanted, items):
            if start == 0:  # the first prompt token has no context
                item.token_logprobs.insert(0, None)
                if item.top_logprobs is not None:
                    item.top_logprobs.insert(0, [])
                if item.token_ids_logprobs is not None:
                    item.token_ids_logprobs.insert(0, [])
            out.input_logprobs[i] = item
