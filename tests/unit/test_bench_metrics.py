"""pyserve.bench figures from synthetic timestamps with known answers: TTFT, ITL with
multi-token chunks, TPOT, E2E, throughputs, mean concurrency, failures, percentiles, arrival
schedules and per-chunk token counting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pyserve.bench.backends import RawChunk, RawResult, _StreamError, _StreamState
from pyserve.bench.load import arrival_offsets_s, chunk_token_counts, resolve_count_source, to_record
from pyserve.bench.metrics import RequestRecord, compute_metrics, latency_stats

approx = lambda x: pytest.approx(x, rel=1e-12, abs=1e-9)  # noqa: E731


class WordTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(range(len(text.split())))


def two_ok_two_failed() -> list[RequestRecord]:
    return [
        # one token at 100 ms, one at 150 ms, two together at 250 ms; stream closes at 300 ms
        RequestRecord(
            prompt_len=10,
            start_s=0.0,
            end_s=0.3,
            chunk_times_s=[0.1, 0.15, 0.25],
            chunk_num_tokens=[1, 1, 2],
            output_len=4,
        ),
        # sent at 50 ms; three tokens in the first chunk at 250 ms, one more at 450 ms
        RequestRecord(
            prompt_len=20, start_s=0.05, end_s=0.5, chunk_times_s=[0.25, 0.45], chunk_num_tokens=[3, 1], output_len=4
        ),
        RequestRecord(prompt_len=30, start_s=0.1, end_s=0.2, error="http_500", error_detail="boom"),
        RequestRecord(prompt_len=40, start_s=0.0, end_s=0.1, error="connection"),
    ]


def test_per_request_figures() -> None:
    a, b, failed, _ = two_ok_two_failed()
    assert a.ttft_ms == approx(100.0)
    assert a.itl_ms() == [approx(50.0), approx(50.0), approx(50.0)]  # 100 ms gap over 2 tokens
    assert a.tpot_ms == approx(200.0 / 3)
    assert a.e2e_ms == approx(300.0)
    assert b.ttft_ms == approx(200.0)
    assert b.itl_ms() == [approx(200.0)]  # the first chunk's extra tokens are part of TTFT
    assert b.tpot_ms == approx(250.0 / 3)
    assert b.e2e_ms == approx(450.0)
    assert not failed.success and failed.ttft_ms is None and failed.itl_ms() == []
    one = RequestRecord(prompt_len=1, start_s=0.0, end_s=0.2, chunk_times_s=[0.1], chunk_num_tokens=[1], output_len=1)
    assert one.tpot_ms is None and one.itl_ms() == []
    empty = RequestRecord(prompt_len=1, start_s=0.0, end_s=0.2)
    assert empty.ttft_ms is None and empty.tpot_ms is None


def test_run_figures() -> None:
    m = compute_metrics(two_ok_two_failed(), bench_start_s=0.0)
    assert (m["num_requests"], m["completed"], m["failed"]) == (4, 2, 2)
    assert m["errors"] == {"connection": 1, "http_500": 1}
    assert m["duration_s"] == approx(0.5)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 8)
    assert m["request_throughput"] == approx(4.0)
    assert m["input_throughput"] == approx(60.0)
    assert m["output_throughput"] == approx(16.0)
    assert m["total_token_throughput"] == approx(76.0)
    assert m["mean_concurrency"] == approx((0.3 + 0.45 + 0.1 + 0.1) / 0.5)
    assert m["ttft_ms"] == {
        "mean": approx(150.0),
        "median": approx(150.0),
        "p90": approx(190.0),
        "p99": approx(199.0),
        "max": approx(200.0),
    }
    # ITL samples 50, 50, 50, 200: p90 at rank 2.7 -> 50 + 0.7 * 150
    assert m["itl_ms"] == {
        "mean": approx(87.5),
        "median": approx(50.0),
        "p90": approx(155.0),
        "p99": approx(195.5),
        "max": approx(200.0),
    }
    assert m["num_itl_samples"] == 4
    assert m["tpot_ms"]["mean"] == approx((200.0 / 3 + 250.0 / 3) / 2)
    assert m["e2e_ms"]["mean"] == approx(375.0)
    assert m["e2e_ms"]["p99"] == approx(300.0 + 0.99 * 150.0)


def test_empty_and_all_failed_runs() -> None:
    m = compute_metrics([], bench_start_s=1.0)
    assert m["completed"] == 0 and m["duration_s"] == 0.0 and m["request_throughput"] is None
    assert m["ttft_ms"] == {"mean": None, "median": None, "p90": None, "p99": None, "max": None}
    m = compute_metrics([RequestRecord(5, 1.0, 2.0, error="timeout")], bench_start_s=1.0)
    assert (m["completed"], m["failed"], m["errors"]) == (0, 1, {"timeout": 1})
    assert m["request_throughput"] == 0.0 and m["mean_concurrency"] == approx(1.0)
    assert m["e2e_ms"]["mean"] is None


def test_latency_stats_percentiles() -> None:
    s = latency_stats([float(x) for x in range(1, 11)])
    assert s == {
        "mean": approx(5.5),
        "median": approx(5.5),
        "p90": approx(9.1),
        "p99": approx(9.91),
        "max": approx(10.0),
    }
    assert latency_stats([7.0]) == {"mean": 7.0, "median": 7.0, "p90": 7.0, "p99": 7.0, "max": 7.0}


def test_arrival_offsets() -> None:
    assert arrival_offsets_s(4, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0, 0.0]
    assert arrival_offsets_s(0, 2.0, 1.0, seed=0) == []
    offsets = arrival_offsets_s(4, 2.0, 1.0, seed=3)
    gaps = np.random.default_rng(3).gamma(1.0, 0.5, size=3)
    assert offsets == [0.0] + np.cumsum(gaps).tolist()
    assert arrival_offsets_s(4, 2.0, 1.0, seed=3) == offsets  # reproducible
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):
        gaps = np.diff(arrival_offsets_s(40001, 10.0, burstiness, seed=1))
        assert gaps.mean() == pytest.approx(0.1, rel=0.05)  # mean gap = 1 / rate
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)  # gamma: cv = 1/sqrt(shape)


def test_chunk_token_counts() -> None:
    tok = WordTokenizer()
    # "Hello wor" = 2 words; "Hello world foo" = 3 (the split word is absorbed); then 5
    assert chunk_token_counts(tok, ["Hello wor", "ld foo", " bar baz"]) == [2, 1, 2]
    assert chunk_token_counts(tok, ["a", " ", "b"]) == [1, 0, 1]
    assert chunk_token_counts(tok, []) == []


def test_to_record_server_counts_and_tokenizer_counts() -> None:
    tok = WordTokenizer()
    native = RawResult(
        start_s=1.0,
        end_s=1.5,
        usage=(12, 5),
        chunks=[RawChunk(1.1, "a", 1), RawChunk(1.2, " b c", 2), RawChunk(1.4, " d e", 2)],
    )
    rec = to_record(native, dataset_prompt_len=9, source="usage", tokenizer=tok)
    assert (rec.prompt_len, rec.output_len) == (12, 5)
    assert rec.chunk_num_tokens == [1, 2, 2] and rec.chunk_times_s == [1.1, 1.2, 1.4]
    rec = to_record(native, dataset_prompt_len=9, source="tokenizer", tokenizer=tok)
    assert (rec.prompt_len, rec.output_len) == (9, 5)
    openai = RawResult(start_s=0.0, end_s=1.0, chunks=[RawChunk(0.2, "x"), RawChunk(0.3, " "), RawChunk(0.5, "y z")])
    rec = to_record(openai, dataset_prompt_len=4, source="tokenizer", tokenizer=tok)
    # " " adds no token: its chunk is dropped from the timings ("x y z" -> 3 tokens)
    assert rec.chunk_times_s == [0.2, 0.5] and rec.chunk_num_tokens == [1, 2] and rec.output_len == 3
    assert rec.itl_ms() == [approx(150.0), approx(150.0)]
    with pytest.raises(ValueError, match="no usage"):
        to_record(openai, 4, "usage", tok)
    failed = to_record(RawResult(0.0, 0.1, error="http_400", error_detail="bad"), 4, "usage", tok)
    assert (failed.error, failed.error_detail, failed.output_len) == ("http_400", "bad", 0)
    assert resolve_count_source("auto", [native, RawResult(0, 1, error="x")]) == "usage"
    assert resolve_count_source("auto", [native, openai]) == "tokenizer"
    assert resolve_count_source("tokenizer", [native]) == "tokenizer"


def test_stream_parsing() -> None:
    raw = RawResult(start_s=0.0)
    native = _StreamState("pyserve", raw)
    for t, text, n in ((0.1, "Once", 1), (0.2, "Once upon a", 3), (0.3, "Once upon a", 3)):
        native.add({"text": text, "meta_info": {"prompt_tokens": 7, "completion_tokens": n}}, t)
    assert [(c.time_s, c.text, c.num_tokens) for c in raw.chunks] == [(0.1, "Once", 1), (0.2, " upon a", 2)]
    assert raw.usage == (7, 3) and raw.text == "Once upon a"

    raw = RawResult(start_s=0.0)
    chat = _StreamState("openai-chat", raw)
    chat.add({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.1)
    chat.add({"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}], "usage": None}, 0.2)
    chat.add({"choices": [{"delta": {}, "finish_reason": "length"}]}, 0.3)
    chat.add({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}, 0.4)
    assert [(c.time_s, c.text, c.num_tokens) for c in raw.chunks] == [(0.2, "Hi", None)]
    assert raw.usage == (4, 1)

    raw = RawResult(start_s=0.0)
    completion = _StreamState("openai", raw)
    completion.add({"choices": [{"text": "a b", "finish_reason": None}]}, 0.5)
    assert raw.text == "a b" and raw.usage is None
    with pytest.raises(_StreamError, match="overloaded"):
        completion.add({"error": {"message": "overloaded"}}, 0.6)
