"""Turn the final hidden states of a batch into next-token logits: keep each request's last
token only, then project with the LM head in float32."""

from __future__ import annotations

import torch

from pyserve.model_executor.forward_batch import ForwardBatch, ForwardMode


def last_token_indices(forward_batch: ForwardBatch) -> torch.Tensor:
    """Row of each request's last new token in the batch's token dim: [B] int64, batch device.

    DECODE: 0..B-1. EXTEND: cumsum(extend_seq_lens) - 1.
    """
    if forward_batch.forward_mode == ForwardMode.DECODE:
        return torch.arange(forward_batch.batch_size, device=forward_batch.input_ids.device)
    return torch.cumsum(forward_batch.extend_seq_lens, dim=0) - 1


class LogitsProcessor(torch.nn.Module):
    """forward(hidden [T, hidden], lm_head_weight [vocab, hidden], forward_batch) ->
    logits [B, vocab] float32 for the last token of each request."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        last = hidden[last_token_indices(forward_batch)]
        logits = torch.matmul(last, lm_head_weight.t())
        return logits[:, : self.vocab_size].float()
