"""Weight handling of `LlamaForCausalLM` (and the Qwen2, Qwen3 and Mistral families that
subclass it), as the mixin `LlamaWeightsMixin`: loading a checkpoint by HF name, running GGUF
matrices on their quantized blocks (q/k/v and gate/up stacked), oneDNN-prepacked copies of
the float projection weights, random weights for `--load-format dummy`, and the byte counts
the KV pool sizing takes off.

Runs while the model is built and loaded (the thread that constructs `ModelRunner`, before
the worker thread takes it over); `forward` only reads what is set here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pyserve.layers.linear import prepack, prepack_supported
from pyserve.layers.moe import SparseMoeBlock
from pyserve.models.checkpoint import copy_checkpoint
from pyserve.models.expert_weights import ExpertSlices, checkpoint_name
from pyserve_kernels.quant import QuantizedWeight, dequantize, quantized_isas


class LlamaWeightsMixin(nn.Module):
    """Weight loading and packing of a Llama-style causal LM. The class mixing it in holds
    `model` (a `LlamaModel`), `lm_head` (None when tied to the embedding), `lm_head_packed`
    and `lm_head_weight()`; the `*_packed` attributes of the layers are set here and read by
    their `forward`."""

    model: Any  # a LlamaModel (llama.py imports this module: no import back)
    # with expert parallelism, the first expert this rank holds (pyserve.models.moe), else None
    first_expert: int | None = None
    lm_head: nn.Linear | None
    lm_head_packed: torch.Tensor | QuantizedWeight | None

    if TYPE_CHECKING:

        def lm_head_weight(self) -> torch.Tensor: ...

    def prepack_linear_weights(self) -> int:
        """Keep a oneDNN-packed copy of every float projection weight (q/k/v, o, gate/up, down,
        LM head) and use it in `forward` (see pyserve/layers/linear.py): on CPU in float32 only,
        else a no-op; projections running on quantized blocks are left as they are. Call after
        the weights are final; loading weights again drops the copies. Returns the bytes the
        copies take."""
        added = 0

        def pack(weight: torch.Tensor, current: torch.Tensor | QuantizedWeight | None) -> Any:
            nonlocal added
            if isinstance(current, QuantizedWeight) or not prepack_supported(weight):
                return current
            added += weight.numel() * weight.element_size()
            return prepack(weight)

        for layer in self.model.decoder_layers():
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_packed = pack(attn.qkv_weight, attn.qkv_packed)
            attn.o_packed = pack(attn.o_proj.weight, attn.o_packed)
            if isinstance(mlp, SparseMoeBlock):  # experts run as stacked float weights
                continue
            mlp.gate_up_packed = pack(mlp.gate_up_weight, mlp.gate_up_packed)
            mlp.down_packed = pack(mlp.down_proj.weight, mlp.down_packed)
        self.lm_head_packed = pack(self.lm_head_weight(), self.lm_head_packed)
        return added

    def quantized_weight_bytes(self) -> int:
        """Bytes of the quantized blocks the model runs on (0 when every weight is float)."""
        held = {id(w): w for w in self._quantized_weights()}
        return sum(w.nbytes for w in held.values())

    def _quantized_weights(self) -> list[QuantizedWeight]:
        found: list[Any] = [self.model.embed_quantized, self.lm_head_packed]
        for layer in self.model.decoder_layers():
            found += [layer.self_attn.qkv_packed, layer.self_attn.o_packed]
            mlps = [layer.mlp]
            if isinstance(layer.mlp, SparseMoeBlock):
                found += [layer.mlp.experts.gate_up_quant, layer.mlp.experts.down_quant]
                mlps = [layer.mlp.shared_expert] if layer.mlp.shared_expert is not None else []
            for mlp in mlps:
                found += [mlp.gate_up_packed, mlp.down_packed]
        return [w for w in found if isinstance(w, QuantizedWeight)]

    def _drop_packed_weights(self) -> None:
        self.model._native_layers = False
        for layer in self.model.decoder_layers():
            layer.self_attn.qkv_packed = layer.self_attn.o_packed = None
            mlps = [layer.mlp]
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.experts.gate_up_quant = layer.mlp.experts.down_quant = None
                mlps = [layer.mlp.shared_expert] if layer.mlp.shared_expert is not None else []
            for mlp in mlps:
                mlp.gate_up_packed = mlp.down_packed = None
        self.lm_head_packed = None
        self.model.embed_quantized = None

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights for benchmarks (`--load-format dummy`): linear and embedding weights
        ~ N(0, 0.02), biases 0, norm weights 1. Deterministic for a given `seed`; mutates the
        parameters in place."""
        self._drop_packed_weights()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.02
                    param.copy_(values.to(param.dtype))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters.

        A `QuantizedWeight` (a GGUF matrix kept as blocks) is run on its blocks instead: q/k/v
        and gate/up stacked into one matrix when all of a group came quantized in one type, the
        embedding looked up row by row, the LM head on the embedding's blocks when tied; their
        float parameters are then emptied (no memory). A group quantized only in part is
        dequantized into its parameters.
        A mixture of experts' per-expert tensors go into their slices of the stacked expert
        parameters (pyserve.models.expert_weights); a GGUF's stacked quantized experts run on
        their blocks (`StackedExperts.gate_up_quant`, gate and up interleaved per expert), or
        are dequantized into the parameters when gate and up differ in type.
        Ignores `rotary_emb.inv_freq` buffers and, when the head is tied, `lm_head.weight`.
        Raises KeyError for an unknown name, ValueError for a shape mismatch or for parameters
        the checkpoint did not provide.
        """
        self._drop_packed_weights()
        tied = self.lm_head is None
        quantized: dict[str, QuantizedWeight] = {}
        experts = ExpertSlices(dict(self.named_parameters()), self.first_expert)

        def float_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = checkpoint_name(name)
                if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                    continue
                if isinstance(tensor, QuantizedWeight):
                    quantized[name] = tensor
                elif not experts.take(name, tensor):
                    yield name, tensor

        held = _Held(quantized, experts)
        copy_checkpoint(self, float_weights(), held_elsewhere=held)
        if quantized:
            self._hold_quantized(quantized)

    def _hold_quantized(self, quantized: dict[str, QuantizedWeight]) -> None:
        params = dict(self.named_parameters())

        def stack(names: list[str]) -> QuantizedWeight | None:
            """The stacked blocks of `names`, their float parameters emptied; or None, the
            quantized ones among them dequantized into their parameters."""
            parts = {name: quantized[name] for name in names if name in quantized}
            if len(parts) == len(names) and len({(p.qtype, p.data.shape[1]) for p in parts.values()}) == 1:
                for name in names:
                    params[name].data = params[name].data.new_empty(0)
                return QuantizedWeight.concat(list(parts.values()))
            with torch.no_grad():
                for name, part in parts.items():
                    params[name].copy_(dequantize(part, params[name].dtype))
            return None

        def hold_mlp(mlp: Any, pre: str) -> None:
            mlp.gate_up_packed = stack([f"{pre}gate_proj.weight", f"{pre}up_proj.weight"])
            if mlp.gate_up_packed is not None:
                mlp.gate_up_weight = mlp.gate_up_weight.new_empty(0)
            mlp.down_packed = stack([f"{pre}down_proj.weight"])

        for i, layer in enumerate(self.model.decoder_layers()):
            attn, mlp, pre = layer.self_attn, layer.mlp, f"model.layers.{i}."
            attn.qkv_packed = stack([f"{pre}self_attn.{p}_proj.weight" for p in "qkv"])
            if attn.qkv_packed is not None:
                attn.qkv_weight = attn.qkv_weight.new_empty(0)
            attn.o_packed = stack([f"{pre}self_attn.o_proj.weight"])
            if isinstance(mlp, SparseMoeBlock):
                self._hold_experts(mlp, f"{pre}mlp.experts.", quantized, params)
                if mlp.shared_expert is not None:
                    hold_mlp(mlp.shared_expert, f"{pre}mlp.shared_expert.")
                router = f"{pre}mlp.gate.weight"  # routing stays float: its logits pick the experts
                if router in quantized:
                    with torch.no_grad():
                        params[router].copy_(dequantize(quantized[router], params[router].dtype))
                continue
            hold_mlp(mlp, f"{pre}mlp.")
        self.model.embed_quantized = stack(["model.embed_tokens.weight"])
        self.lm_head_packed = self.model.embed_quantized if self.lm_head is None else stack(["lm_head.weight"])
        if "avx2" in quantized_isas():
            self._interleave_quantized()

    def _interleave_quantized(self) -> None:
        """Q4_0 projections, experts and untied LM head with their rows interleaved eight at a
        time (`QuantizedWeight.interleave`: the same bits, decode's one-row products about twice
        as fast on AVX2). Not the embedding (looked up by row) nor a head tied to it; experts
        only where every expert's rows are whole groups of eight."""

        def fast(w: Any) -> Any:
            return w.interleave() if isinstance(w, QuantizedWeight) and w.can_interleave() else w

        for layer in self.model.decoder_layers():
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_packed, attn.o_packed = fast(attn.qkv_packed), fast(attn.o_packed)
            mlps = [mlp]
            if isinstance(mlp, SparseMoeBlock):
                experts = mlp.experts
                if experts.inter % 4 == 0 and mlp.gate.weight.shape[1] % 8 == 0:  # 2I and H rows per expert
                    experts.gate_up_quant, experts.down_quant = fast(experts.gate_up_quant), fast(experts.down_quant)
                mlps = [mlp.shared_expert] if mlp.shared_expert is not None else []
            for dense in mlps:
                dense.gate_up_packed, dense.down_packed = fast(dense.gate_up_packed), fast(dense.down_packed)
        if self.lm_head is not None:
            self.lm_head_packed = fast(self.lm_head_packed)

    @staticmethod
    def _hold_experts(
        mlp: SparseMoeBlock, pre: str, quantized: dict[str, QuantizedWeight], params: dict[str, nn.Parameter]
    ) -> None:
        """A GGUF's stacked quantized experts (`{pre}{gate,up,down}_proj.weight`, E·rows rows
        each) onto `mlp.experts`: gate and up interleaved per expert into [E·2I] rows of blocks
        and run quantized, their float parameters emptied; gate and up of different types are
        dequantized into the parameters instead."""
        experts = mlp.experts
        gate, up, down = (quantized.get(f"{pre}{p}_proj.weight") for p in ("gate", "up", "down"))
        gate_up_name, down_name = f"{pre}gate_up_proj", f"{pre}down_proj"
        e, inter, hidden = experts.num_experts, experts.inter, params[down_name].shape[1]
        for proj, weight, want in (
            ("gate", gate, (e * inter, hidden)),
            ("up", up, (e * inter, hidden)),
            ("down", down, (e * hidden, inter)),
        ):
            if weight is not None and weight.shape != want:
                raise ValueError(
                    f"{pre}{proj}_proj.weight: GGUF experts of {weight.shape[0]} rows x {weight.shape[1]}, "
                    f"expected {e} experts of {want[0] // e} x {want[1]}"
                )
        with torch.no_grad():
            if gate is not None and up is not None and (gate.qtype, gate.data.shape) == (up.qtype, up.data.shape):
                blocks = [w.data.reshape(e, inter, -1) for w in (gate, up)]
                experts.gate_up_quant = QuantizedWeight(
                    np.concatenate(blocks, axis=1).reshape(2 * e * inter, -1), gate.qtype
                )
                params[gate_up_name].data = params[gate_up_name].data.new_empty(0)
            elif gate is not None and up is not None:
                whole = params[gate_up_name]
                half = whole.shape[1] // 2
                whole[:, :half].copy_(dequantize(gate, whole.dtype).reshape(whole.shape[0], half, -1))
                whole[:, half:].copy_(dequantize(up, whole.dtype).reshape(whole.shape[0], half, -1))
            if down is not None:
                experts.down_quant = down
                params[down_name].data = params[down_name].data.new_empty(0)
        if experts.gate_up_quant is None or experts.down_quant is None:  # the kernel takes both or neither
            for quant, name in ((experts.gate_up_quant, gate_up_name), (experts.down_quant, down_name)):
                if quant is not None:
                    dtype = params[name].dtype
                    params[name].data = dequantize(quant, dtype).reshape(experts.num_experts, -1, quant.shape[1])
            experts.gate_up_quant = experts.down_quant = None


class _Held:
    """The parameters a checkpoint provided in another form: quantized blocks, or expert
    slices that filled a stacked parameter whole (read once the tensors are consumed)."""

    def __init__(self, quantized: dict[str, QuantizedWeight], experts: ExpertSlices) -> None:
        self.quantized = quantized
        self.experts = experts
        self._complete: set[str] | None = None

    def __contains__(self, name: object) -> bool:
        if name in self.quantized:
            return True
        stem, _, last = str(name).rpartition(".")
        if stem.endswith(".mlp.experts") and last in ("gate_up_proj", "down_proj"):  # a GGUF's stacked blocks
            parts = ("gate_proj", "up_proj") if last == "gate_up_proj" else ("down_proj",)
            if all(f"{stem}.{p}.weight" in self.quantized for p in parts):
                return True
        if self._complete is None:
            self._complete = self.experts.complete()
        return name in self._complete
