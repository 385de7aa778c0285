"""`GET /metrics`: Prometheus text through prometheus-client, in SGLang's names (`sglang:*`, a
`model_name` label), so SGLang's Grafana dashboards and alerts read a pyserve server.

Nothing here runs per token: the engine keeps plain counts (pyserve/metrics.py) and
`EngineCollector` turns them into metric families when Prometheus scrapes. The app's registry
also holds prometheus-client's process collector (`process_resident_memory_bytes`, CPU
seconds, open files). Loop thread (the scrape runs in the route handler).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pyserve.metrics import Histogram
from pyserve.server.context import context_of

if TYPE_CHECKING:
    from pyserve.engine.engine_core import EngineCore


class EngineCollector(Collector):
    """The engine's figures as metric families, each with the label model_name:

    counters  sglang:prompt_tokens_total, sglang:generation_tokens_total,
              sglang:cached_tokens_total, sglang:num_requests_total (label finish_reason:
              stop, length, abort), sglang:num_retractions_total
    histograms (seconds) sglang:time_to_first_token_seconds,
              sglang:inter_token_latency_seconds, sglang:e2e_request_latency_seconds,
              sglang:queue_time_seconds, sglang:grammar_compilation_time_seconds
    gauges    sglang:num_running_reqs, sglang:num_queue_reqs, sglang:num_grammar_queue_reqs,
              sglang:num_used_tokens and sglang:token_usage (KV held by requests, without the
              evictable prefix cache; the fraction of the pool), sglang:num_cached_tokens
              (evictable), sglang:max_total_num_tokens, sglang:cache_hit_rate (cached over
              prompt tokens of the ended requests), sglang:gen_throughput (output tokens/s
              over the last stats interval)

    Token and request counts are those of ended requests (as their responses' meta_info
    reports them), except generation tokens: every token the engine sampled."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        figures = engine.serving_figures()
        if figures is None:
            return
        metrics = figures.requests
        name = [engine.model_name]
        labels = ["model_name"]

        def counter(key: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"sglang:{key}", doc, labels=labels)
            family.add_metric(name, value)
            return family

        def gauge(key: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"sglang:{key}", doc, labels=labels)
            family.add_metric(name, value)
            return family

        def histogram(key: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
            family = HistogramMetricFamily(f"sglang:{key}", doc, labels=labels)
            family.add_metric(name, hist.cumulative(), hist.sum)
            return family

        yield counter("prompt_tokens", "Prompt tokens of ended requests.", metrics.prompt_tokens)
        yield counter("generation_tokens", "Output tokens sampled.", figures.generated_tokens)
        yield counter("cached_tokens", "Prompt tokens of ended requests found in the prefix cache.",
                      metrics.cached_tokens)  # fmt: skip
        requests = CounterMetricFamily(
            "sglang:num_requests", "Ended requests by finish reason.", labels=[*labels, "finish_reason"]
        )
        for kind, count in metrics.finished.items():
            requests.add_metric([*name, kind], count)
        yield requests
        yield counter("num_retractions", "Requests sent back to wait because the KV pool was full.",
                      figures.retractions)  # fmt: skip
        yield histogram("time_to_first_token_seconds", "Time to first token in seconds.", metrics.ttft)
        yield histogram("inter_token_latency_seconds", "Time between output tokens in seconds.", metrics.itl)
        yield histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.", metrics.e2e_latency)
        yield histogram("queue_time_seconds", "Time in the waiting queue in seconds.", metrics.queue_time)
        if figures.grammar_compile_time is not None:
            yield histogram(
                "grammar_compilation_time_seconds", "Grammar compile time in seconds.", figures.grammar_compile_time
            )
        total, used, cached = figures.kv_total, figures.kv_used, figures.kv_cached
        yield gauge("num_running_reqs", "Requests admitted and running.", figures.running)
        yield gauge("num_queue_reqs", "Requests waiting for admission.", figures.waiting)
        yield gauge("num_grammar_queue_reqs", "Requests waiting for their grammar to compile.", figures.grammar_waiting)
        yield gauge("num_used_tokens", "KV tokens held by requests.", used)
        yield gauge("num_cached_tokens", "KV tokens of evictable cached prefixes.", cached)
        yield gauge("max_total_num_tokens", "KV pool size in tokens.", total)
        yield gauge("token_usage", "Fraction of the KV pool held by requests.", used / total)
        hit_rate = metrics.cached_tokens / metrics.prompt_tokens if metrics.prompt_tokens else 0.0
        yield gauge("cache_hit_rate", "Cached over prompt tokens of ended requests.", hit_rate)
        yield gauge("gen_throughput", "Output tokens per second over the last stats interval.",
                    figures.gen_throughput)  # fmt: skip
        load = figures.expert_load
        if load is not None:
            experts = CounterMetricFamily(
                "pyserve:moe_expert_tokens",
                "Tokens routed to each expert of each MoE layer (a token once per expert it goes to).",
                labels=[*labels, "layer", "expert"],
            )
            for row, layer in enumerate(load.layers):
                for expert, count in enumerate(load.total[row].tolist()):
                    experts.add_metric([*name, str(layer), str(expert)], count)
            yield experts


async def metrics(request: Request) -> Response:
    """GET /metrics: the Prometheus text exposition (prometheus-client's latest). While the model loads,
    only the process metrics."""
    ctx = context_of(request)
    registry: CollectorRegistry | None = ctx.metrics_registry
    if registry is None:
        registry = ctx.metrics_registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=registry)
    engine = ctx.engine
    if engine is not None and ctx.metrics_engine is not engine:
        registry.register(EngineCollector(engine))
        ctx.metrics_engine = engine
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


ROUTES = [Route("/metrics", metrics, methods=["GET"])]
