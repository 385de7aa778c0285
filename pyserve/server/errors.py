"""OpenAI-style error responses: {"error": {"message", "type", "param", "code"}} with a 4xx
status for anything the client sent wrong, 500 only for pyserve's own bugs."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from pyserve.errors import InvalidRequestError, ModelStepError
from pyserve.forward_batch_info import EndCause
from pyserve.server.access_log import access_record
from pyserve.server.render import SafeJSONResponse, error_body

logger = logging.getLogger(__name__)


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
) -> JSONResponse:
    """The error response of every route (see `render.error_body`: cannot fail on the
    request text it quotes)."""
    return SafeJSONResponse(error_body(message, type_, param, code), status_code=status)


def validation_message(exc: ValidationError, prefix: tuple[str, ...] = ()) -> tuple[str, str | None]:
    """A one-line message and the dotted path of the first invalid field (under `prefix`: the
    path of the object that was validated), naming no pydantic or pyserve class."""
    err = exc.errors()[0]
    loc = [*prefix, *(str(p) for p in err.get("loc", ()) if not _is_branch_name(p))]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":  # the OpenAI API's wording for unknown fields
        return f"Unrecognized request argument supplied: {param}", param
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param


def request_error(exc: ValidationError, prefix: tuple[str, ...] = ()) -> InvalidRequestError:
    """The 400 the HTTP API answers for a request that failed validation, as the exception the
    Python Engine raises: the same message and param (see `validation_message`)."""
    message, param = validation_message(exc, prefix)
    return InvalidRequestError(message, param=param)


def _is_branch_name(part: object) -> bool:
    """Whether a `loc` part is pydantic's name of a union branch or validator ('str',
    "literal['none','auto']", 'function-after[...]', 'NamedToolChoice'), not a field, key or
    index of the request."""
    if not isinstance(part, str):
        return False
    return (
        part in ("str", "int", "float", "bool", "none")
        or "[" in part
        or part.startswith(("function-", "json-or-python"))
        or part[:1].isupper()
    )


class EndHttp(NamedTuple):
    """The HTTP status and error code of a request ended with an `EndCause` (the error type
    follows from the status: `exception_response`, `sse.error_event`)."""

    status: int
    code: str | None = None


# EndCause -> HTTP, the one table: what a client gets when its request is ended with a cause
# (the engine's `end_error` says which exception the cause raises; its status and code are
# these). None: no error, the consumer gets its last output with finish reason abort. A stream
# ended by the drain's deadline gets its last chunk too (end_error with streamed=True).
END_CAUSE_HTTP: dict[EndCause, EndHttp | None] = {
    EndCause.CLIENT_GONE: None,  # nobody is listening
    EndCause.ABORTED: None,
    EndCause.STOPPED: None,
    EndCause.SHUTDOWN: EndHttp(503, "server_shutting_down"),
    EndCause.BUMPED: EndHttp(503, "queue_full"),
    EndCause.BAD_PARAMS: EndHttp(400),
    EndCause.GRAMMAR_REFUSED: EndHttp(400),
    EndCause.STEP_FAILED: EndHttp(500),
    EndCause.SERVER_FAILED: EndHttp(500),
}


def http_of(exc: InvalidRequestError) -> tuple[int, str | int | None]:
    """(status, code) of an error: END_CAUSE_HTTP's for the error a request's end stands for
    (`exc.end_cause`), else the error's own."""
    http = END_CAUSE_HTTP[exc.end_cause] if exc.end_cause is not None else None
    return (exc.status, exc.code) if http is None else (http.status, http.code)


def exception_response(exc: InvalidRequestError | ModelStepError) -> JSONResponse:
    """The error response of a request that failed before anything was sent: the request's
    own fault (its status) or a failed model step (500)."""
    if isinstance(exc, InvalidRequestError):
        status, code = http_of(exc)
        type_ = "server_error" if status >= 500 else "invalid_request_error"
        response = error_response(status, str(exc), type_=type_, param=exc.param, code=code)
        if status == 503:  # queue full, model loading: worth a retry (RFC 9110 10.2.3)
            response.headers["Retry-After"] = "1"
        return response
    # the worker has logged the failed step with its traceback
    return error_response(500, str(exc), type_="internal_server_error", code=500)


async def handle_invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequestError)
    return exception_response(exc)


async def handle_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError)
    return exception_response(request_error(exc))


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), type_=type_)


async def handle_model_step_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ModelStepError)
    return exception_response(exc)


async def handle_client_disconnect(request: Request, exc: Exception) -> JSONResponse:
    # the client left (mid-body or while waiting): nothing to answer, nothing went wrong here
    logger.debug("client disconnected on %s %s", request.method, request.url.path)
    return error_response(400, "the client disconnected before the response")


async def handle_internal_error(request: Request, exc: Exception) -> JSONResponse:
    record = access_record(request.scope)
    rid = record.rid if record is not None and record.rid is not None else "-"
    logger.error("internal error on %s %s rid=%s", request.method, request.url.path, rid, exc_info=exc)
    return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", type_="internal_server_error")


EXCEPTION_HANDLERS: dict[Any, Any] = {
    InvalidRequestError: handle_invalid_request,
    ModelStepError: handle_model_step_error,
    ClientDisconnect: handle_client_disconnect,
    ValidationError: handle_validation_error,
    HTTPException: handle_http_exception,
    Exception: handle_internal_error,
}
