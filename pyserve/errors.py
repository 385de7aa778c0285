"""pyserve's exception hierarchy, in one place.

* `PyserveError`: base of the errors raised by pyserve's Python code.
  * `InvalidRequestError`: the client sent a request pyserve cannot serve (HTTP 400).
    * `QueueFullError`: the waiting queue is full (`--max-queued-requests`; HTTP 503).
    * `ModelLoadingError`: the server is up but its model is still loading (HTTP 503).
    * `ServerDrainingError`: the server is shutting down and takes no new request (HTTP 503).
  * `ModelStepError`: a model step failed while the request ran (HTTP 500 or an SSE error
    event); the server and the other requests carry on.
* `CoreError` (from the Rust core, `pyserve._rs`): a caller broke a contract of the KV
  bookkeeping; a pyserve bug, never the client's fault. Subclasses:
  `UnknownRequestError` (unknown request id, req_pool_idx or radix node id),
  `DuplicateRequestError` (a request id twice in one batch), `DoubleFreeError`,
  `ShapeError` (bad array: mismatched lengths, wrong dtype or dimensions, index out of range),
  `InvariantError` (lock underflow, inconsistent bookkeeping found by `check_integrity`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyserve._rs import (
    CoreError,
    DoubleFreeError,
    DuplicateRequestError,
    InvariantError,
    ShapeError,
    UnknownRequestError,
)

if TYPE_CHECKING:
    from pyserve.forward_batch_info import EndCause


class PyserveError(Exception):
    """Base class of errors raised by pyserve's Python code. `end_cause`: set (an EndCause)
    on the error a request's end stands for (pyserve.engine.end_cause.end_error); the
    server answers such an error with its cause's status and code (server/errors.py)."""

    end_cause: EndCause | None = None


class InvalidRequestError(PyserveError, ValueError):
    """A request pyserve cannot serve; the server answers `status` (400 unless stated, 404 for
    an unknown model) with an OpenAI-style error body.

    `param` names the offending field (dotted path) if known; `code` is a machine-readable
    reason such as "context_length_exceeded" or "model_not_found".
    """

    def __init__(
        self, message: str, param: str | None = None, code: str | int | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


class QueueFullError(InvalidRequestError):
    """The waiting queue already holds `--max-queued-requests` requests: this one is refused
    (HTTP 503, code "queue_full"); retrying later may succeed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="queue_full", status=503)


class ModelLoadingError(InvalidRequestError):
    """The server answers while its model loads (`pyserve serve`): a request that needs the
    model is refused (HTTP 503, code "model_loading"); retrying later succeeds."""

    def __init__(self) -> None:
        super().__init__("the model is still loading; retry shortly", code="model_loading", status=503)


class ServerDrainingError(InvalidRequestError):
    """The server is draining (SIGTERM / SIGINT): a new request is refused (HTTP 503, code
    "server_shutting_down"); another replica may take it."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down", code="server_shutting_down", status=503)


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than `--max-request-body-bytes` (HTTP 413, code
    "request_too_large"); it was refused while it arrived, before any of it was parsed."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
            code="request_too_large",
            status=413,
        )


class ModelStepError(PyserveError, RuntimeError):
    """A model step failed (a pyserve or device fault, not the client's) while the request
    ran; the request was ended and its KV freed."""


__all__ = [
    "PyserveError",
    "InvalidRequestError",
    "QueueFullError",
    "ModelLoadingError",
    "ServerDrainingError",
    "ModelStepError",
    "CoreError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "DoubleFreeError",
    "ShapeError",
    "InvariantError",
]
