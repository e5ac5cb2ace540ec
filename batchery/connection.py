"""Redis connections from a URL: redis://, rediss:// (TLS), unix://, embedded, Cluster.

Processes receive a :class:`RedisSettings`, never a live client: each builds its own.
Every client retries connection errors with jittered exponential backoff, so a Redis
restart is a pause, not a crash.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import redis
import redis.asyncio
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from batchery.config import EMBEDDED, redis_url_from_env
from batchery.errors import ConfigError

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "unix")
RETRIES = 10          # with the backoff below: about 10 s of retrying before an error surfaces
BACKOFF_BASE_S = 0.05  # a blip (a dropped connection) costs a client 50 ms, not a second
BACKOFF_CAP_S = 2.0    # Redis back from a restart is seen within 2 s, and a down one not hammered
SOCKET_TIMEOUT_S = 30.0  # longer than any blocking read we issue
# Connections one client may open: one per thread (or task) in a Redis call at once.
# redis-py 8 caps a pool at 100 by default and then raises MaxConnectionsError: a Client
# waited on by more than 100 threads failed when their result polls met (test_client).
MAX_CONNECTIONS = 10_000  # Redis' own default maxclients
# Bytes that are not UTF-8 (written by something other than batchery) read as lone
# surrogates instead of failing the whole reply they are part of (a claim of 64 requests),
# and are written back as the same bytes. Never "replace": that writes "doc-\udcff" and
# "doc-\udcfe" as one key "doc-?". Names a caller gives are refused before they get here
# when they are not valid UTF-8 (batching/messages.py check_name).
ENCODING_ERRORS = "surrogateescape"
RETRY_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError,
                redis.exceptions.BusyLoadingError)


@dataclass(frozen=True)
class RedisSettings:
    """Where Redis is and how to talk to it; cheap to pass to another process."""

    url: str = EMBEDDED
    cluster: bool = False

    @classmethod
    def from_url(cls, url: str | None = None, cluster: bool = False) -> "RedisSettings":
        url = redis_url_from_env(url)
        if url != EMBEDDED:
            scheme = urlsplit(url).scheme
            if scheme not in SCHEMES:
                raise ConfigError(f"Redis URL {redact(url)!r}: scheme must be redis://, rediss:// or "
                                  f"unix:// (or 'embedded'), got {scheme or 'none'!r}")
            if cluster and scheme == "unix":
                raise ConfigError("Redis Cluster needs a redis:// or rediss:// URL, not unix://")
        return cls(url=url, cluster=cluster)

    def resolved_url(self) -> str:
        """The URL to dial: the embedded server is started on first use."""
        if self.url == EMBEDDED:
            from batchery import embedded
            return f"unix://{embedded.ensure_server()}"
        return self.url

    def client(self) -> Any:
        """A new synchronous client (``redis.Redis`` or ``RedisCluster``), str replies."""
        url = self.resolved_url()
        if self.cluster:
            from redis.cluster import RedisCluster
            return RedisCluster.from_url(url, decode_responses=True, retry=_retry(),
                                         encoding_errors=ENCODING_ERRORS,
                                         socket_timeout=SOCKET_TIMEOUT_S)
        return redis.Redis.from_url(url, decode_responses=True, encoding_errors=ENCODING_ERRORS,
                                    retry=_retry(), socket_timeout=SOCKET_TIMEOUT_S,
                                    health_check_interval=15, max_connections=MAX_CONNECTIONS)

    def async_client(self) -> Any:
        url = self.resolved_url()
        if self.cluster:
            from redis.asyncio.cluster import RedisCluster
            return RedisCluster.from_url(url, decode_responses=True, retry=_async_retry(),
                                         encoding_errors=ENCODING_ERRORS,
                                         socket_timeout=SOCKET_TIMEOUT_S)
        return redis.asyncio.Redis.from_url(url, decode_responses=True, retry=_async_retry(),
                                            encoding_errors=ENCODING_ERRORS,
                                            socket_timeout=SOCKET_TIMEOUT_S, health_check_interval=15,
                                            max_connections=MAX_CONNECTIONS)

    def binary_client(self) -> redis.Redis:
        """A client with bytes replies, as RQ needs (offline jobs); RQ has no Cluster support."""
        if self.cluster:
            raise ConfigError("offline jobs run on RQ, which needs a single Redis, not a Cluster; "
                              "give the jobs commands a redis:// URL without --cluster")
        return redis.Redis.from_url(self.resolved_url(), retry=_retry(),
                                    socket_timeout=SOCKET_TIMEOUT_S, health_check_interval=15,
                                    max_connections=MAX_CONNECTIONS)

    def describe(self) -> str:
        return "embedded" if self.url == EMBEDDED else redact(self.url)


def text_client(client: redis.Redis) -> redis.Redis:
    """A client with str replies to the same server (and options) as ``client``."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "decode_responses": True}
    return redis.Redis.from_pool(redis.ConnectionPool(connection_class=pool.connection_class,
                                                      max_connections=pool.max_connections, **kwargs))


def retryable(error: Exception) -> bool:
    """Connection trouble is retried; wrong credentials are not (they will not heal)."""
    return not isinstance(error, redis.AuthenticationError)


# Replies that mean "not now" rather than "never": a server loading its data or running a
# long script, a replica promoted under us, a Cluster moving slots.
_TRANSIENT_REPLIES = ("LOADING", "BUSY", "MASTERDOWN", "READONLY", "TRYAGAIN", "CLUSTERDOWN")


def transient(error: Exception) -> bool:
    """True for errors that a retry may cure (the connection, a server starting or failing
    over); False for permanent ones (a command Redis refuses: out of memory, a bad
    argument, no permission), which the same call will meet again every time."""
    if isinstance(error, redis.AuthenticationError):
        return False
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError, ConnectionError,
                          TimeoutError, redis.exceptions.ReadOnlyError,
                          redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError,
                          redis.exceptions.MasterDownError)):
        return True
    return isinstance(error, redis.ResponseError) and str(error).startswith(_TRANSIENT_REPLIES)


class _Retry(Retry):
    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                        with_failure_count: bool = False) -> Any:
        return super().call_with_retry(
            do, fail, lambda e: retryable(e) and (is_retryable is None or is_retryable(e)),
            with_failure_count)


def _retry() -> Retry:
    return _Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES,
                  supported_errors=RETRY_ERRORS)


def _async_retry() -> Any:
    from redis.asyncio.retry import Retry as AsyncRetry

    class _AsyncRetry(AsyncRetry):
        async def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                                  with_failure_count: bool = False) -> Any:
            return await super().call_with_retry(
                do, fail, lambda e: retryable(e) and (is_retryable is None or is_retryable(e)),
                with_failure_count)

    return _AsyncRetry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S),
                       RETRIES, supported_errors=(redis.ConnectionError, redis.TimeoutError,
                                                  redis.exceptions.BusyLoadingError))


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()


class Backoff:
    """The waits of a loop that retries a Redis call itself, past the client's own retries:
    from BACKOFF_BASE_S, doubling up to BACKOFF_CAP_S, as the client's own; ``reset`` after
    a success. One rule for every such loop (the claimer, the writer, reply readers)."""

    def __init__(self) -> None:
        self.wait_s = BACKOFF_BASE_S

    def next(self) -> float:
        """The wait before the next try (and double the one after it)."""
        wait_s, self.wait_s = self.wait_s, min(2 * self.wait_s, BACKOFF_CAP_S)
        return wait_s

    def reset(self) -> None:
        self.wait_s = BACKOFF_BASE_S


def retrying(action: Callable[[], Any], for_s: float = 120.0) -> Any:
    """``action()``, tried again for up to ``for_s`` while Redis is away (restarting, failing
    over): for the calls a process cannot go on without (a worker's registration, its last
    hand-back). An error Redis will repeat (no permission, out of memory) is raised at once."""
    deadline, backoff = time.monotonic() + for_s, Backoff()
    while True:
        try:
            return action()
        except redis.RedisError as exc:
            if not transient(exc) or time.monotonic() >= deadline:
                raise
            wait_s = backoff.next()
            log.warning("Redis unavailable (%s); retrying in %.1fs", exc, wait_s)
            time.sleep(wait_s)
