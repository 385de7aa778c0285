"""`GrammarBackend`: compiles a request's grammar (`GrammarKey`: json_schema, regex, ebnf or
structural_tag, with the thinking allowed before it) with the server's grammar library
(`--grammar-backend`: xgrammar or llguidance) on executor threads, never on the loop, and
caches the result by key, failures included, so a repeated schema or a repeated bad one costs
nothing.

The compiled grammar (host data, with `new_matcher()`) travels to the worker in the request's
sampling row; the worker makes the request's matcher from it (DESIGN.md section 1).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Protocol

from pyserve.constrained.errors import GrammarError
from pyserve.constrained.spec import GrammarKey, JsonWhitespace
from pyserve.metrics import GRAMMAR_BUCKETS, Histogram

logger = logging.getLogger(__name__)

# compiled grammars (and failures) kept; the oldest is dropped past this many
CACHE_ENTRIES = 1024
# the --grammar-backend names (SGLang's), and none: no structured output
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")


class GrammarCompiler(Protocol):
    """A grammar library's compiler (XGrammarCompiler, LLGuidanceCompiler): `compile(key)`
    runs on an executor thread, returns a compiled grammar (`new_matcher()`, `new_ops()`)
    and raises GrammarError."""

    name: str

    def compile(self, key: GrammarKey) -> Any: ...


class GrammarBackend:
    """Compiles grammars with `compiler` on `max_workers` executor threads (both libraries
    compile in native code without the GIL).

    `compile(kind, text)` is called on the loop thread and returns at once; `cache_hits` counts
    the compiles answered from the cache (tests read it); `compile_time` is a Histogram of
    each compile's seconds (read it under no lock: a scrape may be one compile behind).
    """

    def __init__(self, compiler: GrammarCompiler, max_workers: int | None = None) -> None:
        self.compiler = compiler
        workers = max_workers or max(1, min(4, (os.cpu_count() or 1) // 2))
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="pyserve-grammar")
        self._cache: OrderedDict[GrammarKey, concurrent.futures.Future[Any]] = OrderedDict()
        self._lock = threading.Lock()  # (the cache is touched on the loop only; the lock is cheap insurance)
        self.cache_hits = 0
        # seconds each compile took on its thread (/metrics); written under _time_lock
        self.compile_time = Histogram(GRAMMAR_BUCKETS)
        self._time_lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.compiler.name

    def compile(self, key: GrammarKey) -> concurrent.futures.Future[Any]:
        """A future of the compiled grammar of `key`; it fails with GrammarError for a grammar
        the library refuses. Returns at once: a new grammar compiles on an executor thread.
        Loop thread."""
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return cached
            future = self._executor.submit(self._compile, key)
            self._cache[key] = future
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return future

    def started(self, key: GrammarKey) -> bool:
        """Whether the compile of `key` has begun on a thread, or ended (False while it waits
        behind others). Loop thread."""
        future = self._cache.get(key)
        return future is not None and (future.running() or future.done())

    def release(self, key: GrammarKey) -> None:
        """No request waits for `key` any more: a compile that has not begun is dropped
        (cancelled, and forgotten by the cache), so abandoned grammars do not hold up the
        next ones. Loop thread."""
        with self._lock:
            future = self._cache.get(key)
            if future is not None and future.cancel():
                del self._cache[key]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: GrammarKey) -> Any:
        """Executor thread. Raises GrammarError."""
        start = time.perf_counter()
        try:
            return self.compiler.compile(key)
        except GrammarError:
            raise
        except Exception as exc:  # a library's own error escaped its compiler's mapping
            raise GrammarError(key.kind, f"{type(exc).__name__}: {exc}") from None
        finally:
            with self._time_lock:
                self.compile_time.observe(time.perf_counter() - start)


def grammar_stop_ids(eos_token_ids: Iterable[int], tokenizer: Any) -> list[int]:
    """The ids that end a grammar: the model config's EOS ids, else the tokenizer's EOS id,
    else none (then grammars cannot end and the server takes none)."""
    ids = sorted(int(t) for t in eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids if ids or eos is None else [int(eos)]


def serving_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], whitespace: JsonWhitespace
) -> GrammarBackend | None:
    """The grammar backend `name` (xgrammar or llguidance) for this tokenizer's model, or None
    (logged) when the model names no EOS token: a grammar ends only by allowing EOS, so every
    grammar request would be refused. Reads the whole vocabulary: run it off the loop thread.
    Raises ValueError for an unknown name."""
    stop_ids = grammar_stop_ids(eos_token_ids, tokenizer)
    if not stop_ids:
        logger.warning("the model names no EOS token: structured output is off")
        return None
    compiler: GrammarCompiler
    if name == "xgrammar":
        from pyserve.constrained.xgrammar_compiler import XGrammarCompiler

        compiler = XGrammarCompiler(tokenizer, vocab_size, stop_ids, whitespace)
    elif name == "llguidance":
        from pyserve.constrained.llguidance_compiler import LLGuidanceCompiler

        compiler = LLGuidanceCompiler(tokenizer, vocab_size, stop_ids, whitespace)
    else:
        raise ValueError(f"unknown grammar backend {name!r}: {', '.join(GRAMMAR_BACKENDS[:2])}")
    return GrammarBackend(compiler)
