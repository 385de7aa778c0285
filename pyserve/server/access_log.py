"""The access log: one line per HTTP request on the `pyserve.access` logger, written when its
response ended (a stream: once its last chunk was sent, or its client left):

    POST /generate 200 153.2 ms prompt_tokens=5 completion_tokens=16 rid=9f0c...
    POST /v1/chat/completions 400 0.7 ms rid=- error: messages: Field required

At info, except the routes that probes and scrapers poll (`QUIET_PATHS`: debug);
`--disable-log-requests` turns the lines off. Token counts and the request id come from the
request's `AccessRecord`, which the generating routes fill with their final outputs
(`note_outputs`; the stream hub for streams): no work per token. An error response's message is
read back from its own body (every error response is an OpenAI-style error object), so each
route's 4xx says why without the routes logging anything. `rid=-`: the request failed before
it had one.

The middleware is the app's outermost (outside Starlette's ServerErrorMiddleware), so it sees
the status of a 500 too. Loop thread only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterable
from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pyserve.io_struct import GenerateOutput

logger = logging.getLogger("pyserve.access")

# the key of a request's AccessRecord in its ASGI scope's "state" (Starlette's request.state)
RECORD_KEY = "pyserve_access"
MAX_MESSAGE_CHARS = 300  # of an error's message in its access line
# polled by health probes, routers, Prometheus and the playground's status panel every few
# seconds: their lines are debug
QUIET_PATHS = frozenset({"/health", "/health_generate", "/metrics", "/get_load", "/get_server_info"})
# an error object's bytes kept for its message (render.error_body clips one to about 1.3 kB)
MAX_ERROR_BODY_BYTES = 4096


class AccessRecord:
    """What the access line of one request reports beyond its method and path: `status` (None
    until the response starts), `rid` (the first output's request id), the prompt and
    completion tokens of its outputs (None: it generated nothing), the start of an error
    response's body, and whether the response was sent whole (`complete`)."""

    __slots__ = ("start", "status", "rid", "prompt_tokens", "completion_tokens", "error_body", "complete")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.status: int | None = None
        self.rid: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.error_body = b""
        self.complete = False

    def add_output(self, out: GenerateOutput) -> None:
        """Count a final output: its completion tokens, and its prompt's tokens once (the n > 1
        samples of a prompt share it, as the API's usage counts them)."""
        if self.rid is None:
            self.rid = out.rid
        if out.index is None or out.index == 0:
            self.prompt_tokens = (self.prompt_tokens or 0) + out.prompt_tokens
        self.completion_tokens = (self.completion_tokens or 0) + len(out.output_ids)


def access_record(scope: Scope) -> AccessRecord | None:
    """The AccessRecord of the request of `scope` (None outside the middleware)."""
    state = scope.get("state")
    return None if state is None else state.get(RECORD_KEY)


def note_outputs(scope: Scope, outs: Iterable[GenerateOutput]) -> None:
    """Count the final outputs of a whole (non-streamed) response in its access line."""
    record = access_record(scope)
    if record is not None:
        for out in outs:
            record.add_output(out)


class AccessLogMiddleware:
    """Pure ASGI middleware (a stream's body passes through untouched: the stream hub's socket
    writer sends past it, see socket_writer.PASS_THROUGH_SEND_MODULES) that keeps an
    AccessRecord per HTTP request and logs its line at the response's end when `log_requests`.

    An exception that reaches it after its 500 response went out whole (ServerErrorMiddleware
    answered it, and errors.handle_internal_error logged its traceback) ends here, so the
    ASGI server does not log the same traceback again; any other propagates."""

    def __init__(self, app: ASGIApp, log_requests: bool = True) -> None:
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord()
        state = scope.get("state")
        if state is None:
            state = scope["state"] = {}
        state[RECORD_KEY] = record

        # (named so: the socket writer finds the server's `send` in this closure's `send`)
        async def access_send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                record.status = message["status"]
            elif kind == "http.response.body":
                if record.status is not None and record.status >= 400 and len(record.error_body) < MAX_ERROR_BODY_BYTES:
                    record.error_body += message.get("body", b"")
                if not message.get("more_body", False):
                    record.complete = True
            await send(message)

        try:
            await self.app(scope, receive, access_send)
        except Exception:
            if self.log_requests:
                self._log(scope, record)
            if record.complete:
                return
            raise
        if self.log_requests:
            self._log(scope, record)

    @staticmethod
    def _log(scope: Scope, record: AccessRecord) -> None:
        path = scope.get("path", "")
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        if logger.isEnabledFor(level):
            logger.log(level, "%s", access_line(scope.get("method", ""), path, record))


def access_line(method: str, path: str, record: AccessRecord) -> str:
    """The access line of a finished request (see the module docstring)."""
    latency_ms = (time.perf_counter() - record.start) * 1000.0
    status = "-" if record.status is None else str(record.status)
    # quoted as it came on the wire: the server unquotes the path, and a %0A in it would
    # otherwise start a forged log line
    line = f"{method} {quote(path, safe='/:@!$&()*+,;=-._~')} {status} {latency_ms:.1f} ms"
    if record.prompt_tokens is not None:
        line += f" prompt_tokens={record.prompt_tokens} completion_tokens={record.completion_tokens}"
    line += f" rid={record.rid or '-'}"
    if record.status is None:
        line += " (no response: the client left)"
    elif record.status >= 400:
        line += f" error: {error_message(record.error_body)}"
    elif not record.complete:
        line += " (cut short: the client left or the server stopped)"
    return line


def error_message(body: bytes) -> str:
    """The message of an error response's body: its OpenAI-style error object's, else the
    body's own text (one line)."""
    text = body.decode("utf-8", "replace")
    with contextlib.suppress(ValueError, TypeError, KeyError):  # not an error object: its text
        message = json.loads(body)["error"]["message"]
        if isinstance(message, str):
            text = message
    # one line whatever the client sent: messages quote request text (an unknown field's name)
    return " ".join(text.split())[:MAX_MESSAGE_CHARS] or "(no body)"
