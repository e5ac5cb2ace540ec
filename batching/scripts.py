"""The Lua scripts, loaded once per connection and called by EVALSHA (reloaded on NOSCRIPT).

Each ``lua/<name>.lua`` states its keys, ARGV and return shape in its header;
``lua/_common.lua`` holds the helpers they share and is prepended to each. The order of
each script's fixed KEYS is written once, in ``FIXED_KEYS``: the script reads them by name
(``K.pending``), and batching/calls.py builds them from the same table.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from importlib import resources
from typing import Any

import redis

# Each script's fixed KEYS in order, by the name of the batching.keys.Keys property (or
# method, given its argument by the call) that makes each. The keys a call declares after
# them (a result key per id, a reply list per client) are KEYS[FIXED + 1..] in the script.
FIXED_KEYS: dict[str, tuple[str, ...]] = {
    "enqueue": ("pending", "requests", "sched", "settings", "wake", "depth", "delayed", "stats",
                "dead", "attempts", "history", "call", "fair", "fair_tenants", "vtc"),
    "claim": ("pending", "delayed", "sched", "requests", "attempts", "lease_expiry",
              "settings", "depth", "claim", "fair", "fair_tenants", "vtc", "served", "rates",
              "plan", "lease_ids"),
    "complete": ("requests", "sched", "attempts", "lease_expiry", "settings", "stats",
                 "history", "lease_ids"),
    "fail": ("requests", "sched", "attempts", "lease_expiry", "delayed", "dead",
             "settings", "depth", "stats", "history", "call", "lease_ids"),
    "reap": ("lease_expiry", "owner", "attempts", "pending", "sched", "dead", "settings", "depth",
             "stats", "requests", "history", "fair", "fair_tenants", "vtc", "lease_ids",
             "leased"),
    "renew": ("lease_expiry", "lease_ids", "settings", "workers"),
    "cancel": ("pending", "delayed", "lease_expiry", "requests", "sched", "attempts",
               "settings", "depth", "stats", "history", "fair", "fair_tenants", "vtc",
               "lease_ids"),
    "revive": ("dead", "pending", "sched", "attempts", "depth", "requests", "history", "fair",
               "fair_tenants", "vtc"),
    "purge": ("dead", "requests", "sched", "attempts", "history"),
    "release": ("lease_expiry", "pending", "sched", "depth", "fair", "fair_tenants", "vtc",
                "lease_ids"),
    "lookup": ("requests",),
    "workers": ("workers", "settings"),
    "oldest": ("pending", "sched"),
    "attach": ("cancelled", "result"),
    "fold": ("served", "depth", "vtc", "fair_tenants"),
}
NAMES = tuple(FIXED_KEYS)


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The script as Redis runs it: the shared helpers, its keys by name, its own code."""
    folder = resources.files("batchery.batching") / "lua"
    names = ", ".join(f"'{key}'" for key in FIXED_KEYS[name])
    return "\n".join([(folder / "_common.lua").read_text(),
                      f"local K, FIXED = named_keys({{{names}}})",
                      (folder / f"{name}.lua").read_text()])


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
    fold: Any


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
