"""KV pool sizing: how many token slots the KV cache gets from the device's free memory, and
the memory set aside first for the decode CUDA graphs.

Pure arithmetic over the model's shape and a free-memory figure, plus `available_memory_bytes`
to read that figure. Called only while `ModelRunner` is constructed (the thread that builds
the runner, before the worker thread takes it over); holds no state.
"""

from __future__ import annotations

import logging
import os

import torch

from pyserve.mem_cache.memory_pool import MHATokenToKVPool
from pyserve.model_loader.config import ModelConfig

logger = logging.getLogger(__name__)

# The KV pool's default share of free memory: on CUDA the device is the server's alone; on CPU
# the machine is shared (other servers, replicas, the test suite), so a quarter. On CPU the
# pool is further capped at max_running_requests full-length sequences (`kv_pool_tokens`).
CUDA_MEM_FRACTION_STATIC = 0.85
CPU_MEM_FRACTION_STATIC = 0.25


def default_mem_fraction(device: torch.device) -> float:
    """The KV pool's share of free memory when none is given: 0.85 on CUDA, 0.25 on CPU."""
    return CUDA_MEM_FRACTION_STATIC if device.type == "cuda" else CPU_MEM_FRACTION_STATIC


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of `device` in bytes: `torch.cuda.mem_get_info` on CUDA, available
    physical pages (os.sysconf SC_AVPHYS_PAGES * SC_PAGE_SIZE) on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def kv_pool_tokens(
    cfg: ModelConfig,
    num_kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    free: int,
    mem_fraction_static: float,
    *,
    weight_bytes: int,
    cuda_graph_bytes: int,
    max_running_requests: int,
    shares: int = 1,
) -> int:
    """KV pool size in tokens from `free` bytes of `device`: free * mem_fraction_static, less
    the decode graphs' reserve on CUDA (mem_get_info already excludes the loaded weights), or
    on CPU divided among `shares` ranks on the machine and less `weight_bytes`; divided by the
    bytes one token's K/V take (`num_kv_heads`: this rank's). On CPU capped at
    max_running_requests * context_len. Logs the derivation; raises ValueError when it leaves
    no token."""
    per_token = MHATokenToKVPool.bytes_per_token_for(cfg.num_hidden_layers, num_kv_heads, cfg.head_dim, dtype)
    if device.type == "cuda":
        budget = int(free * mem_fraction_static) - cuda_graph_bytes
    else:
        budget = int(free * mem_fraction_static) // shares - weight_bytes
    num_tokens = budget // per_token
    derivation = (
        f"free {free / 2**20:.0f} MiB x {mem_fraction_static} "
        f"{f'/ {shares} ranks on this machine ' if shares > 1 else ''}"
        f"{'' if device.type == 'cuda' else f'- weights {weight_bytes / 2**20:.0f} MiB '}"
        f"/ {per_token} B per token = {num_tokens} tokens"
    )
    if device.type != "cuda":
        cap = max_running_requests * cfg.context_len
        if num_tokens > cap:
            num_tokens = cap
            derivation += f", capped on CPU at max_running_requests x context_len = {cap}"
    logger.info("KV pool size: %s", derivation)
    if num_tokens <= 0:
        raise ValueError(f"not enough memory for a KV cache: {derivation}")
    return int(num_tokens)


def cuda_graph_reserve_bytes(cfg: ModelConfig, dtype: torch.dtype, graph_sizes: list[int]) -> int:
    """Memory kept out of the KV pool for the decode graphs of `graph_sizes` (an estimate, per
    row of the largest padded batch): the shared float32 logits output (4 B x vocab), the
    largest graph's transient logits (LM-head output and its float32 copy, 6 B x vocab) and
    activations (hidden, q|k|v, gate|up, x8 for intermediates); plus 256 MiB for workspaces
    and the allocator. Every graph shares one memory pool and one output. 0 without graphs."""
    if not graph_sizes:
        return 0
    bs, size = graph_sizes[-1], torch.tensor([], dtype=dtype).element_size()
    inter = int(getattr(cfg.hf_config, "intermediate_size", 4 * cfg.hidden_size))
    per_row = 10 * cfg.vocab_size + 8 * size * (3 * cfg.hidden_size + 2 * inter)
    return bs * per_row + (256 << 20)
