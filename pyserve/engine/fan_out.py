"""`FanOutMixin`: EngineCore's request entry points and their fan-out into the requests it runs.

A request with `n > 1` becomes a prefill-only request (its prompt's KV into the radix cache)
and n samples (parallel_sampling.py holds the per-request pieces: rids, seeds, expand, merge);
a batch (`generate_all`) becomes its prompts run concurrently. The mixin also records which
rids each request's rid stands for (`_derived`), so aborting it reaches them all. Loop thread
only, like the rest of EngineCore.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, cast

from pyserve.engine import parallel_sampling
from pyserve.errors import InvalidRequestError
from pyserve.io_struct import GenerateOutput, SingleReq, TokenizedGenerateReq

if TYPE_CHECKING:
    from pyserve.config import ServerArgs
    from pyserve.engine.tokenizer_manager import TokenizerManager


class FanOutMixin:
    """generate / generate_all and the n > 1 fan-out; EngineCore sets the attributes below."""

    server_args: ServerArgs
    started: bool
    tokenizer_manager: TokenizerManager
    # rid -> the rids running for it (a batch's prompts, n > 1 samples and their prefill)
    _derived: dict[str, set[str]]

    def generate(self, req: SingleReq) -> AsyncGenerator[GenerateOutput, None]:
        """Outputs of one request (all chunks if req.stream, else the final one); with
        sampling_params.n > 1 those of its n samples as they come, each with its `index`
        (one final output per sample). Raises InvalidRequestError at the first step when
        the request is invalid; closing the iterator aborts what still runs."""
        if not self.started:
            raise RuntimeError("the engine is not running")
        if req.sampling_params.n == 1:
            return self.tokenizer_manager.generate(req)
        return self._generate_samples(req)

    async def _generate_samples(self, req: SingleReq) -> AsyncGenerator[GenerateOutput, None]:
        treq = await self.tokenizer_manager.tokenize(req)
        self._check_free_rids(req)
        samples = parallel_sampling.expand(req, treq)
        added = self._derive([req])
        try:
            if not await self._prefill_once([(req, treq)]):
                for i, (_, t) in enumerate(samples):
                    yield parallel_sampling.aborted_output(t, i)
                return
            merged = parallel_sampling.merge([self.tokenizer_manager.generate(r, t) for r, t in samples])
            try:
                async for out in merged:
                    yield out
            finally:
                await merged.aclose()  # type: ignore[attr-defined]
        finally:
            self._underive(added)

    def _derive(self, reqs: list[SingleReq]) -> list[tuple[str, str]]:
        """Record which rids each request's rid (and its parent's) stands for: its n > 1
        samples and their prefill, or itself under its batch's rid. Returns the (parent,
        child) pairs added, for `_underive`; a pair already there (a duplicate) is not."""
        added = []
        for req in reqs:
            n = req.sampling_params.n
            children = parallel_sampling.derived_rids(req.rid, n) if n > 1 else []
            pairs = [(req.rid, c) for c in children]
            if req.parent_rid is not None:
                pairs += [(req.parent_rid, c) for c in [req.rid, *children]]
            for parent, child in pairs:
                kids = self._derived.setdefault(parent, set())
                if child not in kids:
                    kids.add(child)
                    added.append((parent, child))
        return added

    def _underive(self, added: list[tuple[str, str]]) -> None:
        for parent, child in added:
            kids = self._derived.get(parent)
            if kids is not None:
                kids.discard(child)
                if not kids:
                    del self._derived[parent]

    async def generate_all(self, reqs: list[SingleReq]) -> list[GenerateOutput]:
        """Final outputs of several non-streamed requests, run concurrently, in order; a
        request with n > 1 gives its n samples' outputs in a row (prompt-major, `index` set).
        Validates every request before starting any (InvalidRequestError; also for more than
        `--max-prompts-per-request` requests)."""
        limit = self.server_args.max_prompts_per_request
        if len(reqs) > limit:
            raise InvalidRequestError(
                f"{len(reqs)} prompts in one request; at most {limit} are allowed (--max-prompts-per-request)",
                param="input" if reqs and reqs[0].embed else "prompt",
            )
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            raise InvalidRequestError("the rids of a batch must be unique", param="rid")
        # all at once, so their texts are encoded in one batched call; the first error by
        # position is the one raised
        results = await asyncio.gather(*(self.tokenizer_manager.tokenize(r) for r in reqs), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        tokenized = cast(list[TokenizedGenerateReq], results)
        for r in reqs:
            self._check_free_rids(r)
        added = self._derive(reqs)
        try:
            parallel = [(r, t) for r, t in zip(reqs, tokenized) if r.sampling_params.n > 1]
            prefilled = await self._prefill_once(parallel)
            pairs: list[tuple[SingleReq, TokenizedGenerateReq]] = []
            indices: list[int | None] = []  # each output's sample index (None: n = 1)
            for r, t in zip(reqs, tokenized):
                pairs += parallel_sampling.expand(r, t)
                n = r.sampling_params.n
                indices += list(range(n)) if n > 1 else [None]
            if not prefilled:  # aborted while the prompts were prefilled
                return [parallel_sampling.aborted_output(t, i) for (_, t), i in zip(pairs, indices)]
            outs = await self._run_final(pairs)
        finally:
            self._underive(added)
        for out, i in zip(outs, indices):
            out.index = i
        return outs

    def _check_free_rids(self, req: SingleReq) -> None:
        """InvalidRequestError if a rid the request's n > 1 samples would take is in use."""
        if req.sampling_params.n == 1:
            return
        states = self.tokenizer_manager.states
        for rid in parallel_sampling.derived_rids(req.rid, req.sampling_params.n):
            if rid in states:
                raise InvalidRequestError(f"a request with rid {req.rid!r} is already running", param="rid")

    async def _prefill_once(self, pairs: list[tuple[SingleReq, TokenizedGenerateReq]]) -> bool:
        """Run each prompt once with max_new_tokens 0 so its KV is cached for its samples
        (nothing to share without the radix cache). False if a prefill was aborted
        (/abort_request): its samples must not start."""
        if not pairs or self.server_args.disable_radix_cache:
            return True
        outs = await self._run_final([parallel_sampling.prefill_only(r, t) for r, t in pairs])
        return all(o.finish_reason is None or not o.finish_reason.is_abort for o in outs)

    async def _run_final(self, pairs: list[tuple[SingleReq, TokenizedGenerateReq]]) -> list[GenerateOutput]:
        async def final(r: SingleReq, t: TokenizedGenerateReq) -> GenerateOutput:
            # not streamed: generate yields exactly one, finished, output
            return [out async for out in self.tokenizer_manager.generate(r, t)][-1]

        tasks = [asyncio.ensure_future(final(r, t)) for r, t in pairs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:  # one failed or we were cancelled: abort the others too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
