"""Parallel sampling (`n > 1`): one prompt, n samples, as SGLang does it.

The prompt is first run once with `max_new_tokens: 0`, which puts its KV into the radix cache;
the n samples are then ordinary requests whose prompt is a cache hit, so the prompt is
prefilled once and only each sample's last prompt token is recomputed. Loop thread only.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from pyserve.forward_batch_info import ABORTED_MESSAGE, EndCause, FinishReason
from pyserve.io_struct import GenerateOutput, SingleReq, TokenizedGenerateReq

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive indices apart
_SEED_SPAN = 1 << 64


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request seeded with `seed`: sample 0 keeps `seed` (so
    n=1 and the first of n agree); sample i > 0 gets (seed + i * 0x9E3779B97F4A7C15) mod 2^64,
    a reproducible stream of its own (unseeded requests stay unseeded)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _GOLDEN) % _SEED_SPAN


def sample_rid(rid: str, index: int) -> str:
    return f"{rid}-{index}"


def derived_rids(rid: str, n: int) -> list[str]:
    """The rids an n > 1 request's prefill and samples run under."""
    return [f"{rid}-prefill"] + [sample_rid(rid, i) for i in range(n)]


def aborted_output(treq: TokenizedGenerateReq, index: int | None) -> GenerateOutput:
    """The final output of a sample that never started (its prefill was aborted)."""
    return GenerateOutput(
        rid=treq.rid,
        text="",
        text_delta="",
        output_ids=[],
        ids_delta=[],
        prompt_tokens=len(treq.input_ids),
        cached_tokens=0,
        finish_reason=FinishReason.abort(EndCause.ABORTED, ABORTED_MESSAGE),
        index=index,
    )


def expand(req: SingleReq, treq: TokenizedGenerateReq) -> list[tuple[SingleReq, TokenizedGenerateReq]]:
    """The req.sampling_params.n samples of one tokenized request: each n=1, its own rid
    (`{rid}-{i}`) and seed; the prompt ids are shared."""
    n = req.sampling_params.n
    out = []
    for i in range(n):
        sp = req.sampling_params.model_copy(update={"n": 1, "seed": sample_seed(req.sampling_params.seed, i)})
        rid = sample_rid(req.rid, i) if n > 1 else req.rid
        logprob = dataclasses.replace(treq.logprob)
        out.append(
            (
                dataclasses.replace(req, rid=rid, sampling_params=sp, logprob=logprob),
                dataclasses.replace(treq, rid=rid, sampling_params=sp, logprob=logprob),
            )
        )
    return out


def prefill_only(req: SingleReq, treq: TokenizedGenerateReq) -> tuple[SingleReq, TokenizedGenerateReq]:
    """A request that only prefills `treq`'s prompt (max_new_tokens 0, no logprobs, not
    streamed), caching its KV for the samples."""
    sp = req.sampling_params.model_copy(update={"n": 1, "max_new_tokens": 0, "stop": None})
    rid = f"{req.rid}-prefill"
    lp = dataclasses.replace(treq.logprob, return_logprob=False, logprob_start_len=None)
    return (
        dataclasses.replace(req, rid=rid, sampling_params=sp, stream=False, logprob=lp),
        dataclasses.replace(treq, rid=rid, sampling_params=sp, logprob=lp),
    )


async def merge(streams: list[AsyncIterator[GenerateOutput]]) -> AsyncIterator[GenerateOutput]:
    """The outputs of several streams as they come, each tagged with its stream's position
    (`index`). Raises the first error of any stream; closing it closes (aborts) them all."""
    queue: asyncio.Queue[GenerateOutput | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerateOutput]) -> None:
        try:
            async for out in stream:
                out.index = index
                queue.put_nowait(out)
        except Exception as exc:  # handed to the consumer
            queue.put_nowait(exc)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
