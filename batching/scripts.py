"""The Lua scripts, loaded once per connection and called by EVALSHA (reloaded on NOSCRIPT).

Each ``lua/<name>.lua`` states its KEYS, ARGV and return shape in its header;
``lua/_common.lua`` holds the helpers they share and is prepended to each.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any

NAMES = ("enqueue", "claim", "complete", "fail", "reap", "renew", "cancel", "revive", "purge", "release",
         "lookup", "reprice", "workers", "oldest")


@lru_cache(maxsize=None)
def source(name: str) -> str:
    folder = resources.files("batchery.batching") / "lua"
    return (folder / "_common.lua").read_text() + "\n" + (folder / f"{name}.lua").read_text()


class Scripts:
    """The scripts registered on one client (sync or asyncio: both have register_script)."""

    def __init__(self, client: Any) -> None:
        for name in NAMES:
            setattr(self, name, client.register_script(source(name)))

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
    reprice: Any
    workers: Any
    oldest: Any
