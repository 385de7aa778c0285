"""/metrics: Prometheus text that prometheus_client's parser reads, in SGLang's names, whose
counters equal the engine's own counts after a known set of requests, whose histograms hold
one observation per request (or per token), and whose gauges return to idle."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.server.app import create_app
from tests.conftest import CHAT_TEMPLATE, _poll_until_idle

NUM_REQUESTS = 5


def scrape(client: TestClient) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} of one scrape."""
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    return samples[name][tuple(sorted({"model_name": "stories", **labels}.items()))]


@pytest.fixture(scope="module")
def client(stories_path):
    args = ServerArgs(
        model_path=str(stories_path),
        served_model_name="stories",
        chat_template=str(CHAT_TEMPLATE),
        max_total_tokens=2048,
        log_level="warning",
    )
    with TestClient(create_app(args)) as c:
        yield c


def test_counters_histograms_and_gauges_after_known_requests(client):
    before = scrape(client)
    assert one(before, "sglang:num_running_reqs") == 0
    outs = []
    for i in range(NUM_REQUESTS):  # the first two share a prompt: the second finds it cached
        prompt = "Once upon a time" if i < 2 else f"Lily saw {i} cats"
        body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 3 + i}}
        outs.append(client.post("/generate", json=body).json()["meta_info"])
    aborted = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 0}}).json()
    outs.append(aborted["meta_info"])
    info = _poll_until_idle(lambda: client.get("/get_server_info").json(), 30.0, 0.05)
    after = scrape(client)

    def delta(name: str, **labels: str) -> float:
        return one(after, name, **labels) - one(before, name, **labels)

    assert delta("sglang:prompt_tokens_total") == sum(o["prompt_tokens"] for o in outs)
    assert delta("sglang:cached_tokens_total") == sum(o["cached_tokens"] for o in outs)
    assert sum(o["cached_tokens"] for o in outs) > 0
    assert delta("sglang:generation_tokens_total") == sum(o["completion_tokens"] for o in outs)
    assert one(after, "sglang:generation_tokens_total") == info["num_generated_tokens"]
    assert delta("sglang:num_requests_total", finish_reason="length") == NUM_REQUESTS + 1
    assert delta("sglang:num_requests_total", finish_reason="abort") == 0
    # a histogram per request: e2e and queue time for all, TTFT for those with a token
    assert delta("sglang:e2e_request_latency_seconds_count") == NUM_REQUESTS + 1
    assert delta("sglang:queue_time_seconds_count") == NUM_REQUESTS + 1
    assert delta("sglang:time_to_first_token_seconds_count") == NUM_REQUESTS
    # inter-token gaps: every output token after each request's first
    assert delta("sglang:inter_token_latency_seconds_count") == sum(2 + i for i in range(NUM_REQUESTS))
    inf = one(after, "sglang:e2e_request_latency_seconds_bucket", le="+Inf")
    assert inf == one(after, "sglang:e2e_request_latency_seconds_count")
    assert one(after, "sglang:e2e_request_latency_seconds_sum") > 0
    # idle again: nothing runs or waits, no KV held (cached prefixes are apart)
    for gauge in ("num_running_reqs", "num_queue_reqs", "num_grammar_queue_reqs", "num_used_tokens", "token_usage"):
        assert one(after, f"sglang:{gauge}") == 0, gauge
    assert one(after, "sglang:max_total_num_tokens") == 2048
    assert one(after, "sglang:num_cached_tokens") == info["kv_evictable_slots"] > 0
    hit = one(after, "sglang:cache_hit_rate")
    assert hit == pytest.approx(one(after, "sglang:cached_tokens_total") / one(after, "sglang:prompt_tokens_total"))
    assert "process_resident_memory_bytes" in after


def test_aborted_requests_count_by_reason(client):
    before = scrape(client)
    r = client.post("/generate", json={"text": "hi", "rid": "m-abort", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200
    bad = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 0})
    assert bad.status_code == 400  # refused before it reached the engine: not a request
    # a grammar the compiler refuses ends its request in the engine: an abort
    refused = client.post("/generate", json={"text": "hi", "sampling_params": {"regex": "(", "max_new_tokens": 2}})
    assert refused.status_code == 400
    after = scrape(client)

    def delta(reason: str) -> float:
        key = (("finish_reason", reason), ("model_name", "stories"))
        return after["sglang:num_requests_total"][key] - before["sglang:num_requests_total"][key]

    assert (delta("length"), delta("abort"), delta("stop")) == (1, 1, 0)
    assert one(after, "sglang:grammar_compilation_time_seconds_count") >= 1


def test_metrics_can_be_turned_off(stories_path):
    args = ServerArgs(model_path=str(stories_path), max_total_tokens=256, log_level="warning", enable_metrics=False)
    with TestClient(create_app(args)) as c:
        assert c.get("/metrics").status_code == 404
        assert c.get("/health").status_code == 200
