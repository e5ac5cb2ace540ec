"""The Lua scripts, loaded once per connection and called by EVALSHA (reloaded on NOSCRIPT).

Each ``lua/<name>.lua`` states its keys, ARGV and return shape in its header;
``lua/_common.lua`` holds the helpers they share; each script is sent with those it uses
(``helpers_for``). The order of
each script's fixed KEYS is written once, in ``FIXED_KEYS``: the script reads them by name
(``K.pending``), and batching/calls.py builds them from the same table.
"""

from __future__ import annotations

import inspect
import re
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
    "claim": ("pending", "delayed", "sched", "attempts", "lease_expiry",
              "settings", "depth", "claim", "fair", "fair_tenants", "vtc", "served", "rates",
              "plan", "lease_ids"),
    "complete": ("requests", "sched", "attempts", "lease_expiry", "settings", "stats",
                 "history", "lease_ids", "call"),
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
    "drain": ("settings", "readers"),
}
NAMES = tuple(FIXED_KEYS)


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """The script as Redis runs it: the shared helpers it uses, its keys by name, its own code."""
    folder = resources.files("batchery.batching") / "lua"
    names = ", ".join(f"'{key}'" for key in FIXED_KEYS[name])
    own = "\n".join([f"local K, FIXED = named_keys({{{names}}})",
                     (folder / f"{name}.lua").read_text()])
    return "\n".join([helpers_for(own, (folder / "_common.lua").read_text()), own])


_DEFINITION = re.compile(r"local (?:function (\w+)|([\w, ]+?) *=)")
_WORD = re.compile(r"[A-Za-z_]\w*")
_COMMENT = re.compile(r"""('(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*")|--[^\n]*""")


def _words(code: str) -> set[str]:
    """Every name ``code`` mentions outside its comments (in its strings too: a helper more
    at worst, never one fewer)."""
    return set(_WORD.findall(_COMMENT.sub(lambda m: m.group(1) or "", code)))


def helpers_for(code: str, common: str) -> str:
    """The top-level definitions of ``common`` (each ``local`` at the start of a line, with
    the comment above it) that ``code`` uses, directly or through one another, in their
    order. A script runs its whole text at every call: each helper it defines is a closure
    made again, its upvalues found by walking past the locals captured above them (with
    all of them, 65k of a small claim's 707k instructions), so a script is sent with the
    ones it names. Every name the code or a definition mentions outside a comment counts as
    used (a local or a string of the same name pulls one in for nothing), so none that is
    used is left out; a line of ``common`` this cut could read wrong (a top-level statement
    that is not a ``local``, two on one line, long strings or block comments) is refused."""
    lines = common.splitlines(keepends=True)
    for line in lines:  # what the cut by lines would read wrong is refused, not guessed at
        if (line[:1] not in ("", " ", "\n") and not line.startswith(("local ", "--", "end"))
                or "[[" in line or "[=" in line or "--[" in line or line.rstrip("\n").endswith("\\")
                or re.search(r";\s*local\b", line)):
            raise ValueError(f"_common.lua: a line helpers_for cannot cut by: {line!r}")
    starts = [i for i, line in enumerate(lines) if line.startswith("local ")]
    bounds: list[int] = []  # where each definition's text starts: the comment above it
    for start in starts:
        b = start
        while b > 0 and lines[b - 1].startswith("--"):
            b -= 1
        bounds.append(b)
    bounds[0] = 0  # the file's own header goes with the first
    units = []
    for k, b in enumerate(bounds):
        text = "".join(lines[b:bounds[k + 1] if k + 1 < len(bounds) else len(lines)])
        match = _DEFINITION.match(lines[starts[k]])
        if not match:
            raise ValueError(f"_common.lua: cannot read the definition {lines[starts[k]]!r}")
        defines = ({match.group(1)} if match.group(1)
                   else {n.strip() for n in match.group(2).split(",")})
        units.append((defines, _words(text), text))
    used, taken, grew = _words(code), [False] * len(units), True
    while grew:  # until every name the text sent mentions is defined in it
        grew = False
        for k, (defines, words, _) in enumerate(units):
            if not taken[k] and defines & used:
                taken[k] = grew = True
                used |= words
    return "".join(text for (_, _, text), take in zip(units, taken) if take)


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


# A script call that finds the server's script cache empty loads the script and calls it
# again (redis-py's Script). A server that restarts between that load and that call (the
# connection's retry reaches the new one) answers NOSCRIPT again: that send did not run,
# and the call is made again from the start, up to this many times in all. (A send before
# it may have run on the old server, its reply lost to the restart, as with redis-py's own
# reload: each script answers a call sent again as a replay, docs/architecture.md.)
NOSCRIPT_TRIES = 4


def _same_errors(script: Any) -> Any:
    """The script, raising OutOfMemoryError for a write refused for memory on every Redis
    (before 7.0 a refusal inside a script is a plain ResponseError: "Error running script
    ... -OOM command not allowed ..."), and called again when the server lost it between
    its load and its call (NOSCRIPT_TRIES)."""
    if inspect.iscoroutinefunction(script.__call__):
        async def call_async(keys: Any = None, args: Any = None) -> Any:
            for tries_left in range(NOSCRIPT_TRIES - 1, -1, -1):
                try:
                    return await script(keys, args)
                except redis.exceptions.NoScriptError:
                    if not tries_left:
                        raise
                except redis.ResponseError as exc:
                    raise refined(exc) from None
        call_async.sha = script.sha  # type: ignore[attr-defined]
        return call_async

    def call(keys: Any = None, args: Any = None) -> Any:
        for tries_left in range(NOSCRIPT_TRIES - 1, -1, -1):
            try:
                return script(keys, args)
            except redis.exceptions.NoScriptError:
                if not tries_left:
                    raise
            except redis.ResponseError as exc:
                raise refined(exc) from None
    call.sha = script.sha  # type: ignore[attr-defined]
    return call


def refined(exc: redis.ResponseError) -> redis.ResponseError:
    """``exc``, as OutOfMemoryError where it is a write refused for memory."""
    if not isinstance(exc, redis.OutOfMemoryError) and "-OOM command not allowed" in str(exc):
        return redis.OutOfMemoryError(str(exc))
    return exc
