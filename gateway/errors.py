"""Errors in the OpenAI API's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal the gateway makes is an ApiError; batchery's own errors and Redis outages
are mapped here, once, so that the ``openai`` SDK raises the exception a user expects
(BadRequestError, AuthenticationError, NotFoundError, RateLimitError, ...).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from starlette.requests import Request
from starlette.responses import Response

from batchery.batching.codec import encode
from batchery.errors import BatcheryError, InvalidRequest, JobNotFound, QueueFull, ResultTimeout
from batchery.producer.openai_api import BodyError, result_error

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1   # a full queue drains in about a batch's time: ask again soon


class ApiError(Exception):
    """A refusal with its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encode(body, "replace"), status, headers, media_type="application/json")


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def not_found(message: str, code: str = "not_found", param: str | None = None) -> ApiError:
    return ApiError(404, message, code=code, param=param)


def unknown_model(model: str) -> ApiError:
    return not_found(f"the model {model!r} does not exist: models are batchery queues; "
                     "GET /v1/models lists those served", "model_not_found", "model")


def from_batchery(exc: Exception) -> ApiError:
    """The ApiError of one of batchery's own errors."""
    if isinstance(exc, QueueFull):
        return ApiError(429, f"{exc}; retry after {RETRY_AFTER_S}s", "rate_limit_error",
                        code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, BodyError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc))
    if isinstance(exc, JobNotFound):
        return not_found(str(exc))
    if isinstance(exc, ResultTimeout):
        return deadline_passed(str(exc))
    return ApiError(400, str(exc))


def deadline_passed(message: str) -> ApiError:
    return ApiError(504, message, "timeout_error", code="deadline_exceeded")


def from_result(result: Any) -> ApiError:
    """The ApiError of a request that did not end ok (status error, dead, expired, cancelled)."""
    status, error = result_error(result)
    return ApiError(status, error["message"], error["type"], error["param"], error["code"])


async def on_api_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def on_batchery_error(_request: Request, exc: Exception) -> Response:
    return from_batchery(exc).response()


async def on_redis_error(request: Request, exc: Exception) -> Response:
    log.warning("Redis error serving %s: %s", request.url.path, exc)
    return ApiError(503, f"batchery's Redis did not answer ({type(exc).__name__}); retry shortly",
                    "server_error", code="redis_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)}).response()


HANDLERS = {ApiError: on_api_error, BatcheryError: on_batchery_error,
            redis.RedisError: on_redis_error}
