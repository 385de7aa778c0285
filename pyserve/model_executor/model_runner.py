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
    SamplingBatchInfo,
    StepOutput,
)
from pyserve.layers.attention.base import AttentionBackend, CapturableAttentionBackend
from pyserve.layers.attention.registry import backend_class, capturable_backend, create_attention_backend
from pyserve.layers.expert_load import ExpertLoad
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
from pyserve.model_executor.runner_protocol import EmbeddingInfo, Runner, RunnerInfo
from pyserve.model_executor.step_logprobs import fill_logprobs, plan_input_logprobs
from pyserve.model_loader.config import ModelConfig
from pyserve.models.loader import load_model
from pyserve_kernels.quant import quantized_isas

if TYPE_CHECKING:
    from pyserve.config import ServerArgs

logger = logging.getLogger(__name__)


class ModelRunner(Runner):
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
    expert_parallel: with `tp`, a mixture of experts' experts are split whole over the ranks
      (--ep-size) instead of each expert in width.
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
            expert_parallel=args.ep_size > 1,
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
        expert_parallel: bool = False,
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
        self._load(
            model_path, dtype, torch_device, context_length, load_progress, load_format, quantization, expert_parallel
        )
        self.pooling = self._pooling(model_path, is_embedding, pooling)
        self.weight_bytes: int = self._count_weight_bytes()
        for module in self.model.modules():  # positions stay below the context: no host check
            if isinstance(module, RotaryEmbedding):
                module.reserve(self.model_config.context_len)
        self.graph_sizes = self._graph_sizes(
            torch_device, disable_cuda_graph, attention_backend, cuda_graph_max_bs, cuda_graph_bs
        )
        self.graph_runner: CudaGraphRunner | None = None
        # set aside for the graphs before the KV pool is sized
        self.cuda_graph_bytes = cuda_graph_reserve_bytes(self.model_config, self.dtype, self.graph_sizes)
        self._make_kv_pool(torch_device, max_total_tokens, mem_fraction_static, page_size)
        self._make_attention(attention_backend)
        self.info = RunnerInfo(
            embedding=None if self.pooling is None else self._embedding_info(self.pooling),
            is_encoder=self.is_encoder,
            cuda_graph_bytes=self.cuda_graph_bytes,
        )

    def _load(
        self,
        model_path: str,
        dtype: str | torch.dtype,
        device: torch.device,
        context_length: int | None,
        progress: bool,
        load_format: str,
        quantization: str,
        expert_parallel: bool,
    ) -> None:
        """Read the config and build the model with its weights (this rank's shard; with
        `expert_parallel` a mixture's experts split whole over the ranks); sets
        model_config, dtype, model, num_kv_heads and is_encoder."""
        tp = self.tp
        self.model_config = ModelConfig.from_path(model_path, dtype=dtype, device=device, context_length=context_length)
        self.dtype = self.model_config.dtype
        self.model = load_model(
            self.model_config,
            device,
            progress=progress,
            load_format=load_format,
            quantization=quantization,
            tp=tp,
            expert_parallel=expert_parallel,
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

    def _pooling(self, model_path: str, is_embedding: bool, pooling: str | None) -> PoolingSpec | None:
        """How embeddings are pooled, None when the runner generates: `pooling` when given,
        else the folder's sentence-transformers files, else the last token, normalised
        unless those files leave Normalize out."""
        if not (is_embedding or self.is_encoder):
            return None
        declared = sentence_transformers_pooling(model_path) if os.path.isdir(model_path) else None
        spec = declared or PoolingSpec("last", normalize=True)
        return PoolingSpec(pooling, normalize=spec.normalize) if pooling is not None else spec

    def _embedding_info(self, pooling: PoolingSpec) -> EmbeddingInfo:
        hf_config = self.model_config.hf_config
        sizes = getattr(hf_config, "matryoshka_dimensions", None)
        return EmbeddingInfo(
            pooling=pooling,
            hidden_size=self.model_config.hidden_size,
            matryoshka=bool(getattr(hf_config, "is_matryoshka", False) or sizes),
            matryoshka_dimensions=tuple(int(n) for n in sizes) if sizes else None,
        )

    def _count_weight_bytes(self) -> int:
        """Bytes of the parameters plus the copies the CPU kernels run on: oneDNN-packed
        projections in float32 (layers/linear.py, `packed_weight_bytes`) and a GGUF's blocks
        (`quantized_weight_bytes`)."""
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
        return (
            self.packed_weight_bytes
            + self.quantized_weight_bytes
            + sum(p.numel() * p.element_size() for p in self.model.parameters())
        )

    def _graph_sizes(
        self,
        device: torch.device,
        disable_cuda_graph: bool,
        attention_backend: str,
        cuda_graph_max_bs: int | None,
        cuda_graph_bs: list[int] | None,
    ) -> list[int]:
        """The decode batch sizes to capture as CUDA graphs ([] for none: not CUDA, disabled,
        an embedding model, a backend that cannot be captured, a dynamic rope, or a mixture
        of experts split whole over ranks, whose step picks its assignments on the host)."""
        if device.type != "cuda" or disable_cuda_graph or self.pooling is not None:
            return []
        if not capturable_backend(attention_backend, device.type):
            logger.info("CUDA graphs off: attention backend %s cannot be captured", attention_backend)
            return []
        if any(isinstance(m, RotaryEmbedding) and m.is_dynamic for m in self.model.modules()):
            logger.info("CUDA graphs off: dynamic rope reads positions on the host")
            return []
        capturable = getattr(self.model, "graph_capturable", None)
        if capturable is not None and not capturable():
            logger.info("CUDA graphs off: a mixture's experts are chosen on the host (expert parallelism or no Triton)")
            return []
        return capture_batch_sizes(self.max_running_requests, cuda_graph_max_bs, cuda_graph_bs)

    def _make_kv_pool(
        self, device: torch.device, max_total_tokens: int | None, mem_fraction_static: float, page_size: int
    ) -> None:
        """Size the KV pool (the same slots on every rank) and allocate it; sets page_size,
        max_total_num_tokens, kv_pool and kv_cache_bytes."""
        tp = self.tp
        self.page_size = int(page_size)
        # ranks on one CPU machine share its memory: each takes its part of the budget
        shares = tp.local_size if tp is not None and device.type == "cpu" else 1
        pool = self._kv_pool_size(device, max_total_tokens, mem_fraction_static, shares)
        if tp is not None:  # every rank holds the same slots
            pool = tp.min_int(pool)
        self.max_total_num_tokens = pool - pool % self.page_size
        if self.max_total_num_tokens <= 0:
            raise ValueError(f"a KV pool of {pool} tokens holds no page of {self.page_size}")
        self.kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens,
            0 if self.is_encoder else self.model_config.num_hidden_layers,
            self.num_kv_heads,
            self.model_config.head_dim,
            self.dtype,
            device,
            page_size=self.page_size,
        )
        self.kv_cache_bytes = self.kv_pool.total_bytes

    def _make_attention(self, attention_backend: str) -> None:
        """The attention backend over the pool (an encoder: SDPA within each sequence);
        drops the graph sizes when "auto" chose a backend that cannot be captured."""
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

    def expert_load(self) -> ExpertLoad | None:
        """The model's routing counts when it is a mixture of experts, else None."""
        load = getattr(self.model, "expert_load", None)
        return load if isinstance(load, ExpertLoad) else None

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
            self._input_groups = plan_input_logprobs(batch)
            if self.graph_runner is not None and self.graph_runner.can_run(batch):
                logits = self.graph_runner.replay(batch)
            else:
                self.attn_backend.init_forward_metadata(batch)
                logits = self.model(batch, self.attn_backend)
            if (load := self.expert_load()) is not None:
                load.publish()
            return logits

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

    def sample_next(self, logits: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token ids [B] int64 on the device of `batch` (after `forward(batch)`) and the
        mask [B] bool of rows whose own parameters left nothing to sample (see
        sample_checked), both on the device. Worker thread only."""
        assert batch.sampling_info is not None  # DeviceState.forward_batch sets it
        with torch.inference_mode():
            return sample_checked(logits, batch.sampling_info)

    def add_logprobs(self, out: StepOutput, logits: torch.Tensor, batch: ForwardBatch, next_ids: torch.Tensor) -> None:
        """Fill out.output_logprobs / input_logprobs with what batch.logprob_info asks for
        (nothing when it asks for none; see step_logprobs.py). Worker thread only."""
        if batch.logprob_info is not None:
            fill_logprobs(out, logits, batch, next_ids, self._input_groups)

    def sample(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """Next token ids [B] int64 on the device: argmax where temperature == 0, else
        temperature, top-k, top-p and torch.multinomial with the request's generator when
        given (see pyserve.layers.sampler.sample). Worker thread only."""
        with torch.inference_mode():
            return sample_tokens(logits, sampling_info)
