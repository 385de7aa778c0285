"""`GrammarQueue`: the scheduler's queue of requests whose grammar (structured output) is still
compiling (DESIGN.md sections 1 and 3).

A request with a grammar enters here instead of the waiting queue. Its grammar compiles on the
backend's executor threads; when the compiled grammar (or the compiler's refusal) arrives, a
loop callback admits the request to the waiting queue (or fails it with a 400 naming the
field). Nothing else waits: other requests keep being admitted and decoded meanwhile, and no
one polls. A grammar not ready within `timeout_s` fails its request; an abort or a client
disconnect takes the request out (`remove`). Loop thread only (the compile-done callback hops
to the loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, NamedTuple

from pyserve.constrained import GrammarBackend, GrammarKey
from pyserve.engine.schedule_batch import Req
from pyserve.forward_batch_info import SHUTTING_DOWN_MESSAGE, EndCause, FinishReason


class _Queued(NamedTuple):
    req: Req
    grammar: GrammarKey
    timer: asyncio.TimerHandle  # its timeout


class GrammarQueue:
    """Requests waiting for their grammar, by rid.

    backend: compiles grammars (None: the server takes none, `--grammar-backend none`; the
    tokenizer manager refuses such requests before they get here). admit(req): the request's
    grammar is in req.grammar, it may be scheduled. end(req, reason): it ends with `reason`
    (EndCause.GRAMMAR_REFUSED with `param` naming the grammar field; STOPPED when the
    backend shut down).
    """

    def __init__(
        self,
        backend: GrammarBackend | None,
        timeout_s: float,
        admit: Callable[[Req], None],
        end: Callable[[Req, FinishReason], None],
    ) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self._admit = admit
        self._end = end
        self._reqs: dict[str, _Queued] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._reqs

    def add(self, req: Req, key: GrammarKey) -> None:
        """Compile the request's grammar (key.kind: a SamplingParams grammar field) and admit
        or fail it when done: at once when the grammar (or its failure) is cached."""
        assert self.backend is not None  # refused upstream without a backend
        kind = key.kind
        future = self.backend.compile(key)
        if future.done():
            self._settle(req, kind, future)
            return
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.timeout_s, self._time_out, req, key)
        self._reqs[req.rid] = _Queued(req, key, timer)
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(self._compiled, req, kind, f))

    def remove(self, rid: str) -> Req | None:
        """Take a request out (aborted, client gone); None when it is not here. A grammar no
        other queued request waits for stops compiling if it has not begun."""
        entry = self._reqs.get(rid)
        req = self._take(rid)
        if entry is not None and self.backend is not None:
            if all(e.grammar != entry.grammar for e in self._reqs.values()):
                self.backend.release(entry.grammar)
        return req

    def _take(self, rid: str) -> Req | None:
        entry = self._reqs.pop(rid, None)
        if entry is None:
            return None
        entry.timer.cancel()
        return entry.req

    def take_all(self) -> list[Req]:
        """Every queued request, taken out (shutdown)."""
        reqs = [self.remove(rid) for rid in list(self._reqs)]
        return [r for r in reqs if r is not None]

    def _compiled(self, req: Req, kind: str, future: concurrent.futures.Future[Any]) -> None:
        entry = self._reqs.get(req.rid)
        if entry is None or entry.req is not req:  # aborted or timed out meanwhile
            return
        self._take(req.rid)
        self._settle(req, kind, future)

    def _settle(self, req: Req, kind: str, future: concurrent.futures.Future[Any]) -> None:
        if future.cancelled():  # the backend shut down
            self._end(req, FinishReason.abort(EndCause.STOPPED, SHUTTING_DOWN_MESSAGE))
            return
        exc = future.exception()
        if exc is not None:
            self._end(req, FinishReason.abort(EndCause.GRAMMAR_REFUSED, str(exc), param=kind))
            return
        req.grammar = future.result()
        self._admit(req)

    def _time_out(self, req: Req, key: GrammarKey) -> None:
        entry = self._reqs.get(req.rid)
        if entry is None or entry.req is not req:
            return
        assert self.backend is not None
        kind = key.kind
        if not self.backend.started(key):
            # still behind other grammars on the compile threads: the limit is for this
            # grammar's own compile, which has not begun
            loop = asyncio.get_running_loop()
            self._reqs[req.rid] = entry._replace(timer=loop.call_later(self.timeout_s, self._time_out, req, key))
            return
        self._take(req.rid)
        message = (
            f"{kind}: the grammar did not compile within {self.timeout_s:g} s (--grammar-compile-timeout-s); "
            "simplify it or ask the operator to raise the limit"
        )
        self._end(req, FinishReason.abort(EndCause.GRAMMAR_REFUSED, message, param=kind))
