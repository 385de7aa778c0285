"""Pick the next token of each request from its logits, every request with its own parameters
in one batch: repetition / frequency / presence penalties, the min_new_tokens stop-token mask,
grammar masks and logit bias adjust the logits; then greedy, or temperature + top-k + top-p +
min-p sampling with an optional per-request torch.Generator."""

from __future__ import annotations

import torch

from pyserve.device_copy import to_device
from pyserve.forward_batch_info import SamplingBatchInfo
from pyserve_kernels import apply_token_bitmask_, row_argmax


def apply_logit_adjustments(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Logits [B, vocab] float32 after the batch's logit processors, in SGLang's order (each a
    no-op when `info` carries no such request):

    1. repetition penalty (CTRL, Keskar et al. 2019, as HF's RepetitionPenaltyLogitsProcessor):
       for every token seen in the prompt or output (seen_token_mask), a positive logit is divided by the
       penalty and a negative one multiplied by it.
    2. frequency / presence penalties (OpenAI API semantics): logit -= frequency * count
       - presence * (count > 0), count = occurrences among the output tokens so far
       (output_token_counts).
    3. banned tokens (stop tokens before min_new_tokens) become -inf.
    4. grammar masks (structured output): in the rows under a grammar, every token the grammar
       does not allow next becomes -inf (`pyserve_kernels.apply_token_bitmask_`).
    5. logit_bias: logits[row, id] += value.
    Returns `logits` itself when nothing applies, else a new tensor (the input is not mutated).
    """
    out = logits
    if info.repetition_penalties is not None and info.seen_token_mask is not None:
        penalty = info.repetition_penalties[:, None]
        penalized = torch.where(out > 0, out / penalty, out * penalty)
        out = torch.where(info.seen_token_mask, penalized, out)
    if info.frequency_penalties is not None and info.output_token_counts is not None:
        assert info.presence_penalties is not None  # set with the frequency penalties
        counts = info.output_token_counts
        penalty = info.frequency_penalties[:, None] * counts + info.presence_penalties[:, None] * (counts > 0).to(
            logits.dtype
        )
        out = out - penalty
    if info.banned_rows is not None:
        out = out.clone() if out is logits else out
        out[info.banned_rows, info.banned_ids] = float("-inf")
    if info.grammar_bitmask is not None:
        assert info.grammar_rows is not None  # set together
        out = out.clone() if out is logits else out
        apply_token_bitmask_(out, info.grammar_bitmask, info.grammar_rows)
    if info.logit_bias_rows is not None:
        assert info.logit_bias_ids is not None and info.logit_bias_values is not None
        out = out.clone() if out is logits else out
        out.index_put_((info.logit_bias_rows, info.logit_bias_ids), info.logit_bias_values, accumulate=True)
    return out


def top_k_top_p_probs(
    probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero out tokens outside each row's top-k, top-p (nucleus) and min-p sets.

    Top-k: Fan et al., "Hierarchical Neural Story Generation" (2018). Top-p: Holtzman et al.,
    "The Curious Case of Neural Text Degeneration" (2019): keep the smallest prefix of tokens
    sorted by probability whose mass reaches top_p; the most likely token is always kept.
    Min-p: Nguyen et al., "Min-p Sampling" (2024): drop tokens whose probability is below
    min_p times the most likely token's.

    probs: [B, vocab] float32 (rows sum to 1); top_ks: [B] int64; top_ps: [B] float32;
    min_ps: [B] float32 or None.
    Returns (sorted_probs [B, vocab] float32, unnormalised, filtered; sorted_ids [B, vocab]
    int64), both in descending-probability order.
    """
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    sorted_probs = sorted_probs.masked_fill(ranks[None, :] >= top_ks[:, None], 0.0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before > top_ps[:, None], 0.0)
    if min_ps is not None:
        floor = sorted_probs[:, :1] * min_ps[:, None]
        sorted_probs = sorted_probs.masked_fill(sorted_probs < floor, 0.0)
    return sorted_probs, sorted_ids


def sample(logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
    """Next token ids [B] int64 (see `sample_checked`; rows with nothing to sample give an
    arbitrary id)."""
    return sample_checked(logits, sampling_info)[0]


def unsampleable_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows of adjusted logits [B, vocab] that no token can be drawn from: every
    logit -inf (all banned), or a NaN or +inf (a bias or penalty that overflowed float32)."""
    # one reduction: a row's max is NaN if it holds a NaN (amax propagates it), +inf if it
    # holds +inf, -inf if every logit is -inf; finite exactly when the row can be sampled
    return ~torch.isfinite(logits.amax(dim=-1))


def sample_checked(logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token ids [B] int64 on logits.device, and the failed-row mask [B] bool there.

    logits: [B, vocab] float32 (not mutated), the model's raw logits; the adjustments of
    `apply_logit_adjustments` are applied first.
    Rows with temperature == 0 take argmax (ties: lowest id). Other rows divide by
    temperature, softmax, apply top-k, top-p and min-p, and draw with `torch.multinomial`,
    using the row's generator from `sampling_info.generators` when one is given (a seeded
    request then draws the same tokens whatever else is in the batch; a generator on another
    device than logits draws on its own device), else the global torch RNG of logits.device.
    A row whose parameters leave no token to draw (`unsampleable_rows`) is True in the mask
    and sampled from uniform logits instead, so one such request does not fail the batch;
    its id must be dropped. Which rows are greedy is read from `sampling_info.greedy_rows`
    (host) when given; on CUDA nothing else reads the device on the host, so the step's
    launches are not held up (a CPU "sync" is free and skips the uniform fix-up when no row
    needs it).
    Raises ValueError if the sampling tensors do not have B rows.
    """
    batch = logits.shape[0]
    temps = sampling_info.temperatures
    if temps.shape[0] != batch or sampling_info.top_ks.shape[0] != batch or sampling_info.top_ps.shape[0] != batch:
        raise ValueError(f"sampling info rows do not match batch size {batch}")
    logits = apply_logit_adjustments(logits, sampling_info)
    # one pass gives each row's max (finite exactly when the row can be sampled, as in
    # `unsampleable_rows`) and the greedy pick; a failed row's pick is 0, as argmax gives for
    # the uniform logits it is sampled from
    greedy_ids, row_max = row_argmax(logits)
    bad = ~torch.isfinite(row_max)
    if not logits.is_cpu or bool(bad.any()):
        logits = torch.where(bad[:, None], torch.zeros_like(logits), logits)
        greedy_ids = torch.where(bad, torch.zeros_like(greedy_ids), greedy_ids)
    if sampling_info.is_all_greedy:
        return greedy_ids, bad
    greedy_host = sampling_info.greedy_rows
    if greedy_host is None:
        greedy_host = (temps == 0).cpu().numpy()
    greedy = temps == 0
    safe_temps = torch.where(greedy, torch.ones_like(temps), temps).to(torch.float32)
    scaled = logits.float() / safe_temps[:, None]
    # a finite logit can still overflow once divided by a small temperature (a huge bias):
    # that row fails alone too, before softmax turns it into NaN for the whole draw
    overflow = unsampleable_rows(scaled) & ~greedy
    if not logits.is_cpu or bool(overflow.any()):
        scaled = torch.where(overflow[:, None], torch.zeros_like(scaled), scaled)
        bad = bad | overflow
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, sorted_ids = top_k_top_p_probs(
        probs,
        sampling_info.top_ks.to(torch.int64),
        sampling_info.top_ps.to(torch.float32),
        sampling_info.min_ps,
    )
    generators = list(sampling_info.generators or [])
    generators += [None] * (batch - len(generators))
    choice = torch.zeros(batch, dtype=torch.int64, device=logits.device)
    unseeded = [i for i, g in enumerate(generators) if g is None and not greedy_host[i]]
    if unseeded:
        rows = to_device(unseeded, torch.int64, logits.device)
        choice[rows] = torch.multinomial(sorted_probs[rows], 1).squeeze(1)
    for i, gen in enumerate(generators):
        if gen is not None and not greedy_host[i]:
            # A generator draws only on its own device; a CPU generator with CUDA logits
            # samples that row on the host (seeded requests stay reproducible either way).
            row = sorted_probs[i] if gen.device.type == logits.device.type else sorted_probs[i].cpu()
            choice[i] = torch.multinomial(row, 1, generator=gen)[0].to(logits.device)
    sampled = sorted_ids.gather(1, choice[:, None]).squeeze(1)
    return torch.where(greedy, greedy_ids, sampled), bad
