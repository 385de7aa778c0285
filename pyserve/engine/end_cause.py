"""What an ended request's consumer gets: the exception an `EndCause` stands for, raised to
an `Engine` caller and answered by the server with the cause's status and code
(server/errors.py's `END_CAUSE_HTTP`)."""

from __future__ import annotations

from pyserve.errors import (
    InvalidRequestError,
    ModelStepError,
    QueueFullError,
    ServerDrainingError,
)
from pyserve.forward_batch_info import EndCause, FinishReason


def end_error(reason: FinishReason | None, streamed: bool) -> InvalidRequestError | ModelStepError | None:
    """The exception a request's end stands for, or None when its consumer just gets the
    final output (a stop, a length limit, an abort by the client, an admin or the engine
    stopping). A drain's deadline fails a whole-response consumer (ServerDrainingError, so it
    can retry elsewhere) but ends a stream with its last chunk (`streamed`)."""
    if reason is None or not reason.is_abort:
        return None
    cause, message = reason.cause, reason.message or ""
    error: InvalidRequestError | ModelStepError
    if cause is EndCause.SHUTDOWN:
        if streamed:
            return None
        error = ServerDrainingError()
    elif cause is EndCause.BUMPED:
        error = QueueFullError(message)
    elif cause in (EndCause.BAD_PARAMS, EndCause.GRAMMAR_REFUSED):
        error = InvalidRequestError(message, param=reason.param or "sampling_params")
    elif cause in (EndCause.STEP_FAILED, EndCause.SERVER_FAILED):
        error = ModelStepError(message)
    else:  # the client left, an abort, the engine stopping: the last output says so
        return None
    error.end_cause = cause
    return error
