"""Two pyserve replicas on stories260k behind SGLang's own router (sglang-router 0.3.2, from
the client venv) with the cache_aware, round_robin and power_of_two policies: native
/generate (stream and not), chat and completions through the router give what a replica
gives directly; with cache_aware each shared-prefix group stays on one replica (its
cached_tokens show the reuse) while the groups spread over both; `pyserve bench serve
--backend pyserve` through the router runs a generated-shared-prefix workload with no failure
and reports the cached tokens; the replicas log no "Invalid HTTP request"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, free_port, start_server
from tests.e2e.text_exact import _sse

POOL = 4096
OUTPUT_LEN = 48  # long enough that a round's two requests are in flight together
TEMPLATE = REPO / "tests" / "data" / "stories_chat_template.jinja"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, stories_path):
    servers = []
    try:
        for i in range(2):
            servers.append(
                start_server(
                    tmp_path_factory,
                    f"replica{i}",
                    [
                        "--model-path",
                        str(stories_path),
                        "--max-total-tokens",
                        str(POOL),
                        "--chat-template",
                        str(TEMPLATE),
                        "--log-level",
                        "debug",
                    ],
                )
            )  # debug: access log too
        yield servers
        for srv in servers:
            log = srv.log()
            assert "Invalid HTTP request" not in log
            assert "Traceback" not in log
    finally:
        for srv in servers:
            srv.stop()


class Router:
    def __init__(self, python: Path, workers: list, policy: str, log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        self.log_path = log_path
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [
                str(python),
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--worker-urls",
                *[w.base_url for w in workers],
                "--policy",
                policy,
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=log_path.parent,
            env=env,
        )
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, log_path.read_text()[-3000:]
            try:
                r = httpx.post(
                    self.base_url + "/generate",
                    timeout=10,
                    json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
                )
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def _generated(replicas) -> list[int]:
    return [httpx.get(r.base_url + "/get_server_info").json()["num_generated_tokens"] for r in replicas]


def _wait_idle(replicas) -> None:
    deadline = time.monotonic() + 30
    for r in replicas:
        while True:
            info = httpx.get(r.base_url + "/get_server_info").json()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_protected_slots"] == 0:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)


def _check_routes(router: Router, direct: str) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 8}
    want = httpx.post(direct + "/generate", json={"text": "Once upon a time", "sampling_params": greedy}).json()
    for model in (None, "stories260k"):
        body = {"text": "Once upon a time", "sampling_params": greedy} | ({"model": model} if model else {})
        r = httpx.post(router.base_url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == want["output_ids"] and r.json()["text"] == want["text"]
    events = _sse(
        router.base_url + "/generate",
        {"text": "Once upon a time", "stream": True, "model": "stories260k", "sampling_params": greedy},
    )
    assert events[-1]["text"] == want["text"]
    body = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    r = httpx.post(router.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want["text"]
    chunks = _sse(router.base_url + "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want["text"]
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = {"model": "stories260k", "messages": messages, "max_tokens": 8, "temperature": 0}
    direct_chat = httpx.post(direct + "/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    r = httpx.post(router.base_url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == direct_chat
    chunks = _sse(router.base_url + "/v1/chat/completions", {**chat, "stream": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == direct_chat


GROUPS = [
    "Lily had a red ball. She liked to play with it in the park every day with her friend Tom. " * 3,
    "Zed the big dog ran to the river. He saw a fish jump out of the water and he barked loudly. " * 3,
]


def _send_rounds(router: Router, rounds: int) -> dict[int, list[int]]:
    """`rounds` rounds of one request per group, the groups' requests of a round in flight
    together; returns each group's cached_tokens, round by round."""
    cached: dict[int, list[int]] = {g: [] for g in range(len(GROUPS))}
    for k in range(rounds):
        results: dict[int, httpx.Response] = {}

        def send(g: int, k: int = k, results: dict[int, httpx.Response] = results) -> None:
            results[g] = httpx.post(
                router.base_url + "/generate",
                timeout=60,
                json={
                    "text": GROUPS[g] + f"Question {k}: what happened next?",
                    "sampling_params": {"max_new_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True},
                },
            )

        threads = [threading.Thread(target=send, args=(g,)) for g in range(len(GROUPS))]
        for t in threads:
            t.start()
            time.sleep(0.02)  # a fixed order, and both in flight together
        for t in threads:
            t.join()
        for g, r in sorted(results.items()):
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["completion_tokens"] == OUTPUT_LEN
            cached[g].append(r.json()["meta_info"]["cached_tokens"])
    return cached


def _holders(replicas, prefix: str) -> list[int]:
    """Which replicas have `prefix` cached (asked once each, directly: a miss caches it)."""
    found = []
    for i, r in enumerate(replicas):
        out = httpx.post(
            r.base_url + "/generate", timeout=60, json={"text": prefix, "sampling_params": {"max_new_tokens": 0}}
        ).json()
        if out["meta_info"]["cached_tokens"] >= out["meta_info"]["prompt_tokens"] - 2:
            found.append(i)
    return found


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "power_of_two"])
def test_router_policies(replicas, client_python, tmp_path, policy):  # noqa: F811
    router = Router(client_python, replicas, policy, tmp_path / "router.log")
    try:
        _check_routes(router, replicas[0].base_url)
        _wait_idle(replicas)
        for r in replicas:  # every group starts cold on both replicas
            assert httpx.post(r.base_url + "/flush_cache").status_code == 200
        before = _generated(replicas)
        cached = _send_rounds(router, rounds=4)
        served = [a - b for a, b in zip(_generated(replicas), before)]
        assert sum(served) == 8 * OUTPUT_LEN
        _wait_idle(replicas)
        if policy == "cache_aware":
            # each group stays on one replica, the two groups on different ones...
            holders = [_holders(replicas, prefix) for prefix in GROUPS]
            assert sorted(holders) == [[0], [1]], holders
            # ...so every request after a group's first finds the shared prefix cached
            for g in (0, 1):
                assert cached[g][0] == 0 and all(c >= 90 for c in cached[g][1:]), cached
        else:
            assert all(n > 0 for n in served), served  # both replicas take requests
    finally:
        router.stop()


def test_pyserve_bench_through_the_router(replicas, client_python, stories_path, tmp_path):  # noqa: F811
    router = Router(client_python, replicas, "cache_aware", tmp_path / "router.log")
    try:
        out = tmp_path / "bench.jsonl"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pyserve",
                "bench",
                "serve",
                "--backend",
                "pyserve",
                "--base-url",
                router.base_url,
                "--tokenizer",
                str(stories_path),
                "--dataset-name",
                "generated-shared-prefix",
                "--gsp-num-groups",
                "2",
                "--gsp-prompts-per-group",
                "6",
                "--gsp-system-prompt-len",
                "96",
                "--gsp-question-len",
                "8",
                "--gsp-output-len",
                "8",
                "--max-concurrency",
                "4",
                "--output-file",
                str(out),
                "--disable-tqdm",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        m = json.loads(out.read_text())["metrics"]
        assert (m["completed"], m["failed"]) == (12, 0)
        assert m["total_cached_tokens"] > 0
        assert "cached input tokens" in proc.stdout
    finally:
        router.stop()
