"""Turn the final hidden states of a batch into next-token logits: keep each request's last
token only (plus the rows whose prompt logprobs were asked for), then project with the LM head
in float32."""

from __future__ import annotations

import torch

from pyserve.distributed.group import TensorParallelGroup
from pyserve.forward_batch_info import ForwardBatch, ForwardMode
from pyserve.layers.linear import linear
from pyserve_kernels.quant import QuantizedWeight


def last_token_indices(forward_batch: ForwardBatch) -> torch.Tensor:
    """Row of each request's last new token in the batch's token dim: [B] int64, batch device.

    DECODE: 0..B-1. EXTEND: cumsum(extend_seq_lens) - 1.
    """
    if forward_batch.forward_mode == ForwardMode.DECODE:
        return torch.arange(forward_batch.batch_size, device=forward_batch.input_ids.device)
    assert forward_batch.extend_seq_lens is not None  # set in EXTEND mode
    return torch.cumsum(forward_batch.extend_seq_lens, dim=0) - 1


class LogitsProcessor(torch.nn.Module):
    """forward(hidden [T, hidden], lm_head_weight [vocab, hidden], forward_batch,
    lm_head_packed = None) -> logits [B, vocab] float32 for the last token of each request
    (lm_head_packed: a `pyserve.layers.linear.prepack` copy of the weight or its quantized
    blocks, used when given).

    When forward_batch.input_logits_rows ([N] int64 token rows) is set, the logits of those
    rows are computed in the same matmul and stored in forward_batch.input_logits
    ([N, vocab] float32; mutates forward_batch).

    With `tp` the LM head is vocab-parallel (each rank's rows of the padded vocabulary): the
    ranks' logits are gathered side by side before the padding is cut."""

    def __init__(self, vocab_size: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(
        self,
        hidden: torch.Tensor,
        lm_head_weight: torch.Tensor,
        forward_batch: ForwardBatch,
        lm_head_packed: torch.Tensor | QuantizedWeight | None = None,
    ) -> torch.Tensor:
        rows = last_token_indices(forward_batch)
        extra = forward_batch.input_logits_rows
        if extra is not None:
            rows = torch.cat((rows, extra))
        logits = linear(hidden[rows], lm_head_weight, None, lm_head_packed)
        if self.tp is not None:
            logits = self.tp.all_gather_last_dim(logits)
        logits = logits[:, : self.vocab_size].float()
        if extra is None:
            return logits
        batch = forward_batch.batch_size
        forward_batch.input_logits = logits[batch:]
        return logits[:batch]
