"""Which part of each weight a tensor-parallel rank holds (Megatron-LM's split: Shoeybi et al.,
"Megatron-LM", 2019, section 3), for the decoder family of `pyserve.models.llama`.

* q/k/v and gate/up are column-parallel: a rank holds the output rows of its heads (its
  slice of the intermediate size); o_proj and down_proj are row-parallel: a rank holds the
  matching input columns, and the ranks' partial outputs are summed (all-reduce).
* KV heads are split like the query heads; with fewer KV heads than ranks each is
  replicated, rank r holding KV head r * num_kv_heads // size (its query heads' group).
* The embedding and LM head are vocab-parallel: rank r holds rows r * V' .. (r + 1) * V' - 1
  of the vocabulary padded to size * V' (the padding rows are zeros).
* Norms are replicated, except q/k norms over a token's whole q (k) (OLMoE), split as the
  heads are: the ranks then sum their sums of squares (pyserve.models.llama).
* A mixture of experts' experts are split as the MLP is, each expert's intermediate size
  (its gate/up rows, its down columns) and a shared expert's alike; the router is replicated,
  so every rank routes each token to the same experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_EXPERT_COLUMN = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$")
_EXPERT_ROW = re.compile(r"\.experts\.\d+\.(down_proj|w2)\.weight$")


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of a decoder (sizes in rows of the HF weights).

    rank, size: this rank and the tensor-parallel world size.
    num_heads / num_kv_heads: the rank's query and KV heads; q_start / kv_start: the first of
    them among the model's heads. inter: the rank's slice of the MLP intermediate size,
    starting at inter_start. vocab: V' (rows of the padded vocabulary per rank), starting at
    vocab_start; vocab_size: the model's vocabulary. expert_inter / shared_inter: the rank's
    slice of each expert's (and the shared expert's) intermediate size, starting at
    expert_start / shared_start (0 for a dense model).
    """

    rank: int
    size: int
    head_dim: int
    num_heads: int
    q_start: int
    num_kv_heads: int
    kv_start: int
    inter: int
    inter_start: int
    vocab: int
    vocab_start: int
    vocab_size: int
    expert_inter: int = 0
    expert_start: int = 0
    shared_inter: int = 0
    shared_start: int = 0

    @classmethod
    def of(cls, config: Any, rank: int, size: int, expert_parallel: bool | None = None) -> ShardLayout:
        """The layout of rank `rank` for an HF decoder config. expert_parallel: how a mixture's
        experts are split: True whole (which experts a rank holds is the model's:
        `first_expert`), False in width, None not asked (the expert fields stay 0: a caller
        reading only heads or vocabulary). Raises ValueError when the model does not split
        `size` ways (its heads, intermediate sizes or, when asked, its experts)."""
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        inter = int(config.intermediate_size)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        if heads % size:
            raise ValueError(f"--tp-size {size} does not divide the model's {heads} attention heads")
        if kv_heads % size and size % kv_heads:
            raise ValueError(f"--tp-size {size} neither divides nor is a multiple of the model's {kv_heads} KV heads")
        if inter % size:
            raise ValueError(f"--tp-size {size} does not divide the model's intermediate size {inter}")
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
        if expert_parallel is None:
            experts = 0
        expert_inter = int(getattr(config, "moe_intermediate_size", None) or inter) if experts else 0
        shared_inter = int(getattr(config, "shared_expert_intermediate_size", None) or 0) if experts else 0
        split = [("shared expert size", shared_inter)]
        split.append(("experts", int(experts)) if expert_parallel else ("expert intermediate size", expert_inter))
        for what, value in split:
            if value % size:
                raise ValueError(f"--tp-size {size} does not divide the model's {what} {value}")
        expert_ranks = 1 if expert_parallel else size  # how many ways each expert is cut
        local_kv = max(kv_heads // size, 1)
        kv_start = rank * local_kv if kv_heads >= size else rank * kv_heads // size
        vocab = int(config.vocab_size)
        per_rank = -(-vocab // size)
        return cls(
            rank=rank,
            size=size,
            head_dim=head_dim,
            num_heads=heads // size,
            q_start=rank * (heads // size),
            num_kv_heads=local_kv,
            kv_start=kv_start,
            inter=inter // size,
            inter_start=rank * (inter // size),
            vocab=per_rank,
            vocab_start=rank * per_rank,
            vocab_size=vocab,
            expert_inter=expert_inter // expert_ranks,
            expert_start=0 if expert_parallel else rank * (expert_inter // size),
            shared_inter=shared_inter // size,
            shared_start=rank * (shared_inter // size),
        )

    def slice_of(self, name: str, rows: int | None = None) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the HF weight `name` that this rank holds, or None when it
        holds the whole tensor (norms, row-parallel biases, rotary buffers). rows: the
        tensor's first dimension, which tells a q/k norm over all heads (wider than a head:
        split by heads) from a per-head one (replicated). For the vocab-parallel weights
        `stop` may pass the vocabulary: `shard` pads with zeros."""
        hd = self.head_dim
        if rows is not None and rows > hd and name.endswith("self_attn.q_norm.weight"):
            return 0, self.q_start * hd, (self.q_start + self.num_heads) * hd
        if rows is not None and rows > hd and name.endswith("self_attn.k_norm.weight"):
            return 0, self.kv_start * hd, (self.kv_start + self.num_kv_heads) * hd
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) and self.size > 1:
            raise ValueError(
                f"{name}: experts stacked in one tensor do not load across ranks; use a checkpoint with "
                "one tensor per expert (what save_pretrained writes) or --tp-size 1"
            )
        if _EXPERT_COLUMN.search(name):
            return 0, self.expert_start, self.expert_start + self.expert_inter
        if _EXPERT_ROW.search(name):
            return 1, self.expert_start, self.expert_start + self.expert_inter
        if name.endswith(("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight")):
            return 0, self.shared_start, self.shared_start + self.shared_inter
        if name.endswith("shared_expert.down_proj.weight"):
            return 1, self.shared_start, self.shared_start + self.shared_inter
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return 0, self.q_start * hd, (self.q_start + self.num_heads) * hd
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")) or name.endswith(
            ("self_attn.v_proj.weight", "self_attn.v_proj.bias")
        ):
            return 0, self.kv_start * hd, (self.kv_start + self.num_kv_heads) * hd
        if name.endswith("self_attn.o_proj.weight"):
            return 1, self.q_start * hd, (self.q_start + self.num_heads) * hd
        if name.endswith(("mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight", "mlp.up_proj.bias")):
            return 0, self.inter_start, self.inter_start + self.inter
        if name.endswith("mlp.down_proj.weight"):
            return 1, self.inter_start, self.inter_start + self.inter
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.vocab_start, self.vocab_start + self.vocab
        return None


def shard(layout: ShardLayout, name: str, full_shape: tuple[int, ...], read: Any) -> Any:
    """This rank's part of weight `name` ([full_shape]): `read(index)` reads the given index
    (a tuple of slices) from the checkpoint, so only the rank's part is read where the reader
    reads lazily (safetensors' `get_slice`; a tensor's own indexing otherwise). Vocab rows
    past the vocabulary come back as zeros."""
    import torch

    part = layout.slice_of(name, full_shape[0] if full_shape else None)
    if part is None:
        return read(tuple(slice(None) for _ in full_shape))
    dim, start, stop = part
    end = min(stop, full_shape[dim])
    index = tuple(slice(start, end) if d == dim else slice(None) for d in range(len(full_shape)))
    tensor = read(index)
    if end < stop:  # the padded vocabulary's last rows
        pad_shape = list(tensor.shape)
        pad_shape[dim] = stop - max(end, start)
        tensor = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
    return tensor
