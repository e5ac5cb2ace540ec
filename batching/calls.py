"""The protocol's encoding: each script call's KEYS and ARGV, and its reply read back.

Shared by RequestQueue (batching/queue.py) and AsyncRequestQueue (batching/async_queue.py),
so the synchronous and asyncio clients speak one protocol.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

from batchery.batching.keys import Keys
from batchery.batching.messages import (CANCELLED, Claimed, Request, Result, estimate_tokens,
                                        stored_input)
from batchery.batching.settings import DEFAULTS
from batchery.errors import InvalidRequest, QueueFull, RequestTooLarge, ShardsChanged


@dataclass(frozen=True)
class Call:
    """KEYS and ARGV of one script call."""

    keys: list[str]
    args: list[Any]


@dataclass
class ClaimReply:
    now_ms: int
    wait_ms: int                                  # > 0: held back; -1: nothing pending
    expired: list[Claimed] = field(default_factory=list)
    batch: list[Claimed] = field(default_factory=list)
    # candidates priced by estimate, (id, input): count them, claim again with the counts
    to_price: list[tuple[str, Any]] = field(default_factory=list)
    # with a batch: the estimated requests next in line, (id, input), for a counting
    # worker to count now and send with its next claim (which then needs no pricing round)
    price_ahead: list[tuple[str, Any]] = field(default_factory=list)



def enqueue_call(k: Keys, requests: Sequence[Request], client_id: str, shards: int = 1) -> Call:
    """The enqueue script's KEYS and ARGV (see lua/enqueue.lua); ``shards``: the shard
    count the caller routed by (the script refuses when the queue's differs)."""
    delays = ",".join(f"{c}={int(s * 1000)}" for c, s in DEFAULTS.class_delays.items())
    args: list[Any] = [k.result_prefix, DEFAULTS.max_pending, DEFAULTS.max_request_bytes,
                       delays, client_id, DEFAULTS.memory_high_water, shards]
    for r in requests:
        tokens = r.tokens if r.tokens is not None else f"~{estimate_tokens(r.input)}"
        deadline_ms = math.ceil(r.deadline * 1000) if r.deadline else 0  # 0.4 ms: 1 ms, not none
        args += [r.id, r.priority, tokens, deadline_ms, r.tenant, r.payload()]
    return Call([k.pending, k.requests, k.sched, k.settings, k.wake, k.depth, k.delayed,
                 k.stats, k.dead, k.attempts, k.history, k.call(new_call_id()),
                 k.fair, k.fair_tenants, k.vtc,
                 *(k.result_prefix + r.id for r in requests)], args)


def new_call_id() -> str:
    """A fresh id for one enqueue or fail call: the connection's retries of that call
    (after a lost reply) reuse it, so the script returns its first run's reply."""
    return secrets.token_hex(8)


def declared_keys(k: Keys, ids: Sequence[str], clients: Sequence[str]) -> list[str]:
    """The keys a script writes beyond its fixed ones, declared in KEYS as Redis Cluster
    demands: the result key of each id, then the reply list of each client ('' none)."""
    result, reply = k.result_prefix, k.reply_prefix  # properties: built once, not per id
    return [*(result + i for i in ids), *(reply + c for c in dict.fromkeys(clients) if c)]


def parse_clients(scheds: Sequence[str | None]) -> list[str]:
    """The client field of sched entries ('' where the request is gone)."""
    return [s.split(":", 6)[5] if s else "" for s in scheds]


def cancel_call(k: Keys, ids: Sequence[str], clients: Sequence[str]) -> Call:
    """The cancel script's KEYS and ARGV (see lua/cancel.lua); ``clients``: who enqueued
    each id, read just before (a client not declared gets no push; it polls)."""
    args: list[Any] = [k.result_prefix, k.reply_prefix, DEFAULTS.result_ttl, k.cancelled_prefix]
    for request_id in ids:
        args += [request_id, Result(id=request_id, status=CANCELLED,
                                    error={"type": "Cancelled",
                                           "message": "cancelled by the client"}).to_json()]
    return Call([k.pending, k.delayed, k.leased, k.owner, k.requests, k.sched, k.attempts,
                 k.settings, k.depth, k.stats, k.history, k.fair, k.fair_tenants, k.vtc,
                 *(k.result(i) for i in ids),
                 *(k.cancelled(i) for i in ids), *(k.reply(c) for c in dict.fromkeys(clients) if c)],
                args)


def lookup_call(k: Keys, ids: Sequence[str]) -> Call:
    """The lookup script's KEYS and ARGV (see lua/lookup.lua)."""
    return Call([k.requests, *(k.result(i) for i in ids)], list(ids))


def parse_lookup(reply: list[Any], ids: Sequence[str]) -> list[Result | bool]:
    return [Result.from_json(r, i) if isinstance(r, (str, bytes)) else bool(r)
            for r, i in zip(reply, ids, strict=True)]


def memory_full(error: Exception | str) -> QueueFull:
    """QueueFull for a Redis over its memory high-water mark (str: the numbers), or out of
    memory (the OutOfMemoryError it answered)."""
    why = error if isinstance(error, str) else "it is out of memory: used memory > maxmemory"
    return QueueFull(f"queue is full: Redis is short of memory ({why}); retry later, let "
                     "workers drain the queue, or give Redis more maxmemory", reason="memory")


def parse_enqueue(reply: list[Any], requests: Sequence[Request]) -> list[bool]:
    if int(reply[0]) == 1:
        return [bool(int(s)) for s in reply[2:]]
    code, index, detail = reply[1], int(reply[2]), reply[3]
    if code == "shards":
        raise ShardsChanged(int(detail))
    if code == "full":
        held = (f"its max_pending of {detail} requests" if index <= 1 else
                f"one of its {index} shards holds its share of max_pending {detail} "
                f"(ceil({detail} / {index}) requests)")
        raise QueueFull(f"queue is full: {held}; "
                        "retry later, add workers, or raise it with `batchery queue config "
                        "QUEUE --max-pending N`")
    if code == "memory":
        used, _, most = str(detail).partition("/")
        raise memory_full(f"it uses {int(used) / 2**20:.1f} MiB of its maxmemory "
                          f"{int(most) / 2**20:.1f} MiB, over the queue's memory_high_water")
    request = requests[index - 1]
    if code == "tenant_full":
        share = "" if int(reply[4]) <= 1 else f" (ceil({detail} / {reply[4]}) on each shard)"
        raise QueueFull(f"queue is full for tenant {request.tenant!r}: it holds its "
                        f"tenant_max_pending of {detail} requests{share}; other tenants are not "
                        "affected. Retry later, or raise it with `batchery queue config QUEUE "
                        f"--tenant-max-pending {request.tenant}=N`", reason="tenant")
    if code == "too_large":
        raise RequestTooLarge(f"request {request.id!r} is {len(request.payload())} bytes, over "
                              f"the queue's max_request_bytes of {detail}; send a smaller input "
                              "or raise the limit with `batchery queue config`")
    raise InvalidRequest(f"request {request.id!r}: unknown priority class {detail!r}; use "
                         "realtime, normal, batch, a class set with `batchery queue config "
                         "--class-delay`, or an integer delay in seconds")


def parse_claim(reply: list[Any], token: str) -> ClaimReply:
    now_ms, wait_ms, n_expired = int(reply[0]), int(reply[1]), int(reply[2])
    if wait_ms == -2:
        n = (len(reply) - 3) // 2
        return ClaimReply(now_ms, 0, to_price=[(i, stored_input(p))
                                               for i, p in zip(reply[3:3 + n], reply[3 + n:])])
    if len(reply) == 3:  # nothing leased
        return ClaimReply(now_ms, wait_ms)
    head = int(reply[3])  # the rank the batch was chosen against
    m = int(reply[-1])  # the requests priced ahead, last: their ids, then their payloads
    n = (len(reply) - 5 - 2 * m) // 4
    ids, payloads = reply[4:4 + n], reply[4 + n:4 + 2 * n]
    scheds, failures = reply[4 + 2 * n:4 + 3 * n], reply[4 + 3 * n:4 + 4 * n]
    claimed = [Claimed.decode(i, p, s, f, token, head)
               for i, p, s, f in zip(ids, payloads, scheds, failures)]
    ahead = reply[4 + 4 * n:-1]
    return ClaimReply(now_ms, wait_ms, claimed[:n_expired], claimed[n_expired:],
                      price_ahead=[(i, stored_input(p)) for i, p in zip(ahead[:m], ahead[m:])])
