"""ModelRunner: owns the model, its KV cache tensors and the attention backend on one device,
and turns a ForwardBatch into logits and next token ids. How many KV slots the pool gets
(free memory, the CUDA graphs' reserve) is worked out in kv_pool_sizing.py.

Thread model (DESIGN.md section 1): exactly ONE worker thread calls `forward` and `sample`
after construction; the runner holds no locks and must not be shared between threads.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, cast

import torch

from pyserve.distributed.group import TensorParallelGroup
from pyserve.distributed.shard import ShardLayout
from pyserve.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    SamplingBatchInfo,
    StepOutput,
)
from pyserve.layers.attention.base import AttentionBackend, CapturableAttentionBackend
from pyserve.layers.attention.registry import backend_class, capturable_backend, create_attention_backend
from pyserve.layers.logprobs import logprobs_of_rows
from pyserve.layers.pooler import PoolingSpec, pool, sentence_transformers_pooling
from pyserve.layers.rotary_embedding import RotaryEmbedding
from pyserve.layers.sampler import sample as sample_tokens
from pyserve.layers.sampler import sample_checked
from pyserve.mem_cache.memory_pool import MHATokenToKVPool
from pyserve.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes
from pyserve.model_executor.kv_pool_sizing import (
    available_memory_bytes,
    cuda_graph_reserve_bytes,
    default_mem_fraction,
    kv_pool_tokens,
)
from pyserve.model_loader.config import ModelConfig
from pyserve.model_loader.weights import load_model
from pyserve_kernels.quant import quantized_isas

if TYPE_CHECKING:
    from pyserve.config import ServerArgs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Loads a model (HF folder or .gguf file) and runs forward passes and sampling.

    model_path: HF folder or .gguf file.
    dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16".
    context_length: override of the model's context length (see ModelConfig.from_path).
    max_total_tokens: KV pool size in tokens; None derives it from free memory:
      (free memory after loading the weights) * mem_fraction_static (None: 0.85 on CUDA, 0.25
      on CPU; shared out among the tensor-parallel ranks on one CPU machine), divided by the
      bytes one token's K/V take; on CPU further capped at
      max_running_requests * context_len (every request at full length: more is never
      used). Rounded down to whole pages.
    page_size: tokens per KV page; the KV tensors get max_total_num_tokens + page_size rows
      (page 0 is reserved for the padding slot 0).
    random_seed: seeds the global torch RNG (sampling of requests without their own seed).
    load_progress: show tqdm bars while loading weights.
    load_format: "auto" (the checkpoint's weights) or "dummy" (random weights from the
      config, no weight file read: for benchmarks).
    quantization: "auto" (a GGUF's quantized matrices run on their blocks on CPU through the
      native kernels; see model_loader/weights.py `keeps_quantized`) or "none" (dequantized
      to the dtype).
    attention_backend: a name of `layers/attention/registry.py`: "torch_native" (the SDPA
      reference), "cpu" (native decode kernel; float32 on CPU only), "triton" (the Triton
      kernels; CUDA, or CPU under TRITON_INTERPRET=1) or "auto" (triton on CUDA, cpu on CPU
      where it applies, else torch_native).
    disable_cuda_graph / cuda_graph_max_bs / cuda_graph_bs / max_running_requests: decode
      steps on CUDA replay CUDA graphs captured by `init_cuda_graphs` (see
      cuda_graph_runner.py) unless disabled, the backend cannot be captured or the rope is
      dynamic; their memory is set aside before the KV pool is sized.
    tp: this process's rank of a tensor-parallel group (`pyserve.distributed`): the runner
      holds the rank's shard of the model and a KV pool of the rank's KV heads, whose size
      in tokens is the smallest any rank can hold (the same slots on every rank). Every
      rank calls `forward` with the same batches in the same order; only rank 0 samples.
    is_embedding: serve embeddings (`embed`) instead of tokens; an encoder (BertModel) always
      does. Its pooling: `pooling` ("mean", "cls", "last") when given, else what the folder's
      sentence-transformers files say (layers/pooler.py), else the last token; normalised
      unless those files leave Normalize out. An encoder keeps no KV: its pool has no layers
      (no memory) and max_running_requests * context_len slots of bookkeeping, so admission
      still counts tokens.

    Attributes: model_config, model, device (str: "cpu", "cuda", "cuda:1"), dtype
    (torch.dtype), kv_pool (MHATokenToKVPool), max_total_num_tokens (real slots
    page_size..max_total_num_tokens + page_size - 1; slot 0 is padding), kv_cache_bytes,
    attn_backend, packed_weight_bytes (on CPU in float32: the oneDNN-packed weight copies the
    model's projections run on, counted against the KV pool's memory; else 0),
    quantized_weight_bytes (the GGUF blocks the model runs on; else 0), weight_bytes (all of
    them and the parameters).
    Raises ModelNotFoundError for a missing path, ValueError for an unsupported architecture,
    dtype or attention backend, and ValueError when memory leaves no room for a KV cache.
    """

    @classmethod
    def from_server_args(
        cls,
        args: ServerArgs,
        model_path: str,
        device: str,
        tp: TensorParallelGroup | None = None,
        load_progress: bool = True,
    ) -> ModelRunner:
        """The runner `pyserve serve` builds from its flags, on `device` (every rank of a
        tensor-parallel group builds its own this way: the same flags, its own device and
        group). Raises what the constructor raises."""
        return cls(
            model_path,
            dtype=args.dtype,
            device=device,
            context_length=args.context_length,
            max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            random_seed=args.random_seed,
            load_progress=load_progress,
            page_size=args.page_size,
            load_format=args.load_format,
            quantization=args.quantization,
            attention_backend=args.attention_backend,
            disable_cuda_graph=args.disable_cuda_graph,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            cuda_graph_bs=args.cuda_graph_bs,
            max_running_requests=args.max_running_requests,
            is_embedding=args.is_embedding,
            pooling=args.pooling,
            tp=tp,
        )

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        context_length: int | None = None,
        max_total_tokens: int | None = None,
        mem_fraction_static: float | None = None,
        random_seed: int | None = None,
        load_progress: bool = True,
        page_size: int = 1,
        load_format: str = "auto",
        quantization: str = "auto",
        attention_backend: str = "auto",
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int | None = None,
        cuda_graph_bs: list[int] | None = None,
        max_running_requests: int = 256,
        is_embedding: bool = False,
        pooling: str | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        torch_device = torch.device(device)
        self.tp = tp
        if tp is not None and is_embedding:
            raise ValueError("embedding models run with --tp-size 1")
        if mem_fraction_static is None:
            mem_fraction_static = default_mem_fraction(torch_device)
        if not 0.0 < mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
        self.max_running_requests = max_running_requests
        self.device: str = str(torch_device)  # a plain string: callers log and JSON-encode it
        if random_seed is not None:
            torch.manual_seed(random_seed)
        self.model_config = ModelConfig.from_path(
            model_path, dtype=dtype, device=torch_device, context_length=context_length
        )
        self.dtype = self.model_config.dtype
        self.model = load_model(
            self.model_config,
            torch_device,
            progress=load_progress,
            load_format=load_format,
            quantization=quantization,
            tp=tp,
        )
        self.num_kv_heads = (  # this rank's
            ShardLayout.of(self.model_config.hf_config, tp.rank, tp.size).num_kv_heads
            if tp is not None
            else self.model_config.num_key_value_heads
        )
        self.is_encoder: bool = bool(getattr(self.model, "is_encoder", False))
        positions = int(getattr(self.model_config.hf_config, "max_position_embeddings", 0))
        if self.is_encoder and self.model_config.context_len > positions:
            raise ValueError(
                f"context length {self.model_config.context_len} exceeds the encoder's "
                f"{positions} position embeddings (an encoder cannot go past them)"
            )
        self.is_embedding: bool = is_embedding or self.is_encoder
        self.pooling: PoolingSpec | None = None
        if self.is_embedding:
            declared = sentence_transformers_pooling(model_path) if os.path.isdir(model_path) else None
            self.pooling = declared or PoolingSpec("last", normalize=True)
            if pooling is not None:
                self.pooling = PoolingSpec(pooling, normalize=self.pooling.normalize)
        # On CPU in float32, oneDNN-packed copies of the projection weights (layers/linear.py).
        prepack_weights = getattr(self.model, "prepack_linear_weights", None)
        self.packed_weight_bytes: int = prepack_weights() if prepack_weights else 0
        quantized_bytes = getattr(self.model, "quantized_weight_bytes", None)
        self.quantized_weight_bytes: int = quantized_bytes() if quantized_bytes else 0
        if self.quantized_weight_bytes:
            logger.info(
                "quantized weights: %.1f MB of GGUF blocks run on the native kernels (%s)",
                self.quantized_weight_bytes / 2**20,
                quantized_isas()[-1],
            )
        self.weight_bytes: int = (
            self.packed_weight_bytes
            + self.quantized_weight_bytes
            + sum(p.numel() * p.element_size() for p in self.model.parameters())
        )
        self.page_size = int(page_size)
        cfg = self.model_config
        for module in self.model.modules():  # positions stay below the context: no host check
            if isinstance(module, RotaryEmbedding):
                module.reserve(cfg.context_len)
        self.graph_sizes: list[int] = []
        if torch_device.type == "cuda" and not disable_cuda_graph and not self.is_embedding:
            if not capturable_backend(attention_backend, torch_device.type):
                logger.info("CUDA graphs off: attention backend %s cannot be captured", attention_backend)
            elif any(isinstance(m, RotaryEmbedding) and m.is_dynamic for m in self.model.modules()):
                logger.info("CUDA graphs off: dynamic rope reads positions on the host")
            else:
                self.graph_sizes = capture_batch_sizes(max_running_requests, cuda_graph_max_bs, cuda_graph_bs)
        self.graph_runner: CudaGraphRunner | None = None
        # set aside for the graphs before the KV pool is sized
        self.cuda_graph_bytes = cuda_graph_reserve_bytes(cfg, self.dtype, self.graph_sizes)
        # ranks on one CPU machine share its memory: each takes its part of the budget
        shares = tp.local_size if tp is not None and torch_device.type == "cpu" else 1
        pool = self._kv_pool_size(torch_device, max_total_tokens, mem_fraction_static, shares)
        if tp is not None:  # every rank holds the same slots
            pool = tp.min_int(pool)
        self.max_total_num_tokens = pool - pool % self.page_size
        if self.max_total_num_tokens <= 0:
            raise ValueError(f"a KV pool of {pool} tokens holds no page of {self.page_size}")
        self.kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens,
            0 if self.is_encoder else cfg.num_hidden_layers,
            self.num_kv_heads,
            cfg.head_dim,
            self.dtype,
            torch_device,
            page_size=self.page_size,
        )
        self.kv_cache_bytes = self.kv_pool.total_bytes
        self._input_groups: list | None = None  # prompt-logprob plan of the last forward
        if self.is_encoder:  # no KV to read: the model attends within each sequence itself
            self.attn_backend: AttentionBackend = backend_class("torch_native")(self.kv_pool)
            self.attention_backend_name = "none (an encoder: SDPA within each sequence)"
        else:
            self.attn_backend = create_attention_backend(attention_backend, self.kv_pool)
            self.attention_backend_name = self.attn_backend.name
        if self.graph_sizes and not self.attn_backend.supports_cuda_graph:  # "auto" fell back
            logger.info("CUDA graphs off: attention backend %s cannot be captured", self.attention_backend_name)
            self.graph_sizes = []
        logger.info(
            "KV cache: %d tokens, %.1f MiB (%s, %s); attention backend %s",
            self.max_total_num_tokens,
            self.kv_cache_bytes / 2**20,
            self.dtype,
            self.device,
            self.attention_backend_name,
        )

    def init_cuda_graphs(self, req_to_token: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Capture the decode graphs over the worker's req_to_token table on its stream (the
        worker thread, before its first step). No-op when graphs are off."""
        backend = self.attn_backend
        if self.graph_sizes:
            # graph_sizes is emptied at start when the backend cannot be captured
            assert isinstance(backend, CapturableAttentionBackend)
            self.graph_runner = CudaGraphRunner(
                lambda batch: self.model(batch, backend), backend, req_to_token, self.graph_sizes, stream
            )

    def _kv_pool_size(
        self, device: torch.device, max_total_tokens: int | None, mem_fraction_static: float, shares: int = 1
    ) -> int:
        """KV pool size in tokens before page rounding: `max_total_tokens` when given, an
        encoder's bookkeeping slots, else derived from free memory (`kv_pool_tokens`)."""
        cfg = self.model_config
        if max_total_tokens is not None:
            if int(max_total_tokens) <= 0:
                raise ValueError(f"max_total_tokens must be > 0, got {max_total_tokens}")
            return int(max_total_tokens)
        if self.is_encoder:  # slots without memory: what admission counts
            return self.max_running_requests * cfg.context_len
        return kv_pool_tokens(
            cfg,
            self.num_kv_heads,
            self.dtype,
            device,
            available_memory_bytes(device),
            mem_fraction_static,
            weight_bytes=self.weight_bytes,
            cuda_graph_bytes=self.cuda_graph_bytes,
            max_running_requests=self.max_running_requests,
            shares=shares,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Compute the new tokens of `batch` (EXTEND or DECODE) under torch.inference_mode().

        Writes their K/V into kv_pool at batch.out_cache_loc (mutates the pool).
        Returns logits [B, vocab] float32 on the device, for the last new token of each request.
        Worker thread only. Raises ValueError for inconsistent batch lengths.
        """
        with torch.inference_mode():
            self._input_groups = self._plan_input_logprobs(batch)
            if self.graph_runner is not None and self.graph_runner.can_run(batch):
                return self.graph_runner.replay(batch)
            self.attn_backend.init_forward_metadata(batch)
            return self.model(batch, self.attn_backend)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """Embeddings [B, hidden] float32 on the device of an EXTEND `batch` of whole prompts
        (an embedding server's only step): the model's last hidden states pooled per request
        by `self.pooling` over its new tokens (an encoder's whole prompt; a decoder pools its
        last token, which a cached prefix leaves computed). A decoder writes its K/V as in
        `forward`; an encoder writes none. Worker thread only."""
        assert self.pooling is not None and batch.extend_seq_lens is not None
        with torch.inference_mode():
            if self.is_encoder:
                hidden = self.model(batch, None)
            else:
                self.attn_backend.init_forward_metadata(batch)
                decoder = cast(torch.nn.Module, self.model.model)  # the decoder under the LM head
                hidden = decoder(batch, self.attn_backend)
            return pool(hidden, batch.extend_seq_lens.tolist(), self.pooling)

    @staticmethod
    def _plan_input_logprobs(batch: ForwardBatch) -> list[tuple[int, int, int] | None] | None:
        """For prompt logprobs: set batch.input_logits_rows to the token rows whose logits
        predict the wanted prompt tokens; returns per request (start, first row in
        input_logits, count) or None."""
        info = batch.logprob_info
        if (
            info is None
            or batch.forward_mode != ForwardMode.EXTEND
            or all(s is None for s in info.input_logprob_starts)
        ):
            return None
        rows: list[int] = []
        groups: list[tuple[int, int, int] | None] = []
        token_start = 0
        assert batch.extend_seq_lens is not None  # input logprobs come from EXTEND batches
        for start, ext in zip(info.input_logprob_starts, batch.extend_seq_lens.tolist()):
            if start is None:
                groups.append(None)
            else:
                # token j of the extend range is predicted by row j - 1 (none for j == 0)
                first = max(start, 1)
                groups.append((start, len(rows), max(ext - first, 0)))
                rows.extend(range(token_start + first - 1, token_start + ext - 1))
            token_start += ext
        batch.input_logits_rows = torch.tensor(rows, dtype=torch.int64, device=batch.input_ids.device)
        return groups

    def sample_next(self, logits: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token ids [B] int64 on the device of `batch` (after `forward(batch)`) and the
        mask [B] bool of rows whose own parameters left nothing to sample (see
        sample_checked), both on the device. Worker thread only."""
        assert batch.sampling_info is not None  # DeviceState.forward_batch sets it
        with torch.inference_mode():
            return sample_checked(logits, batch.sampling_info)

    def add_logprobs(self, out: StepOutput, logits: torch.Tensor, batch: ForwardBatch, next_ids: torch.Tensor) -> None:
        """Fill out.output_logprobs / input_logprobs with what batch.logprob_info asks for
        (nothing when it asks for none). Worker thread only."""
        info = batch.logprob_info
        if info is None or not any(info.return_logprob):
            return
        with torch.inference_mode():
            rows = [i for i, want in enumerate(info.return_logprob) if want]
            rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            picked = logprobs_of_rows(
                logits[rows_t],
                next_ids[rows_t],
                [info.top_logprobs_nums[i] for i in rows],
                [info.token_ids_logprob[i] for i in rows],
                [(k, 1) for k in range(len(rows))],
            )
            out.output_logprobs = [None] * batch.batch_size
            for i, item in zip(rows, picked):
                out.output_logprobs[i] = item
            groups = self._input_groups
            if groups is not None and batch.input_logits is not None and batch.input_logits_rows is not None:
                targets = batch.input_ids[batch.input_logits_rows + 1]
                wanted = [i for i, g in enumerate(groups) if g is not None]
                items = logprobs_of_rows(
                    batch.input_logits,
                    targets,
                    [info.top_logprobs_nums[i] for i in wanted],
                    [info.token_ids_logprob[i] for i in wanted],
                    [groups[i][1:] for i in wanted],
                )
                out.input_logprobs = [None] * batch.batch_size
                for i, item in zip(wanted, items):
                    if groups[i][0] == 0:  # the first prompt token has no context
                        item.token_logprobs.insert(0, None)
                        if item.top_logprobs is not None:
                            item.top_logprobs.insert(0, [])
                        if item.token_ids_logprobs is not None:
                            item.token_ids_logprobs.insert(0, [])
                    out.input_logprobs[i] = item

    def sample(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """Next token ids [B] int64 on the device: argmax where temperature == 0, else
        temperature, top-k, top-p and torch.multinomial with the request's generator when
        given (see pyserve.layers.sampler.sample). Worker thread only."""
        with torch.inference_mode():
            return sample_tokens(logits, sampling_info)
