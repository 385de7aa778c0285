"""HTTP clients of the bench tool: one streamed request to a target, timed chunk by chunk.

Backends: `pyserve` (native POST /generate, SGLang's shape), `openai` (POST /v1/completions),
`openai-chat` (POST /v1/chat/completions) and `openai-embeddings` (POST /v1/embeddings: the
prompt as `input`, one whole response, no output tokens; its figures are requests/s, input
tokens/s and the end-to-end latency); SGLang bench_serving's names map onto them
(`SGLANG_BACKENDS`: sglang -> pyserve, vllm -> openai, ...). Every generation request streams (SSE) unless
`--disable-stream` asks for whole responses, asks for greedy sampling (temperature 0) and,
unless told otherwise, `ignore_eos` so outputs have the requested length; streamed OpenAI
requests ask for `stream_options.include_usage`.

A `RawResult` keeps what arrived: per SSE event its arrival time, its text delta and, when the
server says so (pyserve's native stream reports the cumulative `completion_tokens`), its
token count. Turning that into token counts is pyserve.bench.serve's job, after the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

BACKENDS = ("pyserve", "openai", "openai-chat", "openai-embeddings")
# SGLang bench_serving's --backend names (its ASYNC_REQUEST_FUNCS, 0.5.2) -> the API each
# speaks; its trt, gserver and truss clients speak APIs pyserve's bench does not
SGLANG_BACKENDS = {
    "sglang": "pyserve",
    "sglang-native": "pyserve",
    "sglang-oai": "openai",
    "sglang-oai-chat": "openai-chat",
    "vllm": "openai",
    "vllm-chat": "openai-chat",
    "lmdeploy": "openai",
    "lmdeploy-chat": "openai-chat",
}


def resolve_backend(name: str) -> str:
    """The backend of BACKENDS that `name` (one of them or of SGLANG_BACKENDS) speaks.
    Raises ValueError for any other name."""
    if name in BACKENDS:
        return name
    if name in SGLANG_BACKENDS:
        return SGLANG_BACKENDS[name]
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join((*BACKENDS, *SGLANG_BACKENDS))}")


# how long a stream's end (after its [DONE] event) is waited for before its connection is let go
DRAIN_TIMEOUT_S = 5.0


@dataclass
class RawChunk:
    """One SSE event that added output: arrival time (perf_counter s), the text it added, and
    the number of tokens it added when the server reports it (else None)."""

    time_s: float
    text: str
    num_tokens: int | None = None


@dataclass
class RawResult:
    """What one request returned. usage: (prompt_tokens, completion_tokens) if reported;
    cached_tokens: prompt tokens the server found in its prefix cache, if it says (pyserve's
    and SGLang's meta_info, OpenAI's usage.prompt_tokens_details)."""

    start_s: float
    end_s: float = 0.0
    chunks: list[RawChunk] = field(default_factory=list)
    usage: tuple[int, int] | None = None
    cached_tokens: int | None = None
    error: str | None = None
    error_detail: str = ""

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)


@dataclass
class RequestSpec:
    """Everything a backend needs to send one request."""

    prompt: str
    output_len: int
    model: str | None
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    stream: bool = True


def request_url_and_body(backend: str, base_url: str, spec: RequestSpec) -> tuple[str, dict[str, Any]]:
    """The URL and JSON body of `spec` for `backend`."""
    if backend == "openai-embeddings":
        return base_url + "/v1/embeddings", {"model": spec.model, "input": spec.prompt, **spec.extra_body}
    if backend == "pyserve":
        body: dict[str, Any] = {
            "text": spec.prompt,
            "stream": spec.stream,
            "sampling_params": {"max_new_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": spec.ignore_eos},
        }
        body["sampling_params"].update(spec.extra_body)
        return base_url + "/generate", body
    body = {"model": spec.model, "max_tokens": spec.output_len, "temperature": 0.0, "stream": spec.stream}
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if backend == "openai":
        body["prompt"] = spec.prompt
        path = "/v1/completions"
    else:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        path = "/v1/chat/completions"
    body.update(spec.extra_body)
    return base_url + path, body


class _StreamState:
    """Folds SSE events of one backend into a RawResult."""

    def __init__(self, backend: str, result: RawResult) -> None:
        self.backend = backend
        self.result = result
        self.prev_text = ""
        self.prev_tokens = 0

    def add(self, event: dict[str, Any], now: float) -> None:
        if "error" in event:
            err = event["error"]
            raise _StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if self.backend == "pyserve":
            text, meta = event["text"], event["meta_info"]
            n = int(meta["completion_tokens"])
            if n > self.prev_tokens:
                self.result.chunks.append(RawChunk(now, text[len(self.prev_text) :], n - self.prev_tokens))
            self.prev_text, self.prev_tokens = text, max(n, self.prev_tokens)
            self.result.usage = (int(meta["prompt_tokens"]), n)
            if meta.get("cached_tokens") is not None:
                self.result.cached_tokens = int(meta["cached_tokens"])
            return
        usage = event.get("usage")
        if usage:
            self.result.usage = (int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                self.result.cached_tokens = int(cached)
        for choice in event.get("choices") or []:
            if self.backend == "openai":
                delta = choice.get("text") or ""
            else:
                delta = (choice.get("delta") or {}).get("content") or ""
            if delta:
                self.result.chunks.append(RawChunk(now, delta))

    def add_whole(self, body: dict[str, Any], now: float) -> None:
        """A non-streamed response, as one event carrying everything."""
        if self.backend == "openai-embeddings":  # vectors, no output token
            if not body.get("data"):
                raise _StreamError("the response holds no embedding")
            prompt_tokens = int((body.get("usage") or {}).get("prompt_tokens", 0))
            self.result.usage = (prompt_tokens, 0)
            return
        if self.backend == "pyserve":
            self.add(body, now)
            return
        choice = body["choices"][0]
        text = choice.get("text") if self.backend == "openai" else choice["message"]["content"]
        usage = body.get("usage") or {}
        self.add({"choices": [], "usage": usage}, now)
        if text:
            self.result.chunks.append(RawChunk(now, text, int(usage.get("completion_tokens", 0)) or None))


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The payloads of the `data:` lines of an SSE body, as they arrive (whatever chunks the
    network cut it into; LF or CRLF line ends). Reads what is there at each wake-up rather than
    a line at a time: the client shares the machine with the server it measures."""
    pending = b""
    async for piece in content.iter_any():
        lines = (pending + piece).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


class _StreamError(Exception):
    """The server broke off or garbled a stream (counted as a `stream_error` failure)."""


async def send_request(
    session: aiohttp.ClientSession, backend: str, base_url: str, spec: RequestSpec, headers: dict[str, str]
) -> RawResult:
    """Send `spec`, read its SSE stream to the end; never raises for request failures (they
    become RawResult.error: "http_<status>", "connection", "timeout", "stream_error",
    "bad_response")."""
    url, body = request_url_and_body(backend, base_url, spec)
    result = RawResult(start_s=time.perf_counter())
    state = _StreamState(backend, result)
    done_at: float | None = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"http_{resp.status}"
                result.error_detail = (await resp.text())[:300]
                return result
            if not spec.stream or backend == "openai-embeddings":  # one whole response: one chunk
                state.add_whole(orjson.loads(await resp.read()), time.perf_counter())
                return result
            async for data in _sse_data(resp.content):
                if data == b"[DONE]":
                    done_at = time.perf_counter()
                    break
                state.add(orjson.loads(data), time.perf_counter())
            if done_at is None:
                result.error, result.error_detail = "stream_error", "stream ended without [DONE]"
            else:
                # read the body to its end (what follows [DONE]: the chunked terminator), so
                # the connection goes back to the session's pool as a keep-alive client's
                # does; left half-read, aiohttp closes it and the next request connects anew
                with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
                    await asyncio.wait_for(resp.content.read(), DRAIN_TIMEOUT_S)
    except _StreamError as exc:
        result.error, result.error_detail = "stream_error", str(exc)[:300]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        result.error, result.error_detail = "bad_response", f"{type(exc).__name__}: {exc}"[:300]
    except asyncio.TimeoutError:
        result.error, result.error_detail = "timeout", "request timed out"
    except aiohttp.ClientError as exc:
        result.error, result.error_detail = "connection", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        result.end_s = done_at if done_at is not None else time.perf_counter()
    return result
