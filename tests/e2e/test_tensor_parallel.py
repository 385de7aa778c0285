"""Tensor parallelism on CPU (gloo), end to end through the server: `--tp-size 2` gives the same
greedy tokens as `--tp-size 1` for 16 prompts x 48 tokens, with overlap on and off and with
chunked prefill, on stories260k (8 heads, 4 KV heads: both split) and on a tiny seeded Qwen2
with one KV head (fewer KV heads than ranks: replicated); the log-probabilities of 16 fixed
tokens at every step (the logits less their logsumexp) agree within 1e-4. Each server's KV
pool is whole again afterwards. A rank killed during a stream ends it with an error event,
`/health` turns 503 and the server exits within 10 s, its log naming the dead rank once. A tiny
Qwen2-MoE with its experts split in width (`--tp-size 2`) and whole (`--ep-size 2`) gives one
rank's tokens and log-probabilities."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import ServerProcess, start_server, wait_idle

POOL = 4096
NUM_PROMPTS, NEW_TOKENS = 16, 48
PROBE_IDS = list(range(3, 500, 31))  # 16 ids whose log-probabilities every step reports
CHUNK = 24  # --chunked-prefill-size: the longer prompts go in two or three chunks


@pytest.fixture(scope="module")
def qwen2_gqa_path(tmp_path_factory, stories_path) -> Path:
    """A tiny random Qwen2 (seeded): 4 query heads, ONE KV head, q/k/v biases, tied
    embeddings, stories260k's 512-token vocabulary and tokenizer."""
    import transformers

    folder = tmp_path_factory.mktemp("qwen2-gqa")
    config = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(7)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_path / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def qwen2_moe_path(tmp_path_factory, stories_path) -> Path:
    """A tiny random Qwen2-MoE (seeded): 8 experts of 32, top 2, a shared expert of 48, layer 1
    dense; stories260k's 512-token vocabulary and tokenizer."""
    import transformers

    folder = tmp_path_factory.mktemp("qwen2-moe")
    config = transformers.Qwen2MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(11)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_path / name, folder / name)
    return folder


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[1, *rng.integers(3, 512, size=int(n)).tolist()] for n in rng.integers(4, 3 * CHUNK, size=NUM_PROMPTS)]


def _run(server: ServerProcess) -> list[tuple[list[int], np.ndarray]]:
    """The 16 prompts at once: each one's output ids and [tokens, 16] probe log-probabilities."""

    def one(ids: list[int]) -> tuple[list[int], np.ndarray]:
        body = {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            "return_logprob": True,
            "token_ids_logprob": PROBE_IDS,
        }
        r = httpx.post(server.base_url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        probes = out["meta_info"]["output_token_ids_logprobs"]
        table = np.array([[entry[0] for entry in step] for step in probes])
        assert [[entry[1] for entry in step] for step in probes][0] == PROBE_IDS
        return out["output_ids"], table

    with cf.ThreadPoolExecutor(NUM_PROMPTS) as pool:
        return list(pool.map(one, _prompts()))


def _serve_and_run(tmp_path_factory, model: Path, name: str, extra: list[str]):
    server = start_server(
        tmp_path_factory,
        name,
        ["--model-path", str(model), "--max-total-tokens", str(POOL), "--chunked-prefill-size", str(CHUNK), *extra],
    )
    try:
        results = _run(server)
        info = wait_idle(server.base_url)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == info["kv_total_slots"] == POOL
        return results
    finally:
        server.stop()


@pytest.mark.parametrize("model", ["stories", "qwen2_gqa"])
def test_tp2_equals_tp1(tmp_path_factory, stories_path, request, model):
    path = stories_path if model == "stories" else request.getfixturevalue("qwen2_gqa_path")
    reference = _serve_and_run(tmp_path_factory, path, f"{model}-tp1", [])
    for overlap in ([], ["--disable-overlap-schedule"]):
        results = _serve_and_run(tmp_path_factory, path, f"{model}-tp2", ["--tp-size", "2", *overlap])
        for (ids, probes), (ref_ids, ref_probes) in zip(results, reference):
            assert ids == ref_ids
            assert probes.shape == ref_probes.shape == (NEW_TOKENS, len(PROBE_IDS))
            np.testing.assert_allclose(probes, ref_probes, rtol=0, atol=1e-4)
    # the tiny model is not degenerate: its greedy outputs differ between prompts
    assert len({tuple(ids) for ids, _ in reference}) > NUM_PROMPTS // 2


def test_moe_tp2_and_ep2_equal_tp1(tmp_path_factory, qwen2_moe_path):
    """A mixture of experts over two gloo ranks: experts split in width (--tp-size 2) and
    whole (--ep-size 2) give one rank's greedy tokens and its probe log-probabilities."""
    reference = _serve_and_run(tmp_path_factory, qwen2_moe_path, "moe-tp1", [])
    for extra in (["--tp-size", "2"], ["--tp-size", "2", "--ep-size", "2"]):
        results = _serve_and_run(tmp_path_factory, qwen2_moe_path, "moe-" + "-".join(extra), extra)
        for (ids, probes), (ref_ids, ref_probes) in zip(results, reference):
            assert ids == ref_ids
            np.testing.assert_allclose(probes, ref_probes, rtol=0, atol=1e-4)
    assert len({tuple(ids) for ids, _ in reference}) > NUM_PROMPTS // 2


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_killed_rank_fails_cleanly(tmp_path, stories_path):
    server = ServerProcess(
        ["--model-path", str(stories_path), "--max-total-tokens", str(POOL), "--tp-size", "2"], tmp_path / "server.log"
    )
    try:
        server.wait_ready()
        (rank1,) = _children(server.proc.pid)
        body = {
            "text": "Once upon a time",
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True},
        }
        lines = []
        with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as r:
            stream = r.iter_lines()
            lines.append(next(stream))
            os.kill(rank1, signal.SIGKILL)
            killed = time.monotonic()
            lines += [line for line in stream if line]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == 500 and "rank 1" in error["message"], error
        health = httpx.get(server.base_url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert f"rank 1 (pid {rank1}) died (signal SIGKILL)" in health.json()["message"]
        assert server.proc.wait(timeout=10) == 1
        assert time.monotonic() - killed < 10
        log = server.log()
        assert len(re.findall(r"ERROR .*tensor-parallel rank 1 \(pid \d+\) died", log)) == 1, log
        assert "Traceback" not in log, log
    finally:
        server.stop()


def test_model_that_does_not_split_is_refused(tmp_path, stories_path):
    server = ServerProcess(["--model-path", str(stories_path), "--tp-size", "3"], tmp_path / "server.log")
    try:
        assert server.proc.wait(timeout=120) == 2  # refused from its config.json, before any rank starts
        assert "--tp-size 3 does not divide the model's 8 attention heads" in server.log()
        assert not _children(server.proc.pid)
    finally:
        server.stop()
