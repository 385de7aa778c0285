"""Poolers: one embedding per sequence from the hidden states of a ragged batch.

The pooling of a sentence-transformers folder is what its own files say (`modules.json` lists a
`Pooling` module whose `config.json` names the mode, and a `Normalize` module or not), the
rules `sentence_transformers.models.Pooling` / `Normalize` apply: mean over the sequence's
tokens, its first token (CLS) or its last token; then division by the L2 norm. A decoder
served with `--is-embedding` pools its last token, normalised (SGLang's and vLLM's default).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyserve.config import POOLING_MODES

# sentence-transformers' Pooling config keys -> our modes
_ST_MODE_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolingSpec:
    """How a sequence's hidden states become its embedding.

    mode: "mean", "cls" (first token) or "last" (last token). normalize: divide by the L2 norm.
    """

    mode: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode {self.mode!r} is not supported; supported: {', '.join(POOLING_MODES)}")


def sentence_transformers_pooling(model_path: str) -> PoolingSpec | None:
    """The pooling a sentence-transformers folder declares (`modules.json`, its Pooling
    module's `config.json`, a Normalize module), or None when `model_path` has no
    `modules.json` (a file, or a plain HF folder). Raises ValueError for a Pooling mode this
    module does not implement (max, mean_sqrt_len, weighted mean; `include_prompt` false) and
    for a module of the pipeline other than Transformer, Pooling and Normalize (a Dense
    projection, for one), which pyserve does not run: its vectors would be wrong."""
    modules_path = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    with open(modules_path) as f:
        modules = json.load(f)
    mode, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        if not kind.endswith((".Transformer", ".Pooling", ".Normalize")):
            raise ValueError(f"{model_path}: the sentence-transformers module {kind} is not supported")
        if kind.endswith(".Pooling"):
            with open(os.path.join(model_path, module.get("path", ""), "config.json")) as f:
                config = json.load(f)
            chosen = [key for key, on in config.items() if key.startswith("pooling_mode_") and on]
            if len(chosen) != 1 or chosen[0] not in _ST_MODE_KEYS:
                supported = ", ".join(POOLING_MODES)
                raise ValueError(f"{model_path}: pooling {chosen} is not supported; supported: {supported}")
            mode = _ST_MODE_KEYS[chosen[0]]
            if config.get("include_prompt", True) is False:
                raise ValueError(f"{model_path}: pooling with include_prompt false is not supported")
        elif kind.endswith(".Normalize"):
            normalize = True
    if mode is None:
        return None
    return PoolingSpec(mode=mode, normalize=normalize)


def pool(hidden: torch.Tensor, seq_lens: list[int], spec: PoolingSpec) -> torch.Tensor:
    """Pool a ragged batch.

    hidden: [T, H] the hidden states of B sequences laid end to end (T = sum(seq_lens)), any
      float dtype. seq_lens: B host ints (each >= 1). Returns [B, H] float32 on hidden's device,
      L2-normalised when spec.normalize (F.normalize: eps 1e-12, as sentence-transformers)."""
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    hidden32 = hidden.float()
    if spec.mode == "last":
        out = hidden32.index_select(0, ends - 1)
    elif spec.mode == "cls":
        out = hidden32.index_select(0, ends - lens)
    else:
        seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)
        sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq_of_token, hidden32)
        out = sums / lens.unsqueeze(1).to(torch.float32)
    return F.normalize(out, p=2.0, dim=1) if spec.normalize else out
