"""BERT encoders (`BertModel` in config.json: all-MiniLM, bge, e5 and the other
sentence-transformers encoders): hidden states of a ragged batch with bidirectional attention.

The architecture is Devlin et al., 2019 (post-LayerNorm blocks, absolute position embeddings,
GELU with erf), as HF transformers' `BertModel` computes it. An encoder keeps no KV: each
request is one prefill step, its tokens attend to every token of their own sequence (never
to another's), and the runner pools the result (layers/pooler.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.forward_batch_info import ForwardBatch
from pyserve.layers.linear import linear, linear_gelu, prepack, prepack_supported
from pyserve.models.checkpoint import copy_checkpoint
from pyserve_kernels.varlen_attention import varlen_attention, varlen_attention_applies

# checkpoint tensors an encoder does not use: the NSP pooler, MLM heads, the position-id buffer
_IGNORED_PREFIXES = ("pooler.", "cls.")
_IGNORED_NAMES = ("embeddings.position_ids",)


# sequences attended together in one padded SDPA call: a step's sequences are sorted by length
# and taken this many at a time, so each call pads only to the longest of similar lengths
GROUP_SIZE = 16


class RaggedLayout:
    """Where a ragged batch's tokens go for `ragged_attention`, computed once per forward for
    every layer.

    seq_lens: B host ints (>= 1). native: the batch is float32 on CPU, where the native
    varlen kernel reads the sequences in place: only `cu_seqlens` [B + 1] int32 (their token
    offsets) is kept. Else, for each group of up to GROUP_SIZE sequences of similar length
    (sorted), `gather` [g, L_g] int64 token rows (a padding position repeats the group's first
    token: its key is masked, so its value weighs exactly 0), `keep` [g, 1, 1, L_g] bool (real
    keys), `valid` [n_g] int64 positions of the real tokens in the flattened [g * L_g] block
    and `dest` [n_g] int64 their token rows."""

    def __init__(self, seq_lens: list[int], device: torch.device, native: bool = False) -> None:
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        self.cu_seqlens = torch.tensor(starts, dtype=torch.int32) if native else None
        self.groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if native:
            return
        order = sorted(range(len(seq_lens)), key=lambda i: seq_lens[i])
        for g in range(0, len(order), GROUP_SIZE):
            members = order[g : g + GROUP_SIZE]
            longest = max(seq_lens[i] for i in members)
            offsets = torch.arange(longest)
            lens = torch.tensor([seq_lens[i] for i in members])
            first = torch.tensor([starts[i] for i in members])
            real = offsets.unsqueeze(0) < lens.unsqueeze(1)  # [g, L]
            gather = torch.where(real, first.unsqueeze(1) + offsets, first.unsqueeze(1))
            valid = real.flatten().nonzero().squeeze(1)
            self.groups.append(
                (
                    gather.to(device),
                    real.view(len(members), 1, 1, longest).to(device),
                    valid.to(device),
                    gather.flatten()[valid].to(device),
                )
            )


def ragged_attention(qkv: torch.Tensor, layout: RaggedLayout, num_heads: int) -> torch.Tensor:
    """Bidirectional attention within each sequence of a ragged batch.

    qkv: [T, 3 * H] (q | k | v, H = num_heads * head_dim) of B sequences laid end to end;
    layout: their RaggedLayout. Returns [T, H]: softmax(q k^T / sqrt(head_dim)) v over the
    sequence's own tokens. On the native path (float32 CPU) the varlen kernel reads the
    sequences in place, unpadded. Else each group of similar-length sequences is gathered into
    a padded [g, L_g] block and attended in one SDPA call whose mask hides the padding keys;
    padding query rows are computed and dropped."""
    if layout.cu_seqlens is not None:
        return varlen_attention(qkv, layout.cu_seqlens, num_heads)
    total, width = qkv.shape
    hidden = width // 3
    head_dim = hidden // num_heads
    out = qkv.new_empty(total, hidden)
    for gather, keep, valid, dest in layout.groups:
        g, longest = gather.shape
        block = qkv[gather.flatten()].view(g, longest, 3, num_heads, head_dim)
        q, k, v = (t.transpose(1, 2) for t in block.unbind(2))  # [g, heads, L, d] each
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        out[dest] = attended.transpose(1, 2).reshape(g * longest, hidden)[valid]
    return out


class _Dense(nn.Module):
    """A projection with bias under HF's name (`dense`, `query`, ...): weight [out, in]."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class _LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class _Embeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden, dtype=dtype, device=device)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden, dtype=dtype, device=device)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden, dtype=dtype, device=device)
        self.LayerNorm = _LayerNorm(hidden, config.layer_norm_eps, dtype, device)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # one segment per request: token type 0 throughout, as a sentence-transformers encode
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.query = _Dense(hidden, hidden, dtype, device)
        self.key = _Dense(hidden, hidden, dtype, device)
        self.value = _Dense(hidden, hidden, dtype, device)


class _AttentionOutput(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.dense = _Dense(hidden, hidden, dtype, device)
        self.LayerNorm = _LayerNorm(hidden, eps, dtype, device)


class _Attention(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.self = _SelfAttention(hidden, dtype, device)
        self.output = _AttentionOutput(hidden, eps, dtype, device)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.dense = _Dense(hidden, inter, dtype, device)


class _Output(nn.Module):
    def __init__(self, inter: int, hidden: int, eps: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.dense = _Dense(inter, hidden, dtype, device)
        self.LayerNorm = _LayerNorm(hidden, eps, dtype, device)


class BertLayer(nn.Module):
    """One post-LayerNorm block: x = LN(x + O(attn(x))); x = LN(x + W2 gelu(W1 x))."""

    def __init__(self, config: Any, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = int(config.num_attention_heads)
        self.attention = _Attention(hidden, eps, dtype, device)
        self.intermediate = _Intermediate(hidden, config.intermediate_size, dtype, device)
        self.output = _Output(config.intermediate_size, hidden, eps, dtype, device)
        if config.hidden_act != "gelu":
            raise ValueError(f"BERT hidden_act {config.hidden_act!r} is not supported; supported: gelu")
        position_type = getattr(config, "position_embedding_type", "absolute") or "absolute"
        if position_type != "absolute":
            raise ValueError(f"BERT position_embedding_type {position_type!r} is not supported; supported: absolute")
        # q | k | v as one projection (filled by BertModel.fuse_qkv after loading)
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, layout: RaggedLayout) -> torch.Tensor:
        assert self.qkv_weight is not None  # BertModel.fuse_qkv ran
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)
        attn = ragged_attention(qkv, layout, self.num_heads)
        out = self.attention.output
        x = out.LayerNorm(x + out.dense(attn))
        h = linear_gelu(x, self.intermediate.dense.weight, self.intermediate.dense.bias, self.intermediate.dense.packed)
        return self.output.LayerNorm(x + self.output.dense(h))


class BertModel(nn.Module):
    """A BERT encoder: forward(batch, attn_backend) -> hidden states [T, hidden] of the batch's
    tokens (the last layer's output, as HF's `last_hidden_state`).

    BertModel(config, dtype, device): config is an HF BertConfig. The batch is one EXTEND step
    of whole prompts (no cached prefix: an encoder keeps no KV, and the engine runs it without
    a prefix cache); its positions restart at 0 per sequence and must stay below
    max_position_embeddings. `attn_backend` is not used (an encoder reads no KV pool).
    """

    is_encoder = True

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embeddings = _Embeddings(config, dtype, device)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(config, dtype, device) for _ in range(config.num_hidden_layers))

    def layers(self) -> list[BertLayer]:
        return list(self.encoder.layer)  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch, attn_backend: Any = None) -> torch.Tensor:
        assert forward_batch.extend_seq_lens is not None  # an encoder step is an EXTEND of whole prompts
        x = self.embeddings(forward_batch.input_ids.long(), forward_batch.positions.long())
        native = varlen_attention_applies(x)
        layout = RaggedLayout(forward_batch.extend_seq_lens.tolist(), x.device, native=native)
        for layer in self.layers():
            x = layer(x, layout)
        return x

    def fuse_qkv(self) -> None:
        """Join each layer's query, key and value projections into one [3 * hidden, hidden]."""
        for layer in self.layers():
            s = layer.attention.self
            layer.qkv_weight = torch.cat([s.query.weight, s.key.weight, s.value.weight]).contiguous()
            layer.qkv_bias = torch.cat([s.query.bias, s.key.bias, s.value.bias]).contiguous()
            layer.qkv_packed = None

    def prepack_linear_weights(self) -> int:
        """oneDNN-packed copies of every projection (see pyserve/layers/linear.py): on CPU in
        float32 only, else a no-op. Returns the bytes the copies take."""
        layers = self.layers()
        if not layers or layers[0].qkv_weight is None or not prepack_supported(layers[0].qkv_weight):
            return 0
        added = 0
        for layer in layers:
            assert layer.qkv_weight is not None
            layer.qkv_packed = prepack(layer.qkv_weight)
            added += layer.qkv_weight.numel() * layer.qkv_weight.element_size()
            for dense in (layer.attention.output.dense, layer.intermediate.dense, layer.output.dense):
                dense.packed = prepack(dense.weight)
                added += dense.weight.numel() * dense.weight.element_size()
        return added

    def _drop_packed_weights(self) -> None:
        for layer in self.layers():
            layer.qkv_packed = None
            for dense in (layer.attention.output.dense, layer.intermediate.dense, layer.output.dense):
                dense.packed = None

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights for benchmarks (`--load-format dummy`): matrices ~ N(0, 0.02), biases
        0, LayerNorm weights 1. Deterministic for a given `seed`."""
        self._drop_packed_weights()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "LayerNorm" in name:
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.copy_((torch.randn(param.shape, generator=gen) * 0.02).to(param.dtype))
        self.fuse_qkv()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF `BertModel` names, with or without the `bert.` prefix
        of task models) into the parameters; the pooler and MLM heads are skipped. Raises
        KeyError for an unknown name, ValueError for a shape mismatch or missing tensors."""
        self._drop_packed_weights()
        renamed = ((name.removeprefix("bert."), tensor) for name, tensor in weights)
        copy_checkpoint(
            self,
            ((n, t) for n, t in renamed if not (n.startswith(_IGNORED_PREFIXES) or n in _IGNORED_NAMES)),
        )
        self.fuse_qkv()
