"""Shutting the engine down while requests stream: every open request ends with a "server
shutting down" abort (its stream closes, nothing hangs), on the real worker over the
simulated device, with overlap scheduling on and off."""

from __future__ import annotations

import asyncio

import pytest

from pyserve.config import ServerArgs
from pyserve.engine.engine_core import EngineCore
from pyserve.io_struct import GenerateReqInput
from pyserve.model_executor.simulated_runner import SimulatedRunner
from pyserve.model_loader.tokenizer import get_tokenizer


@pytest.mark.parametrize("overlap", [True, False])
def test_shutdown_mid_generation_ends_every_stream(stories_path, overlap):
    async def body() -> list:
        tok = get_tokenizer(str(stories_path))
        runner = SimulatedRunner(len(tok), {tok.eos_token_id}, 600, 256, decode_base_ms=2.0, seed=1)
        args = ServerArgs(
            model_path=str(stories_path),
            max_running_requests=6,
            max_total_tokens=600,
            disable_overlap_schedule=not overlap,
            stats_interval_s=3600.0,
            log_level="warning",
        )
        core = EngineCore(args, model_runner=runner)
        await core.start()

        async def one(i: int):
            req = GenerateReqInput(
                text="once upon a time", rid=f"r{i}", stream=True, sampling_params={"max_new_tokens": 200}
            )
            return [out async for out in core.generate(req.split()[0])]

        tasks = [asyncio.ensure_future(one(i)) for i in range(8)]  # 6 run, 2 wait
        while runner.num_steps < 5:
            await asyncio.sleep(0.005)
        await core.shutdown()
        done, pending = await asyncio.wait(tasks, timeout=10)
        assert not pending
        return [t.result() for t in tasks]

    for outs in asyncio.run(body()):
        reason = outs[-1].finish_reason
        assert reason is not None and reason.is_abort and "shutting down" in reason.message
