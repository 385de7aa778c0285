"""Checkpoint tensors of mixture-of-experts layers into the stacked expert parameters.

HF checkpoints hold one tensor per expert and projection: Qwen2-MoE, Qwen3-MoE and OLMoE as
`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`, Mixtral as
`model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` (gate, up, down) with its
router at `block_sparse_moe.gate.weight`. pyserve holds each layer's experts stacked
(`pyserve.layers.moe.StackedExperts`: `mlp.experts.gate_up_proj` [E, 2I, H], gate rows then
up rows, and `mlp.experts.down_proj` [E, H, I]), the layout transformers 5 itself loads them
into; a checkpoint already stacked that way loads by name. Each per-expert tensor is copied
straight into its slice, so loading holds no second copy of the experts.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(
    r"^(?P<layer>model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
# the projection's stacked parameter and which half of an expert's rows it fills (None: all)
_PROJ = {
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}


def checkpoint_name(name: str) -> str:
    """The name pyserve's parameters use for a checkpoint tensor: Mixtral's
    `block_sparse_moe.` is the layer's `mlp.`; every other name is unchanged."""
    return name.replace(".block_sparse_moe.", ".mlp.")


class ExpertSlices:
    """Copies per-expert checkpoint tensors into the stacked parameters of `params` (a
    model's named parameters) and says which stacked parameters were filled whole.

    first_expert: with expert parallelism, the first expert this rank holds (the stacked
    parameters hold experts first_expert ..; another rank's experts are skipped), else None.
    Loader's thread. Raises ValueError for an expert id beyond the layer's experts or a
    shape that does not fit its slice."""

    def __init__(self, params: dict[str, torch.Tensor], first_expert: int | None = None) -> None:
        self.params = params
        self.first_expert = first_expert
        self._filled: dict[str, set[tuple[int, int | None]]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Copy `tensor` into its slice when `name` is one expert's projection (True);
        False for any other name (left to the caller)."""
        match = _EXPERT.match(name)
        if match is None:
            return False
        stacked, half = _PROJ[match["proj"]]
        target = f"{match['layer']}.mlp.experts.{stacked}"
        param = self.params.get(target)
        if param is None:
            raise KeyError(f"checkpoint tensor {name!r}: the model has no experts at {target!r}")
        expert = int(match["expert"]) - (self.first_expert or 0)
        if self.first_expert is not None and not 0 <= expert < param.shape[0]:
            return True  # another rank's expert
        if expert >= param.shape[0]:
            raise ValueError(f"{name}: expert {expert} beyond the layer's {param.shape[0]} experts")
        rows = param[expert]
        if half is not None:
            inter = rows.shape[0] // 2
            rows = rows[half * inter : (half + 1) * inter]
        if tuple(rows.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(rows.shape)}")
        with torch.no_grad():
            rows.copy_(tensor.to(dtype=param.dtype))
        self._filled.setdefault(target, set()).add((expert, half))
        return True

    def complete(self) -> set[str]:
        """The stacked parameters every slice of which was copied. Raises ValueError naming
        the first missing per-expert tensor of a parameter the checkpoint filled in part."""
        done = set()
        for target, slices in self._filled.items():
            halves = (0, 1) if target.endswith("gate_up_proj") else (None,)
            experts = self.params[target].shape[0]
            if len(slices) == experts * len(halves):
                done.add(target)
                continue
            expert, half = min((e, h) for e in range(experts) for h in halves if (e, h) not in slices)
            expert += self.first_expert or 0  # the checkpoint's numbering
            proj = {0: "gate_proj", 1: "up_proj", None: "down_proj"}[half]
            layer = target.rsplit(".mlp.", 1)[0]
            raise ValueError(
                f"checkpoint lacks {layer}.mlp.experts.{expert}.{proj}.weight "
                f"({len(slices)} of the {experts * len(halves)} expert tensors of {target})"
            )
        return done
