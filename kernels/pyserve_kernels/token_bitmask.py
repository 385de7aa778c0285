"""The grammar token mask of structured output (logits of the tokens a grammar disallows become
-inf, from xgrammar's packed bitmask): the Triton kernel on CUDA, the native CPU kernel for
float32 CPU tensors, else the torch reference."""

from __future__ import annotations

import torch

from pyserve_kernels import reference
from pyserve_kernels._native import _cpu
from pyserve_kernels._triton import triton_applies


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """For each k, logits[rows[k], t] = -inf for every token t whose bit in bitmask[k] is 0;
    other logits keep their bits, and rows of logits not in `rows` are untouched (see
    `reference.apply_token_bitmask_`). Mutates logits IN PLACE; returns None.

    Layout: xgrammar's token bitmask (`xgrammar.allocate_token_bitmask`,
    `GrammarMatcher.fill_next_token_bitmask` fill it): bit j (least significant first) of
    int32 word w allows token 32 w + j; bits of ids >= vocab are ignored.

    logits:  [batch, vocab] float32, cpu or cuda, contiguous rows (a row stride is fine, e.g.
             the first vocab columns of a padded LM-head output)
    bitmask: [num_masked, ceil(vocab / 32)] int32, same device
    rows:    [num_masked] int32, same device, distinct, in 0..batch: mask row k applies to
             logits row rows[k]

    Threads: the thread that owns these tensors (pyserve's worker thread); on CPU the kernel
    releases the GIL and runs on torch's OpenMP team (torch.get_num_threads() threads), on
    CUDA it is enqueued on the current stream.
    Raises ValueError for wrong dtypes, shapes (bitmask not [len(rows), ceil(vocab / 32)]),
    devices or non-contiguous rows; on CPU also for a row outside 0..batch or a repeated row
    (nothing written then). On CUDA row values are not checked, so nothing syncs the host: a
    row outside the batch is skipped and a repeated row gets the union of its masks.
    """
    reference.check_token_bitmask(logits, bitmask, rows)
    if triton_applies(logits, bitmask, rows):
        from pyserve_kernels.triton_ops.token_bitmask import apply_token_bitmask_ as triton_apply

        triton_apply(logits, bitmask, rows)
        return
    # Not `native_applies`: the kernel takes rows of a wider tensor too (numpy row views), and
    # the checks above already fixed the dtypes.
    if _cpu is not None and logits.device.type == "cpu" and not logits.requires_grad:
        _cpu.apply_token_bitmask(
            logits.numpy(), bitmask.contiguous().numpy(), rows.contiguous().numpy(), torch.get_num_threads()
        )
        return
    reference.apply_token_bitmask_(logits, bitmask, rows)
