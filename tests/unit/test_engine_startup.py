"""What an embedding program sees of Engine's start: its keyword arguments in its signature,
the same start-up lines as `pyserve serve` on stderr, and at the defaults a KV pool that
runs 64 clients of 256 + 256 tokens without a retraction."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

from pyserve import Engine
from pyserve.config import ServerArgs
from tests.conftest import REPO


def test_the_signature_lists_every_server_arg():
    params = inspect.signature(Engine).parameters
    fields = dataclasses.fields(ServerArgs)
    assert list(params) == ["server_args"] + [f.name for f in fields]
    for f in fields:
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["max_running_requests"].default == 64 and params["allowed_methods"].default == ["*"]


def test_an_engine_logs_its_start_up_lines(stories_path):
    code = f"from pyserve import Engine\nEngine(model_path={str(stories_path)!r}, max_total_tokens=512).shutdown()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "INFO pyserve.engine.engine_core: model stories260k (LlamaForCausalLM) loaded" in proc.stderr
    assert "INFO pyserve.engine.engine_core: KV pool: 512 tokens" in proc.stderr


def test_the_default_pool_runs_64_clients_of_256_plus_256_without_retraction(stories_path):
    engine = Engine(model_path=str(stories_path), log_level="warning")  # every other flag at its default
    try:
        core = engine.core
        assert core.kv_cache.max_total_tokens == 64 * 512  # max_running_requests x context
        prompts = [[1] + [(7 * i + c) % 500 + 3 for i in range(255)] for c in range(64)]  # none shared
        outs = engine.generate(
            input_ids=prompts,
            sampling_params=[{"max_new_tokens": 256, "ignore_eos": True, "temperature": 0}] * 64,
        )
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [256] * 64
        assert core.scheduler.retractor.num_retracted == 0
    finally:
        engine.shutdown()
