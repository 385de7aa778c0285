"""Linear layers and embedding lookups on GGUF block-quantized weights, kept quantized: the
native CPU kernels of kernels/cpu/src/quant (activations quantized per block of 32 to int8,
integer dot products with AVX2 or AVX-512 VNNI where the CPU has them, else portable Rust).

A `QuantizedWeight` holds a GGUF tensor's blocks as they are in the file, one row of whole
blocks per output feature, or (Q4_0, `interleave`) the same blocks with rows interleaved eight
at a time. There is no torch fallback: `quantized_kernels_available()` says
whether the native module is built, and a caller without it dequantizes at load instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from pyserve_kernels._native import _cpu

# ggml type name -> (type id, weights per block, bytes per block); ggml-common.h
QUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}


# added to a ggml type id for the kernels: the blocks are interleaved (kernels/cpu/src/python.rs)
INTERLEAVED = 0x100


def quantized_kernels_available() -> bool:
    """Whether the native module with the quantized kernels is built."""
    return _cpu is not None


def quantized_isas() -> list[str]:
    """Instruction-set paths of this CPU ("scalar", "avx2", "avx512vnni"), the best last; every
    path gives bit-identical results. Raises RuntimeError without the native module."""
    if _cpu is None:
        raise RuntimeError("pyserve_kernels._cpu is not built")
    return list(_cpu.quant_isas())


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight matrix [out_features, in_features] stored as GGUF blocks.

    data: [out_features, row_bytes] uint8, C-contiguous; each row `in_features / block
      weights` blocks of type `qtype` (read-only arrays, e.g. a view of the memory-mapped
      file, are fine: the kernels only read them).
    qtype: the ggml type name, a key of QUANT_TYPES.
    Raises ValueError for an unknown type or a row that is not whole blocks.
    """

    data: np.ndarray
    qtype: str
    # Q4_0 rows interleaved eight at a time (kernels/cpu/src/quant/interleave.rs): the layout
    # one-row products run fastest on; see `interleave`
    interleaved: bool = False

    def __post_init__(self) -> None:
        if self.qtype not in QUANT_TYPES:
            raise ValueError(f"no quantized kernel for {self.qtype}; kernels exist for {', '.join(QUANT_TYPES)}")
        _, _, block_bytes = QUANT_TYPES[self.qtype]
        if self.data.dtype != np.uint8 or self.data.ndim != 2 or not self.data.flags.c_contiguous:
            raise ValueError("data must be a C-contiguous [rows, row_bytes] uint8 array")
        if self.data.shape[1] % block_bytes:
            raise ValueError(f"a row of {self.data.shape[1]} bytes is not whole {self.qtype} blocks")

    @functools.cached_property
    def type_id(self) -> int:
        """The ggml type id, plus 0x100 when interleaved (what the native kernels take)."""
        return QUANT_TYPES[self.qtype][0] | (INTERLEAVED if self.interleaved else 0)

    def can_interleave(self) -> bool:
        """Whether `interleave` applies: Q4_0, rows a multiple of 8, not interleaved already."""
        return self.qtype == "Q4_0" and self.data.shape[0] % 8 == 0 and not self.interleaved

    def interleave(self) -> QuantizedWeight:
        """The same weight with its rows interleaved eight at a time (a new array; the same bytes
        in another order): decode's one-row products read it about twice as fast on AVX2, and
        every product, lookup and dequantization gives the same bits as before. Raises
        ValueError unless `can_interleave()`, RuntimeError without the native module."""
        if not self.can_interleave():
            raise ValueError(
                f"only a Q4_0 weight of whole groups of 8 rows interleaves (got {self.qtype}, {self.shape})"
            )
        if _cpu is None:
            raise RuntimeError("pyserve_kernels._cpu is not built")
        return QuantizedWeight(_cpu.quant_interleave(self.data, self.type_id), self.qtype, interleaved=True)

    @functools.cached_property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        _, block_elems, block_bytes = QUANT_TYPES[self.qtype]
        return self.data.shape[0], self.data.shape[1] // block_bytes * block_elems

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def take_rows(self, rows: np.ndarray) -> QuantizedWeight:
        """A new weight of the given rows (int array), in that order (a copy). Raises ValueError
        for an interleaved weight (its rows are not contiguous)."""
        if self.interleaved:
            raise ValueError("rows of an interleaved weight cannot be taken; take them before interleaving")
        return QuantizedWeight(np.ascontiguousarray(self.data[rows]), self.qtype)

    @staticmethod
    def concat(weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of `weights` stacked (a copy). Raises ValueError unless all have one type
        and one row length."""
        if len({(w.qtype, w.data.shape[1]) for w in weights}) != 1 or any(w.interleaved for w in weights):
            raise ValueError("only row-major weights of one type and row length can be stacked")
        return QuantizedWeight(np.concatenate([w.data for w in weights]), weights[0].qtype)


def quantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None, isa: str | None = None
) -> torch.Tensor:
    """x [..., in_features] @ dequantized(weight).T + bias -> [..., out_features] in x.dtype
    (computed in float32 on torch's intra-op threads).

    Error: activations are rounded to int8 per block of 32 (scale max|x| / 127), so each output
    is within sum over blocks of (max|x_block| / 254) * sum|w_block| of the float product, plus
    float32 rounding (kernels/cpu/src/quant/mod.rs). isa: force an instruction-set path (tests).
    Raises ValueError for a shape that does not fit, RuntimeError without the native module.
    """
    if _cpu is None:
        raise RuntimeError("pyserve_kernels._cpu is not built")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {in_features}")
    # A model's [tokens, features] float32 rows go to the kernel as they are: a decode step
    # makes ~120 of these calls, and each reshape or cast costs 2-3 us of Python and dispatch.
    rows_as_given = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
    x2 = x if rows_as_given else x.reshape(-1, in_features).to(torch.float32).contiguous()
    out = np.empty((x2.shape[0], out_features), dtype=np.float32)
    _cpu.quant_matmul(x2.numpy(), weight.data, weight.type_id, out, torch.get_num_threads(), isa)
    result = torch.from_numpy(out)
    if bias is not None:
        result += bias
    return result if rows_as_given else result.reshape(*x.shape[:-1], out_features).to(x.dtype)


def quantized_embedding(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dequantized rows `ids` ([T] integer, CPU) of `weight` -> [T, in_features] in
    `dtype`; only those rows are read. Raises IndexError for an id outside the rows."""
    if _cpu is None:
        raise RuntimeError("pyserve_kernels._cpu is not built")
    rows = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(rows.shape[0], weight.shape[1], dtype=torch.float32)
    _cpu.quant_dequantize_rows(weight.data, weight.type_id, rows.numpy(), out.numpy())
    return out.reshape(*ids.shape, weight.shape[1]).to(dtype)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole matrix [out_features, in_features] in `dtype`, exactly as ggml dequantizes it."""
    return quantized_embedding(weight, torch.arange(weight.shape[0]), dtype)
