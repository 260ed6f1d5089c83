"""Errors as the HTTP API answers them: ``APIError``, OpenAI's error JSON, and the one table
(``api_error_of``) that turns every error type raised anywhere below the ingress into a status
code, so the same failure always answers the same way.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException

from deployments.orchestration.pipeline import REPLICA_LOST
from engine.errors import (
    AudioDecodeError,
    AudioTooLongError,
    NoRoomError,
    RequestRejectedError,
    RetriableError,
    WindowFailedError,
    quoted,
)
from kv_transfer.base import StagingFullError

logger = logging.getLogger("ray.serve")

# The longest error message a client gets. Each value of the client's a message quotes is cut to
# engine.errors.QUOTED_CHARS where it is quoted; this bounds the whole, whatever it quotes.
MAX_MESSAGE_CHARS = 500


def bounded_message(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 3] + "..."


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields, raised inside route handlers."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        retry_after_s: int | None = None,
    ):
        message = bounded_message(message)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.error_type, self.retry_after_s = error_type, retry_after_s

    def body(self) -> dict:
        """OpenAI's error object: the value of ``error`` in a response, or of a stream's error event."""
        return {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}


def unknown_model_message(model_id: str, served_ids: list[str]) -> str:
    return f"The model {quoted(model_id)} does not exist; this server serves {', '.join(served_ids)}."


def model_not_found(model_id: str, served_ids: list[str]) -> APIError:
    """A `model` no configured model answers to (OpenAI's 404 `model_not_found`)."""
    return APIError(404, unknown_model_message(model_id, served_ids), param="model", code="model_not_found")


def at_capacity(why: str = "The server is at capacity") -> APIError:
    """OpenAI's 503 for a server too busy to take the request now, ``why`` saying what was full."""
    return APIError(
        503,
        f"{why}; retry shortly.",
        code="overloaded",
        error_type="server_overloaded",
        retry_after_s=1,
    )


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return JSONResponse({"error": error.body()}, status_code=error.status, headers=headers)


def api_error_of(error: Exception) -> APIError:
    if isinstance(error, RayTaskError) and isinstance(error.cause, Exception):
        error = error.cause  # raised in another replica: answer for the original error, not Ray's wrapper
    if isinstance(error, APIError):
        return error
    if isinstance(error, AudioTooLongError):
        return APIError(413, f"Audio too long: {error}.", param="file", code="audio_too_long")
    if isinstance(error, AudioDecodeError):
        return APIError(400, f"Invalid audio file: {error}", param="file", code="invalid_audio")
    if isinstance(error, RequestRejectedError):
        return APIError(400, str(error), param=error.param, code="invalid_request")
    if isinstance(error, (BackPressureError, StagingFullError)):
        return at_capacity()
    if isinstance(error, NoRoomError):
        return at_capacity(
            f"The server waited {error.waited_s:g} s for room in {error.what} and none came free"
        )
    if isinstance(error, WindowFailedError):  # logged where it happened, with its window
        return APIError(
            500, f"Transcription failed: {error}.", code="window_failed", error_type="server_error"
        )
    if isinstance(error, REPLICA_LOST):
        return APIError(
            503,
            "A server replica is restarting; retry shortly.",
            code="replica_unavailable",
            error_type="server_error",
            retry_after_s=2,
        )
    if isinstance(error, RetriableError):
        return APIError(
            503,
            f"Transcription failed transiently: {error}",
            code="retry",
            error_type="server_error",
            retry_after_s=1,
        )
    logger.exception("unexpected error", exc_info=error)
    return APIError(500, "Internal server error.", error_type="server_error")


async def _api_error(_: Request, error: APIError) -> JSONResponse:
    return error_response(error)


async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0] if error.errors() else {}
    field = str(first.get("loc", ["", "?"])[-1])
    message = f"Invalid value for {quoted(field)}: {first.get('msg', 'invalid')}"
    return error_response(APIError(400, message, param=field))


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """FastAPI's own answers (an unknown route, a wrong method) in OpenAI's error shape."""
    if error.status_code == 404:
        message = f"Unknown request URL: {request.method} {quoted(request.url.path)}."
        return error_response(APIError(404, message, code="unknown_url"))
    if error.status_code == 405:
        message = f"Method {request.method} is not allowed for {quoted(request.url.path)}."
        return error_response(APIError(405, message, code="method_not_allowed"))
    return error_response(APIError(error.status_code, str(error.detail)))


def add_exception_handlers(app: FastAPI) -> None:
    """Errors that escape a route, FastAPI's own validation errors and its answers for unknown
    routes, all in OpenAI's error JSON."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
