"""`GrammarBackend`: compiles a request's grammar (json_schema, regex, ebnf, structural_tag) with
the xgrammar library on executor threads, never on the loop, and caches the result by
(kind, text), failures included, so a repeated schema or a repeated bad one costs nothing.

The compiled grammar (`xgrammar.CompiledGrammar`, host data) travels to the worker in the
request's sampling row; the worker makes the request's matcher from it (DESIGN.md section 1).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pyserve.constrained.schema_check import unenforced_keyword
from pyserve.metrics import GRAMMAR_BUCKETS, Histogram

logger = logging.getLogger(__name__)

# SGLang's marker for "any JSON value" in json_schema
ANY_JSON = "$$ANY$$"
# compiled grammars (and failures) kept; the oldest is dropped past this many
CACHE_ENTRIES = 1024
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:line: "; the reason follows
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] [^:]+:\d+: ")
# ... and its assertion failures with "Check failed: (cond) is false: "
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: ")


class GrammarError(ValueError):
    """A grammar xgrammar refused. `kind` is the request field it came from (json_schema,
    regex, ebnf or structural_tag); the message quotes the compiler's reason."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: invalid {_NOUNS[kind]}: {reason}")
        self.kind = kind


_NOUNS = {
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "ebnf": "grammar",
    "structural_tag": "structural tag",
}


class GrammarBackend:
    """Compiles grammars for one tokenizer's vocabulary.

    tokenizer: the served model's HF tokenizer; vocab_size: the model's logits width (at least
    the tokenizer's; the extra ids are never allowed); stop_token_ids: the model's EOS ids (a
    finished grammar allows only these). any_whitespace: JSON schemas allow any whitespace
    between tokens (False: compact JSON, `--constrained-json-disable-any-whitespace`).
    max_workers: executor threads (xgrammar compiles in C++ without the GIL).

    `compile(kind, text)` is called on the loop thread and returns at once; `cache_hits` counts
    the compiles answered from the cache (tests read it); `compile_time` is a Histogram of
    each compile's seconds (read it under no lock: a scrape may be one compile behind).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: list[int],
        any_whitespace: bool = True,
        max_workers: int | None = None,
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        # our cache keeps failures too and bounds its size; xgrammar's own would keep neither
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._any_whitespace = any_whitespace
        workers = max_workers or max(1, min(4, (os.cpu_count() or 1) // 2))
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="pyserve-grammar")
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # (the cache is touched on the loop only; the lock is cheap insurance)
        self.cache_hits = 0
        # seconds each compile took on its thread (/metrics); written under _time_lock
        self.compile_time = Histogram(GRAMMAR_BUCKETS)
        self._time_lock = threading.Lock()

    def compile(self, kind: str, text: str) -> concurrent.futures.Future[xgr.CompiledGrammar]:
        """A future of the compiled grammar of `text` (kind: json_schema, regex, ebnf or
        structural_tag); it fails with GrammarError for a grammar xgrammar refuses. Returns at
        once: a new grammar compiles on an executor thread. Loop thread."""
        key = (kind, text)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return cached
            future = self._executor.submit(self._compile, kind, text)
            self._cache[key] = future
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return future

    def started(self, kind: str, text: str) -> bool:
        """Whether the compile of (kind, text) has begun on a thread, or ended (False while it
        waits behind others). Loop thread."""
        future = self._cache.get((kind, text))
        return future is not None and (future.running() or future.done())

    def release(self, kind: str, text: str) -> None:
        """No request waits for (kind, text) any more: a compile that has not begun is dropped
        (cancelled, and forgotten by the cache), so abandoned grammars do not hold up the
        next ones. Loop thread."""
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and future.cancel():
                del self._cache[key]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        """Executor thread. Raises GrammarError."""
        start = time.perf_counter()
        try:
            return self._compile_now(kind, text)
        finally:
            with self._time_lock:
                self.compile_time.observe(time.perf_counter() - start)

    def _compile_now(self, kind: str, text: str) -> xgr.CompiledGrammar:
        compiler = self._compiler
        try:
            if kind == "json_schema":
                if text == ANY_JSON:
                    return compiler.compile_builtin_json_grammar()
                _check_enforceable(text)
                return compiler.compile_json_schema(text, any_whitespace=self._any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text, root_rule_name="root")
            if kind == "structural_tag":
                return self._compile_structural_tag(text)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError and its own types
            raise GrammarError(kind, reason_of(exc)) from None
        raise GrammarError(kind, f"unknown grammar kind {kind!r}")

    def _compile_structural_tag(self, text: str) -> xgr.CompiledGrammar:
        """SGLang's form ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}) or
        xgrammar's own ({"type": "structural_tag", "format": {...}})."""
        try:
            spec: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarError("structural_tag", f"not JSON: {exc}") from None
        for schema in _tag_schemas(spec):
            found = unenforced_keyword(schema)
            if found is not None:
                raise GrammarError("structural_tag", f"xgrammar cannot enforce {found}")
        if isinstance(spec, dict) and "structures" in spec:
            try:
                tags = [
                    xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                    for s in spec["structures"]
                ]
                triggers = list(spec["triggers"])
            except (KeyError, TypeError) as exc:
                raise GrammarError(
                    "structural_tag", f"each structure needs begin, schema and end, and triggers a list ({exc!r})"
                ) from None
            return self._compiler.compile_structural_tag(tags, triggers)
        return self._compiler.compile_structural_tag(text)


def _tag_schemas(node: Any) -> Iterator[Any]:
    """The JSON schemas inside a structural tag: each SGLang structure's `schema`, and in
    xgrammar's form every `{"type": "json_schema", "json_schema": ...}` format, however deep."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield node["json_schema"]
        structures = node.get("structures")
        if isinstance(structures, list):
            yield from (s["schema"] for s in structures if isinstance(s, dict) and "schema" in s)
        for key, value in node.items():
            if key not in ("json_schema", "structures"):
                yield from _tag_schemas(value)
    elif isinstance(node, list):
        for item in node:
            yield from _tag_schemas(item)


def _check_enforceable(text: str) -> None:
    """Raise GrammarError for a schema using a keyword xgrammar would silently ignore (text
    that is not JSON is left to xgrammar's own message)."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError:
        return
    found = unenforced_keyword(schema)
    if found is not None:
        raise GrammarError("json_schema", f"xgrammar cannot enforce {found}")


def reason_of(exc: BaseException) -> str:
    """xgrammar's message without its log prefix (time, source file and line)."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text.splitlines()[0]))


def grammar_stop_ids(eos_token_ids: Iterable[int], tokenizer: Any) -> list[int]:
    """The ids that end a grammar: the model config's EOS ids, else the tokenizer's EOS id,
    else none (then grammars cannot end and the server takes none)."""
    ids = sorted(int(t) for t in eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids if ids or eos is None else [int(eos)]


def serving_grammar_backend(
    tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int], any_whitespace: bool
) -> GrammarBackend | None:
    """The grammar compiler a server of this tokenizer's model uses, or None (logged) when the
    model names no EOS token: a grammar ends only by allowing EOS, so every grammar request
    would be refused. Reads the whole vocabulary: run it off the loop thread."""
    stop_ids = grammar_stop_ids(eos_token_ids, tokenizer)
    if not stop_ids:
        logger.warning("the model names no EOS token: structured output is off")
        return None
    return GrammarBackend(tokenizer, vocab_size, stop_ids, any_whitespace=any_whitespace)
