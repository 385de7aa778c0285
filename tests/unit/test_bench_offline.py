"""`pyserve bench offline` (in-process Engine) and `pyserve bench one-batch` (ModelRunner +
KVCache) on stories260k: exact token totals, one result line per case, one-line errors."""

from __future__ import annotations

import json

from pyserve.bench.cli import main as bench_main


def test_offline_throughput(stories_path, tmp_path, capsys) -> None:
    out = tmp_path / "offline.jsonl"
    rc = bench_main(
        [
            "offline",
            "--model-path",
            str(stories_path),
            "--max-total-tokens",
            "2048",
            "--num-prompts",
            "6",
            "--random-input-len",
            "24",
            "--random-output-len",
            "5",
            "--random-range-ratio",
            "1",
            "--log-level",
            "warning",
            "--max-prompts-per-request",  # a server's guard: the bench's one batch call is not refused
            "2",
            "--output-file",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert result["kind"] == "offline" and result["token_count_source"] == "engine"
    # 24 drawn tokens + the BOS the engine adds, per prompt
    assert (m["num_requests"], m["total_input_tokens"], m["total_output_tokens"]) == (6, 6 * 25, 6 * 5)
    assert m["output_throughput"] == m["total_output_tokens"] / m["duration_s"]
    assert "total input / output tokens      150 / 30" in capsys.readouterr().out


def test_offline_workload_too_long(stories_path, capsys) -> None:
    rc = bench_main(
        [
            "offline",
            "--model-path",
            str(stories_path),
            "--max-total-tokens",
            "2048",
            "--context-length",
            "64",
            "--num-prompts",
            "1",
            "--random-input-len",
            "100",
            "--random-range-ratio",
            "1",
            "--log-level",
            "warning",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert err[0].startswith("pyserve bench offline: error: the workload does not fit the model: ")


def test_one_batch(stories_path, tmp_path, capsys) -> None:
    out = tmp_path / "one.jsonl"
    rc = bench_main(
        [
            "one-batch",
            "--model-path",
            str(stories_path),
            "--batch-size",
            "1",
            "3",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--output-file",
            str(out),
        ]
    )
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["batch_size"], r["input_len"], r["output_len"]) for r in lines] == [(1, 16, 4), (3, 16, 4)]
    for r in lines:
        assert r["prefill_throughput"] == r["batch_size"] * 16 / (r["prefill_latency_ms"] / 1000)
        assert r["median_decode_throughput"] == r["batch_size"] / (r["median_decode_latency_ms"] / 1000)
    assert len(capsys.readouterr().out.splitlines()) == 4  # title, header, one line per case
    rc = bench_main(["one-batch", "--model-path", str(stories_path), "--input-len", "510", "--output-len", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err == [
        "pyserve bench one-batch: error: --input-len 510 + --output-len 4 exceeds the context length 512"
    ]
