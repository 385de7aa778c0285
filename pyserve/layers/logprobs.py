"""Log-probabilities reported to clients: of the sampled tokens, of the prompt tokens, the top
alternatives and requested token ids. Values are log_softmax of the model's raw logits
(before temperature, penalties and logit bias), i.e. the model's own distribution, which is
what HF transformers' `log_softmax(logits)` gives. Worker thread only."""

from __future__ import annotations

import torch

from pyserve.forward_batch_info import TokenLogprobs


def _pairs(values: list[float], ids: list[int]) -> list[tuple[float, int]]:
    return list(zip(values, ids))


def logprobs_of_rows(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    top_nums: list[int],
    token_ids_logprob: list[list[int] | None],
    row_groups: list[tuple[int, int]],
) -> list[TokenLogprobs]:
    """Logprobs of `token_ids` under `logits`, grouped into one TokenLogprobs per request.

    logits: [N, vocab] float32; token_ids: [N] int64 (the token each row predicts).
    row_groups: per request (first row, number of rows) into the N rows; top_nums and
    token_ids_logprob: per request (0 / None: not wanted).
    Top logprobs come sorted, most likely first (ties: lower id first, torch.topk order).
    One device-to-host copy per kind of value, not per token.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    max_top = max(top_nums, default=0)
    top_vals = top_ids = None
    if max_top > 0:
        values, ids = logprobs.topk(min(max_top, logprobs.shape[1]), dim=-1)
        top_vals, top_ids = values.tolist(), ids.tolist()
    out = []
    for (first, count), top_num, wanted in zip(row_groups, top_nums, token_ids_logprob):
        rows = range(first, first + count)
        item = TokenLogprobs(token_logprobs=[chosen[r] for r in rows])
        if top_num > 0 and top_vals is not None and top_ids is not None:
            item.top_logprobs = [_pairs(top_vals[r][:top_num], top_ids[r][:top_num]) for r in rows]
        if wanted:
            ids_t = torch.tensor(wanted, dtype=torch.int64, device=logits.device)
            vals = logprobs[first : first + count][:, ids_t].tolist()
            item.token_ids_logprobs = [_pairs(v, list(wanted)) for v in vals]
        out.append(item)
    return out
