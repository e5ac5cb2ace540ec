"""The protocol's encoding: each script call's KEYS and ARGV, and its reply read back.

Every script call is built here and its reply read here, whoever makes it: RequestQueue
(batching/queue.py), its asyncio twin (batching/async_queue.py) and the inspection
calls (batching/inspection.py) send what these functions return. A call's fixed KEYS
come from batching/scripts.py FIXED_KEYS, the one place their order is written; what a
script answers with is read into named values (``Failed``, ``Cancelled``). The claim's
own call and reply: batching/claim_call.py.
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Sequence

from batchery.batching.keys import Keys
from batchery.batching.messages import CANCELLED, Result
from batchery.batching.request import DEFAULT_TENANT, Request, first_send
from batchery.batching.pricing import estimate_tokens
from batchery.batching.scripts import FIXED_KEYS
from batchery.batching.settings import DEFAULTS
from batchery.connection import ENCODING_ERRORS
from batchery.errors import InvalidRequest, QueueFull, RequestTooLarge, ShardsChanged

log = logging.getLogger(__name__)
RETRY_BACKOFF_BASE_MS = 500   # a failed request's first retry after half a second: a blip passes
RETRY_BACKOFF_CAP_MS = 60_000  # ... doubling up to a minute


class Failed(IntEnum):
    """What lua/fail.lua did with each failed request."""

    LEASE_LOST = 0  # this worker no longer held it: nothing written
    RETRIED = 1     # back in the queue after its backoff
    DEAD = 2        # its last attempt: dead-lettered


class Cancelled(IntEnum):
    """What lua/cancel.lua did with each id."""

    NOT = 0       # it had finished, or is unknown
    QUEUED = 1    # cancelled while queued
    RUNNING = 2   # cancelled while running: its output is discarded
    ALREADY = 3   # cancelled before (an earlier cancel, or this call retried)

    @property
    def label(self) -> str:
        """The outcome as `batchery request cancel --json` names it."""
        return "not_cancelled" if self is Cancelled.NOT else f"cancelled_{self.name.lower()}"


@dataclass(frozen=True)
class Call:
    """KEYS and ARGV of one script call."""

    keys: list[str]
    args: list[Any]


@dataclass
class Reaped:
    """What one reap took back: ids back in the queue, ids dead-lettered."""

    requeued: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)


def fixed_keys(k: Keys, script: str, **made: str) -> list[str]:
    """``script``'s fixed KEYS on the shard ``k``, in FIXED_KEYS order; ``made``: those a
    Keys method makes from this call's own value (``call=k.call(new_call_id())``)."""
    return [made[name] if name in made else getattr(k, name) for name in FIXED_KEYS[script]]


def enqueue_call(k: Keys, requests: Sequence[Request], client_id: str, shards: int = 1) -> Call:
    """The enqueue script's KEYS and ARGV (see lua/enqueue.lua); ``shards``: the shard
    count the caller routed by (the script refuses when the queue's differs). Every
    enqueue is built here, so this is where its requests are marked sent (first_send):
    a call of requests whose ids their client made and never sent before tells the script
    to skip its duplicate check; any later call of them is checked, whatever sends it
    (a group sent again caller by caller, a call routed again)."""
    delays = ",".join(f"{c}={int(s * 1000)}" for c, s in DEFAULTS.class_delays.items())
    unsent = first_send(requests)  # no id can be known: nothing to check, no key to read
    args: list[Any] = [k.result_prefix, DEFAULTS.max_pending, DEFAULTS.max_request_bytes,
                       delays, client_id, DEFAULTS.memory_high_water, shards, int(unsent)]
    run = -1  # where the current run's count is in args: a run shares these three
    for r in requests:
        tokens = r.tokens if r.tokens is not None else f"~{estimate_tokens(r.input)}"
        deadline_ms = math.ceil(r.deadline * 1000) if r.deadline else 0  # 0.4 ms: 1 ms, not none
        if run < 0 or args[run - 3:run] != [r.priority, deadline_ms, r.tenant]:
            args += (r.priority, deadline_ms, r.tenant, 0)
            run = len(args) - 1
        args[run] += 1
        args += (r.id, tokens, r.payload())
    checked = () if unsent else (k.result_prefix + r.id for r in requests)  # read by the check
    return Call([*fixed_keys(k, "enqueue", call=k.call(new_call_id())), *checked], args)


def new_call_id() -> str:
    """A fresh id for one enqueue or fail call: the connection's retries of that call
    (after a lost reply) reuse it, so the script returns its first run's reply."""
    return secrets.token_hex(8)


def declared_keys(k: Keys, ids: Sequence[str], clients: Sequence[str]) -> list[str]:
    """The keys a script writes beyond its fixed ones, declared in KEYS as Redis Cluster
    demands: the result key of each id, then the reply list, reader mark and bell of each
    client ('' none)."""
    result, reply = k.result_prefix, k.reply_prefix  # properties: built once, not per id
    readers = [c for c in dict.fromkeys(clients) if c]
    return [*(result + i for i in ids),
            *(key for c in readers for key in (reply + c, k.reader(c), k.bell(c)))]


def parse_clients(scheds: Sequence[str | None]) -> list[str]:
    """The client field of sched entries ('' where the request is gone, or its entry was
    damaged past reading: its waiter then finds the result by polling)."""
    fields = [s.split(":", 6) if s else [] for s in scheds]
    return [f[5] if len(f) > 5 else "" for f in fields]


def sched_tenant(sched: str) -> str:
    """The tenant of a sched entry ("tokens:expire:enq:rank:class:client:tenant"; an
    entry written before tenants ends at client: the default tenant)."""
    parts = sched.split(":", 6)
    return parts[6] if len(parts) > 6 and parts[6] else DEFAULT_TENANT


def parse_cancel(reply: list[Any]) -> list[Cancelled]:
    return [Cancelled(int(f)) for f in reply]


def cancel_call(k: Keys, ids: Sequence[str], clients: Sequence[str]) -> Call:
    """The cancel script's KEYS and ARGV (see lua/cancel.lua); ``clients``: who enqueued
    each id, read just before (a client not declared gets no push; it polls)."""
    args: list[Any] = [k.result_prefix, k.reply_prefix, DEFAULTS.result_ttl, k.cancelled_prefix]
    for request_id in ids:
        args += [request_id, Result(id=request_id, status=CANCELLED,
                                    error={"type": "Cancelled",
                                           "message": "cancelled by the client"}).to_json()]
    return Call([*fixed_keys(k, "cancel"), *(k.cancelled(i) for i in ids),
                 *declared_keys(k, ids, clients)], args)


def lookup_call(k: Keys, ids: Sequence[str]) -> Call:
    """The lookup script's KEYS and ARGV (see lua/lookup.lua)."""
    return Call([*fixed_keys(k, "lookup"), *(k.result(i) for i in ids)], list(ids))


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
    if int(reply[0]) == 1:  # a digit a request (lua/enqueue.lua)
        return [s == "1" for s in reply[2]]
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


def complete_call(k: Keys, items: Sequence[tuple[str, str, str | bytes]], totals: dict[str, int],
                  clients: Sequence[str], keyed: bool = True) -> Call:
    """The complete script's KEYS and ARGV: (id, lease token, result JSON) items, each
    with its client (see lua/complete.lua). ``keyed``: each id sent in its result key,
    declared, and each result a value; else the ids in ARGV, no result key declared
    (refused with KEYS_NEEDED when a result would be stored under its key), and each run's
    results one text, a line each (pushed as one reply-list entry: reply_lists.py)."""
    args: list[Any] = [k.result_prefix, k.reply_prefix, DEFAULTS.result_ttl,
                       ",".join(f"{name}={n}" for name, n in totals.items() if n),
                       int(DEFAULTS.delete_delivered), int(keyed)]
    runs: list[tuple[str, str, list[str], list[str | bytes]]] = []  # a token and a client each
    for (request_id, token, result), client in zip(items, clients, strict=True):
        if not runs or runs[-1][0] != token or runs[-1][1] != client:
            runs.append((token, client, [], []))
        runs[-1][2].append(request_id)
        runs[-1][3].append(one_line(result))
    for token, client, ids, results in runs:
        args += (token, client, len(ids))
        args += results if keyed else [*ids, one_line_each(results)]
    ids = [i[0] for i in items] if keyed else []
    return Call([*fixed_keys(k, "complete", call=k.call(new_call_id())),
                 *declared_keys(k, ids, clients)], args)


KEYS_NEEDED = "keys"  # a keyless commit's answer when a result must be stored under its key


def one_line_each(results: Sequence[str | bytes]) -> str | bytes:
    """Result JSONs (one_line) as one text, a line each."""
    if any(isinstance(r, bytes) for r in results):
        return b"\n".join(r if isinstance(r, bytes) else r.encode("utf-8", ENCODING_ERRORS)
                           for r in results)
    return "\n".join(results)  # type: ignore[arg-type]


def one_line(result: str | bytes) -> str | bytes:
    """A result JSON as a reply list holds it: on one line, not led by a space (KEPT, its
    mark of a result kept under its key: lua/_common.lua). A newline in a JSON text, or
    a space before it, can only be whitespace (a string holds a newline escaped): the
    same JSON. A worker's own (Result.to_json) is so already, and passes as it is."""
    newline, space = ("\n", " ") if isinstance(result, str) else (b"\n", b" ")
    if newline in result or result[:1].isspace():
        return result.replace(newline, space).strip()  # type: ignore[arg-type]
    return result


def fail_call(k: Keys, items: Sequence[tuple[str, str, str | bytes]],
              clients: Sequence[str]) -> Call:
    """The fail script's KEYS and ARGV: (id, lease token, dead result JSON) items."""
    args: list[Any] = [k.result_prefix, k.reply_prefix, DEFAULTS.max_attempts,
                       DEFAULTS.result_ttl, RETRY_BACKOFF_BASE_MS, RETRY_BACKOFF_CAP_MS,
                       DEFAULTS.dead_ttl]
    for item in items:
        args += item
    return Call([*fixed_keys(k, "fail", call=k.call(new_call_id())),
                 *declared_keys(k, [i[0] for i in items], clients)], args)


def parse_fail(reply: list[Any]) -> list[Failed]:
    return [Failed(int(f)) for f in reply]


def renew_call(k: Keys, worker_id: str, leases: Sequence[tuple[str, str]]) -> Call:
    """The renew script's KEYS and ARGV: the (id, lease token) pairs a worker holds."""
    return Call(fixed_keys(k, "renew"), [worker_id, DEFAULTS.lease_seconds,
                                         *(v for lease in leases for v in lease)])


def reap_call(k: Keys, limit: int, declared: Sequence[str] = ()) -> Call:
    """The reap script's KEYS and ARGV; ``declared``: the result keys and reply lists of
    the requests an earlier call returned as needing them (see lua/reap.lua)."""
    return Call([*fixed_keys(k, "reap"), *declared],
                [k.result_prefix, k.reply_prefix, DEFAULTS.max_attempts, DEFAULTS.result_ttl,
                 limit, DEFAULTS.dead_ttl])


def drain_call(k: Keys, client_id: str, alone_ids: Sequence[str]) -> Call:
    """The drain script's KEYS and ARGV (lua/drain.lua): a stopped reader's keys, and the
    result key of each result the caller read on its lists that was pushed alone."""
    return Call([*fixed_keys(k, "drain"), k.reader(client_id), k.reply(client_id),
                 k.inbox(client_id, 0), k.inbox(client_id, 1), k.bell(client_id),
                 *(k.result(i) for i in dict.fromkeys(alone_ids))],
                [client_id, k.result_prefix, DEFAULTS.result_ttl])


def parse_reap(reply: list[Any], reaped: Reaped) -> tuple[list[str], list[str]]:
    """Add what one reap call took back to ``reaped``; returns the (ids, clients) of the
    requests it left for a call that declares their keys ([] when none)."""
    requeued, dead, n = int(reply[0]), int(reply[1]), int(reply[3])
    pending, ids = reply[4:4 + n], reply[4 + n:]  # id, client pairs; the reaped ids
    reaped.requeued += ids[:requeued]
    reaped.dead += ids[requeued:requeued + dead]
    return pending[0::2], pending[1::2]


def fold_call(k: Keys, keep: int, cursor: str, page: int) -> Call:
    """The fold script's KEYS and ARGV (see lua/fold.lua): fold idle tenants' served
    totals past ``keep`` named; look at one ``page`` of counters from ``cursor``."""
    return Call(fixed_keys(k, "fold"), [keep, cursor, page])


def release_call(k: Keys, leases: Sequence[tuple[str, str]]) -> Call:
    """The release script's KEYS and ARGV: the (id, lease token) pairs handed back."""
    return Call(fixed_keys(k, "release"), [v for lease in leases for v in lease])


def workers_call(k: Keys, forget_ms: int) -> Call:
    """The workers script's KEYS and ARGV: count the live workers, forget those silent
    longer than ``forget_ms`` (0: none)."""
    return Call(fixed_keys(k, "workers"), [DEFAULTS.lease_seconds, forget_ms])


def attach_call(k: Keys, request_id: str, token: str, stored: str | bytes, filled: str) -> Call:
    """The attach script's KEYS and ARGV (see lua/attach.lua)."""
    return Call(fixed_keys(k, "attach", cancelled=k.cancelled(request_id),
                           result=k.result(request_id)), [token, stored, filled])


def oldest_call(k: Keys, classes: Sequence[str], limit: int) -> Call:
    """The oldest script's KEYS and ARGV (see lua/oldest.lua)."""
    return Call(fixed_keys(k, "oldest"), [limit, *classes])


def parse_oldest(reply: list[Any]) -> tuple[int, int, dict[str, int]]:
    """(now ms, requests looked at, class -> enqueue ms of its oldest pending request)."""
    pairs = reply[2:]
    return int(reply[0]), int(reply[1]), {pairs[i]: int(pairs[i + 1])
                                          for i in range(0, len(pairs), 2)}


def revive_call(k: Keys, ids: Sequence[str]) -> Call:
    """The revive script's KEYS and ARGV: dead letters sent back to the queue."""
    return Call([*fixed_keys(k, "revive"), *(k.result(i) for i in ids)],
                [k.result_prefix, *ids])


def purge_call(k: Keys, ids: Sequence[str], everything: bool) -> Call:
    """The purge script's KEYS and ARGV: dead letters forgotten for good."""
    return Call(fixed_keys(k, "purge"), [int(everything), *ids])
