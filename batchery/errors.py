"""Errors a user can act on. The CLI maps each to an exit code, never a traceback.

Exit codes (docs/reference/errors.md): 0 done; 1 Redis unreachable or refusing; 2 bad input
or option; 3 queue full; 4 no such job or request; 5 timed out waiting; 6 request lost
by Redis; 7 done, but a result is not ok (error, expired, cancelled, dead) or the job
failed or was cancelled.
"""

from __future__ import annotations


class BatcheryError(Exception):
    """Base class of every error batchery raises on purpose."""

    exit_code = 1


class InvalidRequest(BatcheryError, ValueError):
    """A request that can never run: bad type, bad priority, bad deadline."""

    exit_code = 2


class RequestTooLarge(InvalidRequest):
    """The request's input is larger than the queue's max_request_bytes."""


class QueueFull(BatcheryError):
    """The queue refuses new requests for now: it holds max_pending requests already
    (reason ``max_pending``), one tenant holds its tenant_max_pending (``tenant``: other
    tenants are not affected), or Redis is over its memory high-water mark (``memory``)."""

    exit_code = 3

    def __init__(self, message: str, reason: str = "max_pending") -> None:
        super().__init__(message)
        self.reason = reason


class ShardsChanged(BatcheryError):
    """The queue's shard count changed since this producer read it (lua/enqueue.lua): the
    facade (batching/sharded.py) reads the new layout and enqueues again. Not for users."""

    def __init__(self, shards: int) -> None:
        super().__init__(f"the queue now has {shards} shard(s); read its settings again")
        self.shards = shards


class JobNotFound(BatcheryError):
    """No offline job with that id."""

    exit_code = 4


class NotOk(BatcheryError):
    """The command ran, but what it waited for did not succeed."""

    exit_code = 7


class RequestNotFound(BatcheryError, LookupError):
    """No request with that id: not queued, not running, no result (any more)."""

    exit_code = 4


class ConfigError(BatcheryError, ValueError):
    """A setting or option that cannot work (bad URL, bad runner, missing model)."""

    exit_code = 2


class RequestLost(BatcheryError, LookupError):
    """Redis holds no trace of a request waited on: not queued, not running, no result."""

    exit_code = 6


class ResultTimeout(BatcheryError, TimeoutError):
    """No result arrived within the timeout; the request stays queued."""

    exit_code = 5
