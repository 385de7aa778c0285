"""pyserve.bench workloads (random range convention, sharegpt, generated-shared-prefix, jsonl),
the summary table, the JSONL line, the plot, and one-line errors for bad flags."""

from __future__ import annotations

import fnmatch
import json
import random
import subprocess
import sys

import pytest

from pyserve.bench import datasets as ds
from pyserve.bench.cli import build_parser, check_args
from pyserve.bench.metrics import RequestRecord, compute_metrics
from pyserve.bench.report import format_table, plot_distributions, write_result
from tests.conftest import REPO, free_port


@pytest.fixture(scope="module")
def tok(stories_path):
    from pyserve.model_loader.tokenizer import get_tokenizer

    return get_tokenizer(str(stories_path))


def test_range_convention() -> None:
    lens = ds.lens_in_range(random.Random(0), 10, 0.5, 2000)
    assert min(lens) == 5 and max(lens) == 10
    assert set(ds.lens_in_range(random.Random(0), 10, 1.0, 50)) == {10}
    lens = ds.lens_in_range(random.Random(0), 10, 0.0, 2000)
    assert min(lens) == 1 and max(lens) == 10
    assert set(ds.lens_in_range(random.Random(0), 3, 0.1, 100)) == {1, 2, 3}


def test_random_dataset(tok) -> None:
    rows = ds.sample_random(tok, 6, input_len=20, output_len=8, range_ratio=1.0, seed=5)
    assert len(rows) == 6 and all(r.output_len == 8 for r in rows)
    for r in rows:
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False))
    assert [r.prompt_len for r in rows] == [20] * 6  # re-encoded texts keep the drawn length
    assert "\ufffd" not in "".join(r.prompt for r in rows)  # no lone byte-fallback tokens
    assert ds.sample_random(tok, 6, 20, 8, 1.0, seed=5) == rows
    assert ds.sample_random(tok, 6, 20, 8, 1.0, seed=6) != rows
    varied = ds.sample_random(tok, 50, 20, 8, 0.5, seed=5)
    assert {r.output_len for r in varied} == {4, 5, 6, 7, 8}


def test_sharegpt_dataset(tok, tmp_path) -> None:
    conv = lambda q, a: {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}  # noqa: E731
    data = [
        conv("Once upon a time", "there was a girl"),
        conv("Lily", "Lily went to the park"),
        conv("Lily went to the park", "Once"),
        {"conversations": [{"from": "human", "value": "solo"}]},
        conv("The sun was hot", "The dog ran and ran and ran"),
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    rows = ds.sample_sharegpt(tok, str(path), 10, seed=0)
    # "Lily" and "Once" are one token each: skipped; the one-turn item too
    assert sorted(r.prompt for r in rows) == ["Once upon a time", "The sun was hot"]
    n = {r.prompt: r for r in rows}
    assert n["Once upon a time"].output_len == len(tok.encode("there was a girl", add_special_tokens=False))
    # with a fixed output length the reply is not counted, so "Once" as a reply no longer matters
    assert [r.output_len for r in ds.sample_sharegpt(tok, str(path), 10, 0, output_len=3)] == [3, 3, 3]
    assert len(ds.sample_sharegpt(tok, str(path), 1, seed=0)) == 1
    tight = ds.sample_sharegpt(
        tok, str(path), 10, 0, context_len=n["Once upon a time"].prompt_len + n["Once upon a time"].output_len
    )
    assert [r.prompt for r in tight] == ["Once upon a time"]
    with pytest.raises(ds.DatasetError, match="No such file"):
        ds.sample_sharegpt(tok, str(tmp_path / "none.json"), 1, 0)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ds.DatasetError, match="not a JSON file"):
        ds.sample_sharegpt(tok, str(tmp_path / "bad.json"), 1, 0)


def test_generated_shared_prefix(tok) -> None:
    rows = ds.sample_generated_shared_prefix(
        tok, num_groups=3, prompts_per_group=4, system_prompt_len=30, question_len=5, output_len=7, seed=1
    )
    assert len(rows) == 12 and all(r.output_len == 7 for r in rows)
    systems = {r.prompt.split("\n")[0] for r in rows}
    assert len(systems) == 3
    for s in systems:
        assert sum(r.prompt.startswith(s + "\n") for r in rows) == 4


def test_jsonl_dataset(tok, tmp_path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "Once upon a time", "output_len": 5}\n\n{"prompt": "Lily", "output_len": 2}\n')
    rows = ds.load_jsonl(tok, str(path), 10)
    assert rows == [ds.DatasetRow("Once upon a time", 4, 5), ds.DatasetRow("Lily", 1, 2)]
    assert ds.load_jsonl(tok, str(path), 1) == rows[:1]
    path.write_text('{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(ds.DatasetError, match="line 1: prompt must be a string and output_len a positive"):
        ds.load_jsonl(tok, str(path), 10)
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ds.DatasetError, match="line 1: expected"):
        ds.load_jsonl(tok, str(path), 10)


def test_check_args_messages() -> None:
    parse = lambda *a: build_parser().parse_args(["serve", *a])  # noqa: E731
    assert check_args(parse()) is None
    assert check_args(parse("--num-prompts", "0")) == "--num-prompts: got 0; must be >= 1"
    assert check_args(parse("--random-range-ratio", "1.5")) == "--random-range-ratio: got 1.5; must be in [0, 1]"
    assert check_args(parse("--request-rate", "0")) == "--request-rate: got 0.0; must be > 0 (inf: all at once)"
    assert check_args(parse("--burstiness", "-1")) == "--burstiness: got -1.0; must be > 0"
    assert check_args(parse("--max-concurrency", "0")) == "--max-concurrency: got 0; must be >= 1"
    assert check_args(parse("--base-url", "localhost:3")) == (
        "--base-url: got 'localhost:3'; must start with http:// or https://"
    )
    assert parse("--request-rate", "inf").request_rate == float("inf")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pyserve", "bench", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, rc, message",
    [
        (
            ["serve", "--bogus"],
            2,
            "pyserve bench serve: error: unrecognized argument --bogus (see pyserve bench serve --help)",
        ),
        (
            ["serve", "--backend", "trt"],  # SGLang's TensorRT-LLM client: an API not spoken here
            2,
            "pyserve bench serve: error: argument --backend: invalid choice: "
            "'trt' (choose from *openai-chat*) (see pyserve bench serve --help)",
        ),
        (["serve", "--num-prompts", "-3"], 2, "pyserve bench serve: error: --num-prompts: got -3; must be >= 1"),
        (["nope"], 2, None),
    ],
)
def test_bad_flags_one_line(args, rc, message) -> None:
    proc = run_cli(*args)
    assert proc.returncode == rc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    if message is not None:  # '*' stands for text that varies with the Python version
        assert fnmatch.fnmatchcase(lines[0], message), lines[0]


def test_unreachable_server_one_line() -> None:
    port = free_port()  # nothing listens there
    proc = run_cli("serve", "--port", str(port), "--num-prompts", "2")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"pyserve bench serve: error: cannot reach the server at http://127.0.0.1:{port}: ")
    assert proc.stdout == ""


def synthetic_result() -> dict:
    records = [
        RequestRecord(10, 0.0, 0.3, [0.1, 0.15, 0.25], [1, 1, 2], 4),
        RequestRecord(20, 0.05, 0.5, [0.25, 0.45], [3, 1], 4),
        RequestRecord(30, 0.1, 0.2, error="http_500"),
    ]
    config = {
        "backend": "openai",
        "dataset_name": "random",
        "request_rate": float("inf"),
        "burstiness": 1.0,
        "max_concurrency": 8,
    }
    return {
        "base_url": "http://h:1",
        "model": "m",
        "tokenizer": "/t",
        "token_count_source": "usage",
        "config": config,
        "metrics": compute_metrics(records, 0.0),
    }, records


def test_table_and_jsonl(tmp_path) -> None:
    result, _ = synthetic_result()
    table = format_table(result).splitlines()
    assert "successful / failed requests     1 / 1" not in table
    expected = [
        "backend                          openai @ http://h:1",
        "tokens counted by                server usage",
        "successful / failed requests     2 / 1",
        "errors                           http_500: 1",
        "duration (s)                     0.50",
        "total input / output tokens      30 / 8",
        "request throughput (req/s)       4.00",
        "output token throughput (tok/s)  16.00",
        "mean concurrency                 1.70",
        "latency (ms)          mean      median         p90         p99   samples",
        "TTFT                150.00      150.00      190.00      199.00         2",
        "ITL                  87.50       50.00      155.00      195.50         4",
        "E2E                 375.00      375.00      435.00      448.50         2",
    ]
    for line in expected:
        assert line in table, (line, table)
    path = tmp_path / "sub" / "out.jsonl"
    write_result(str(path), result)
    write_result(str(path), result)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["metrics"]["completed"] == 2
    assert json.loads(lines[1])["config"]["request_rate"] == "inf"  # strict JSON: no Infinity


def test_plot_writes_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    _, records = synthetic_result()
    path = tmp_path / "p.png"
    plot_distributions(str(path), records, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
