"""Pick the next token of each request from its logits: greedy, or temperature + top-k +
top-p sampling with an optional per-request torch.Generator."""

from __future__ import annotations

import torch

from pyserve.model_executor.forward_batch import SamplingBatchInfo


def top_k_top_p_probs(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero out tokens outside each row's top-k and top-p (nucleus) set.

    Top-k: Fan et al., "Hierarchical Neural Story Generation" (2018). Top-p: Holtzman et al.,
    "The Curious Case of Neural Text Degeneration" (2019): keep the smallest prefix of tokens
    sorted by probability whose mass reaches top_p; the most likely token is always kept.

    probs: [B, vocab] float32 (rows sum to 1); top_ks: [B] int64; top_ps: [B] float32.
    Returns (sorted_probs [B, vocab] float32, unnormalised, filtered; sorted_ids [B, vocab]
    int64), both in descending-probability order.
    """
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    sorted_probs = sorted_probs.masked_fill(ranks[None, :] >= top_ks[:, None], 0.0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before > top_ps[:, None], 0.0)
    return sorted_probs, sorted_ids


def sample(logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
    """Next token ids [B] int64 on logits.device.

    logits: [B, vocab] float32 (not mutated).
    Rows with temperature == 0 take argmax (ties: lowest id). Other rows divide by
    temperature, softmax, apply top-k then top-p and draw with `torch.multinomial`, using the
    row's generator from `sampling_info.generators` when one is given (seeded requests are then
    reproducible; a generator on another device than logits draws on its own device), else
    the global torch RNG of logits.device. Reads top_ks/top_ps as given (no host sync besides
    the all-greedy check and the per-row generator loop).
    Raises ValueError if the sampling tensors do not have B rows.
    """
    batch = logits.shape[0]
    temps = sampling_info.temperatures
    if temps.shape[0] != batch or sampling_info.top_ks.shape[0] != batch or sampling_info.top_ps.shape[0] != batch:
        raise ValueError(f"sampling info rows do not match batch size {batch}")
    greedy_ids = torch.argmax(logits, dim=-1)
    if sampling_info.is_all_greedy:
        return greedy_ids
    greedy = temps == 0
    safe_temps = torch.where(greedy, torch.ones_like(temps), temps).to(torch.float32)
    probs = torch.softmax(logits.float() / safe_temps[:, None], dim=-1)
    sorted_probs, sorted_ids = top_k_top_p_probs(
        probs, sampling_info.top_ks.to(torch.int64), sampling_info.top_ps.to(torch.float32)
    )
    generators = list(sampling_info.generators or [])
    generators += [None] * (batch - len(generators))
    choice = torch.empty(batch, dtype=torch.int64, device=logits.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        rows = torch.tensor(unseeded, device=logits.device)
        choice[rows] = torch.multinomial(sorted_probs[rows], 1).squeeze(1)
    for i, gen in enumerate(generators):
        if gen is not None:
            # A generator draws only on its own device; a CPU generator with CUDA logits
            # samples that row on the host (seeded requests stay reproducible either way).
            row = sorted_probs[i] if gen.device == logits.device else sorted_probs[i].cpu()
            choice[i] = torch.multinomial(row, 1, generator=gen)[0].to(logits.device)
    sampled = sorted_ids.gather(1, choice[:, None]).squeeze(1)
    return torch.where(greedy, greedy_ids, sampled)
