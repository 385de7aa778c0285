"""`ServerInfoMixin`: what the introspection routes report, in SGLang's shapes:
/get_model_info, /get_server_info (with `internal_states`, one entry per data-parallel rank)
and /get_load. EngineCore's mixin; loop thread only (they read the scheduler's and the KV
cache's live figures)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from pyserve.config import ServerArgs
    from pyserve.constrained import GrammarBackend
    from pyserve.engine.scheduler import Scheduler
    from pyserve.engine.worker import ModelWorker
    from pyserve.layers.expert_load import ExpertLoad
    from pyserve.mem_cache.kv_cache import KVCache
    from pyserve.metrics import Histogram, RequestMetrics
    from pyserve.model_executor.runner_protocol import Runner


@dataclass(frozen=True)
class ServingFigures:
    """The live figures /metrics exports, read at one moment (loop thread).

    requests: the ended requests' histograms and counts (pyserve.metrics.RequestMetrics).
    generated_tokens: every token sampled. retractions: requests sent back to wait.
    running / waiting / grammar_waiting: requests admitted, queued, compiling a grammar.
    kv_total / kv_used / kv_cached: KV tokens of the pool, held by requests, held only by the
    evictable prefix cache. gen_throughput: output tokens/s over the last stats interval.
    grammar_compile_time: the grammar backend's compile histogram (None without one).
    expert_load: a mixture of experts' routing counts (None for a dense model)."""

    requests: RequestMetrics
    generated_tokens: int
    retractions: int
    running: int
    waiting: int
    grammar_waiting: int
    kv_total: int
    kv_used: int
    kv_cached: int
    gen_throughput: float
    grammar_compile_time: Histogram | None
    expert_load: ExpertLoad | None = None


class ServerInfoMixin:
    """The introspection answers over EngineCore's parts; EngineCore sets the attributes
    below."""

    server_args: ServerArgs
    model_runner: Runner
    model_path: str
    model_name: str
    context_len: int
    is_generation: bool
    kv_cache: KVCache
    scheduler: Scheduler
    worker: ModelWorker
    grammar_backend: GrammarBackend | None

    def get_model_info(self) -> dict[str, Any]:
        """SGLang's /get_model_info fields (model_path, tokenizer_path, is_generation,
        preferred_sampling_params, weight_version) and pyserve's own."""
        mc = self.model_runner.model_config
        return {
            "model_path": self.model_path,
            "tokenizer_path": os.path.abspath(self.server_args.tokenizer_path or self.model_path),
            "is_generation": self.is_generation,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "served_model_name": self.model_name,
            "architecture": mc.architecture,
            "architectures": [mc.architecture],
            "context_length": self.context_len,
            "vocab_size": mc.vocab_size,
        }

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's /get_server_info shape: the server args, the scheduler's figures
        (max_total_num_tokens, max_req_input_len), `internal_states` (one entry per data-parallel
        rank: here one) and version, plus pyserve's live KV figures and `cache_hit_rate` (the
        /metrics gauge: cached over prompt tokens of the ended requests; None with
        --disable-metrics)."""
        kv = self.kv_cache
        sched = self.scheduler
        metrics = sched.state.metrics
        info: dict[str, Any] = dict(vars(self.server_args))
        info.pop("api_key")  # a secret: never reported
        info.update(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_name,  # SGLang's one name (ServerArgs holds vLLM's list)
                "context_length": self.context_len,
                "max_total_tokens": kv.max_total_tokens,
                "max_total_num_tokens": kv.max_total_tokens,
                "max_req_input_len": min(self.context_len, kv.max_total_tokens) - 1,
                "status": "ready",
                "internal_states": [self._internal_state()],
                "version": version(),
                "device": self.model_runner.device,
                "kv_free_slots": kv.free_slots(),
                "kv_total_slots": kv.max_total_tokens,
                "kv_evictable_slots": kv.evictable_slots(),
                "kv_protected_slots": kv.protected_slots(),
                "kv_cache_bytes": self.model_runner.kv_cache_bytes,
                "num_running_reqs": len(sched.running),
                "num_paused_reqs": sched.num_paused(),
                "num_waiting_reqs": len(sched.waiting),
                "num_inflight_steps": len(sched.inflight),
                "num_req_rows_used": kv.num_reqs(),
                "num_sampling_rows_live": self.worker.num_live_sampling_rows,
                "num_grammar_rows_live": self.worker.num_live_grammar_rows,
                "num_grammar_queue_reqs": len(sched.grammar_queue),
                "num_generated_tokens": sched.num_generated_tokens,
                "cache_hit_rate": None
                if metrics is None
                else (metrics.cached_tokens / metrics.prompt_tokens if metrics.prompt_tokens else 0.0),
            }
        )
        return info

    def serving_figures(self) -> ServingFigures | None:
        """What /metrics reports now; None when request metrics are off (--enable-metrics)."""
        sched = self.scheduler
        metrics = sched.state.metrics
        if metrics is None:
            return None
        kv = self.kv_cache
        total, cached = kv.max_total_tokens, kv.evictable_slots()
        backend = self.grammar_backend
        return ServingFigures(
            requests=metrics,
            generated_tokens=sched.num_generated_tokens,
            retractions=sched.retractor.num_retracted,
            running=len(sched.running),
            waiting=len(sched.waiting),
            grammar_waiting=len(sched.grammar_queue),
            kv_total=total,
            kv_used=total - kv.free_slots() - cached,
            kv_cached=cached,
            gen_throughput=sched.last_gen_throughput,
            grammar_compile_time=None if backend is None else backend.compile_time,
            expert_load=self.model_runner.expert_load(),
        )

    def start_expert_distribution_record(self) -> None:
        """SGLang's /start_expert_distribution_record: count each MoE layer's routing per
        expert from now (from zero). Raises InvalidRequestError for a dense model."""
        self._expert_load().start()

    def stop_expert_distribution_record(self) -> None:
        """SGLang's /stop_expert_distribution_record: stop counting (the counts stay)."""
        self._expert_load().stop()

    def dump_expert_distribution_record(self) -> dict[str, Any]:
        """The counts recorded: `logical_count` [sparse layers][experts] (tokens routed to
        each expert, a token once per expert it went to), `layers` (their decoder layer
        indices), `recording`. Raises InvalidRequestError for a dense model."""
        load = self._expert_load()
        return {"logical_count": load.recorded.tolist(), "layers": list(load.layers), "recording": load.recording}

    def _expert_load(self) -> ExpertLoad:
        load = self.model_runner.expert_load()
        if load is None:
            raise InvalidRequestError(
                f"the served model ({self.model_runner.model_config.architecture}) has no experts to record"
            )
        return load

    def ready_facts(self) -> tuple[str, str, int, int]:
        """(device, dtype name, KV cache tokens, KV cache bytes): what the ready line says."""
        runner = self.model_runner
        dtype = str(runner.dtype).removeprefix("torch.")
        return runner.device, dtype, self.kv_cache.max_total_tokens, runner.kv_cache_bytes

    def get_load(self) -> list[dict[str, Any]]:
        """SGLang's /get_load: one entry per data-parallel rank (here one) with the requests
        running and waiting and `num_tokens`, the load the router's policies compare: KV slots held
        by running requests plus the prompt tokens of waiting ones (as SGLang counts)."""
        sched = self.scheduler
        return [
            {
                "dp_rank": 0,
                "num_reqs": len(sched.running) + len(sched.waiting),
                "num_waiting_reqs": len(sched.waiting),
                "num_tokens": sched.load(),
            }
        ]

    def _internal_state(self) -> dict[str, Any]:
        """What SGLang's scheduler reports per rank and its clients read (bench_serving reads
        `avg_spec_accept_length`, absent without speculative decoding)."""
        kv = self.kv_cache
        sched = self.scheduler
        runner = self.model_runner
        return {
            "attention_backend": runner.attention_backend_name,
            "page_size": kv.page_size,
            "last_gen_throughput": sched.last_gen_throughput,
            "memory_usage": {
                "weight": round(runner.weight_bytes / 2**30, 2),
                "kvcache": round(runner.kv_cache_bytes / 2**30, 2),
                "token_capacity": kv.max_total_tokens,
                "graph": round(runner.info.cuda_graph_bytes / 2**30, 2),
            },
            "load": sched.load(),
        }


def version() -> str:
    """pyserve's installed version ("0.0.0+local" when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("pyserve")
    except PackageNotFoundError:
        return "0.0.0+local"
