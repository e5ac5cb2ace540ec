"""The Lua scripts, loaded once per connection and called by EVALSHA (reloaded on NOSCRIPT).

Each ``lua/<name>.lua`` states its KEYS, ARGV and return shape in its header;
``lua/_common.lua`` holds the helpers they share and is prepended to each.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from importlib import resources
from typing import Any

import redis

NAMES = ("enqueue", "claim", "complete", "fail", "reap", "renew", "cancel", "revive", "purge", "release",
         "lookup", "workers", "oldest", "attach")


@lru_cache(maxsize=None)
def source(name: str) -> str:
    folder = resources.files("batchery.batching") / "lua"
    return (folder / "_common.lua").read_text() + "\n" + (folder / f"{name}.lua").read_text()


class Scripts:
    """The scripts registered on one client (sync or asyncio: both have register_script)."""

    def __init__(self, client: Any) -> None:
        for name in NAMES:
            setattr(self, name, _same_errors(client.register_script(source(name))))

    enqueue: Any
    claim: Any
    complete: Any
    fail: Any
    reap: Any
    renew: Any
    cancel: Any
    revive: Any
    purge: Any
    release: Any
    lookup: Any
    workers: Any
    oldest: Any
    attach: Any


def _same_errors(script: Any) -> Any:
    """The script, raising OutOfMemoryError for a write refused for memory on every Redis:
    before 7.0 a refusal inside a script is a plain ResponseError ("Error running script
    ... -OOM command not allowed ...")."""
    if inspect.iscoroutinefunction(script.__call__):
        async def call_async(keys: Any = None, args: Any = None) -> Any:
            try:
                return await script(keys, args)
            except redis.ResponseError as exc:
                raise refined(exc) from None
        call_async.sha = script.sha  # type: ignore[attr-defined]
        return call_async

    def call(keys: Any = None, args: Any = None) -> Any:
        try:
            return script(keys, args)
        except redis.ResponseError as exc:
            raise refined(exc) from None
    call.sha = script.sha  # type: ignore[attr-defined]
    return call


def refined(exc: redis.ResponseError) -> redis.ResponseError:
    """``exc``, as OutOfMemoryError where it is a write refused for memory."""
    if not isinstance(exc, redis.OutOfMemoryError) and "-OOM command not allowed" in str(exc):
        return redis.OutOfMemoryError(str(exc))
    return exc
