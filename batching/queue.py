"""One queue's operations on Redis: each multi-key change is a single Lua call.

``RequestQueue`` is the synchronous owner of the protocol; the call builders and reply
readers it shares with its asyncio twin are batching/calls.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import redis

from batchery.batching.calls import (ClaimReply, cancel_call, declared_keys, enqueue_call,
                                     lookup_call, memory_full, new_call_id, parse_claim,
                                     parse_clients, parse_enqueue, parse_lookup)
from batchery.batching.inspection import QueueInspection
from batchery.batching.keys import QUEUES, Keys, check_queue_name
from batchery.batching.messages import CANCELLED, Request, Result, stored_trace
from batchery.batching.scripts import Scripts, refined
from batchery.batching.settings import DEFAULTS, QueueSettings

RETRY_BACKOFF_BASE_MS = 500   # first retry after half a second: long enough for a blip to pass
RETRY_BACKOFF_CAP_MS = 60_000
MAX_LOOKAHEAD = 4096          # keeps every variadic call in the claim below Lua's limits
WAKE_TOKENS = 64              # a wake list's length cap, as lua/enqueue.lua trims it


@dataclass
class Reaped:
    """What one reap took back: ids back in the queue, ids dead-lettered."""

    requeued: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)


class RequestQueue(QueueInspection):
    """The Redis protocol of one queue shard, over a synchronous client. Callers open a
    queue with batching/sharded.py's ``open_queue``: one logical queue over its shards."""

    def __init__(self, client: Any, name: str, tag: str | None = None,
                 scripts: Scripts | None = None) -> None:
        self.name = check_queue_name(name)
        self.keys = Keys(tag or name)  # shard 0 is tagged with the queue's own name
        self.client = client
        self.scripts = scripts or Scripts(client)

    def keys_for(self, request_id: str) -> Keys:
        """The keys of the shard that holds ``request_id`` (its generation stream)."""
        return self.keys

    # -- producers -------------------------------------------------------------------
    def register(self) -> None:
        """List the queue for `batchery queue stats` (a separate key: it carries no hash tag)."""
        self.client.sadd(QUEUES, self.name)

    def enqueue(self, requests: Sequence[Request], client_id: str = "",
                shards: int = 1) -> list[bool]:
        """Accept requests all or nothing; True for each new one, False if already known.

        Raises QueueFull (reason ``max_pending`` or ``memory``), or InvalidRequest;
        ShardsChanged when the queue's shard count is not ``shards`` (route again).
        """
        call = enqueue_call(self.keys, requests, client_id, shards)
        try:
            reply = self.scripts.enqueue(call.keys, call.args)
        except redis.OutOfMemoryError as exc:
            raise memory_full(exc) from None
        return parse_enqueue(reply, requests)

    def enqueue_in(self, pipe: Any, requests: Sequence[Request], client_id: str = "",
                   shards: int = 1) -> Callable[[Any], list[bool]]:
        """``enqueue``'s script call, added to the pipeline ``pipe`` (run with
        ``raise_on_error=False``); returns what reads its reply, as ``enqueue`` would
        return or raise. A script the server lost (NOSCRIPT) is loaded and run then."""
        call = enqueue_call(self.keys, requests, client_id, shards)
        pipe.evalsha(self.scripts.enqueue.sha, len(call.keys), *call.keys, *call.args)

        def read(reply: Any) -> list[bool]:
            if isinstance(reply, redis.exceptions.NoScriptError):  # it did not run
                return self.enqueue(requests, client_id, shards)
            if isinstance(reply, redis.ResponseError):
                error = refined(reply)
                raise (memory_full(error) if isinstance(error, redis.OutOfMemoryError) else error)
            return parse_enqueue(reply, requests)
        return read

    def cancel(self, ids: Sequence[str]) -> list[int]:
        """1: cancelled while queued, 2: while running (output discarded), 3: cancelled
        already (a retried call after a lost reply, or an earlier cancel), 0: too late."""
        if not ids:
            return []
        call = cancel_call(self.keys, ids, self.clients(ids))
        return [int(f) for f in self.scripts.cancel(call.keys, call.args)]

    def clients(self, ids: Sequence[str]) -> list[str]:
        """The client each request was enqueued by ('' for none or unknown): whose reply
        list a script will push its result onto, to declare in KEYS."""
        return parse_clients(self.client.hmget(self.keys.sched, list(ids)))

    def result(self, request_id: str) -> Result | None:
        raw = self.client.get(self.keys.result(request_id))
        return Result.from_json(raw, request_id) if raw else None

    def results(self, ids: Sequence[str]) -> list[Result | None]:
        if not ids:
            return []
        raws = self.client.mget([self.keys.result(i) for i in ids])
        return [Result.from_json(r, i) if r else None for r, i in zip(raws, ids)]

    def lookup(self, ids: Sequence[str]) -> list[Result | bool]:
        """Each request's Result; else True while Redis still holds it (queued, running,
        dead-lettered), False when it knows nothing of it. One atomic read."""
        if not ids:
            return []
        call = lookup_call(self.keys, ids)
        return parse_lookup(self.scripts.lookup(call.keys, call.args), ids)

    def pop_replies(self, client_id: str, block_s: float, most: int) -> list[Result]:
        """Results pushed onto a client's reply list: waits up to ``block_s`` for one,
        then takes up to ``most`` in all."""
        key = self.keys.reply(client_id)
        first = self.client.blpop([key], timeout=block_s)
        if not first:
            return []
        rest = self.client.lpop(key, most - 1) or []
        return Result.from_json_many([first[1], *rest])

    def forget_results(self, ids: Sequence[str]) -> None:
        """Delete results that reached their reader (QueueSettings.delete_delivered)."""
        if ids:
            prefix = self.keys.result_prefix
            self.client.delete(*(prefix + i for i in ids))

    def active_ids(self, match: str, count: int = 1000) -> list[str]:
        """Ids of queued or running requests matching the glob ``match`` (a scan of the
        sched hash: small values, ``count`` per round trip)."""
        return [i for i, _ in self.client.hscan_iter(self.keys.sched, match=match, count=count)]

    def is_known(self, request_id: str) -> bool:
        """Queued, running, dead-lettered, or finished with a result."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hexists(self.keys.requests, request_id)
        pipe.exists(self.keys.result(request_id))
        return any(pipe.execute())

    # -- settings ----------------------------------------------------------------------
    def settings(self) -> QueueSettings:
        return QueueSettings.from_redis(self.client.hgetall(self.keys.settings))

    def update_settings(self, **changes: Any) -> QueueSettings:
        new = self.settings().updated(**changes)
        self.write_settings(new)
        return new

    def write_settings(self, settings: QueueSettings, only: Sequence[str] = ()) -> None:
        """Store ``settings`` (``only``: those fields of them) in this shard's hash."""
        flat = settings.to_redis()
        self.client.hset(self.keys.settings, mapping={k: flat[k] for k in only} if only else flat)

    def announce_tokenizer(self, tokenizer: str, max_input_tokens: int) -> QueueSettings:
        """Tell producers how the workers count tokens, where nobody has yet: a tokenizer
        an operator (or an earlier worker) set stays. The settings after."""
        current = self.settings()
        fill: dict[str, Any] = {"tokenizer": tokenizer} if not current.tokenizer else {}
        if not current.max_input_tokens and max_input_tokens:
            fill["max_input_tokens"] = max_input_tokens
        if fill:
            self.client.hset(self.keys.settings, mapping=fill)
        return replace(current, **fill)

    # -- workers -----------------------------------------------------------------------
    def claim(self, token: str, max_batch_size: int, max_batch_tokens: int, max_wait_ms: int,
              lookahead: int, price_estimates: bool = False,
              counts: Sequence[tuple[str, int]] = (), ceiling: float | None = None) -> ClaimReply:
        """Lease the next batch. ``price_estimates``: this worker counts tokens exactly, so
        when candidates are priced by estimate nothing is leased and ``to_price`` lists
        them: count them, claim again with their (id, exact tokens) as ``counts``. The
        claim chooses on those and stores the counts of the ones it leaves queued.
        ``ceiling``: lease nothing ranked above it (a sharded queue's claim)."""
        k = self.keys
        reply = self.scripts.claim(
            [k.pending, k.delayed, k.sched, k.requests, k.attempts, k.leased, k.owner,
             k.settings, k.depth, k.claim(token), k.fair, k.fair_tenants, k.vtc, k.served],
            [token, max_batch_size, max_batch_tokens, max_wait_ms,
             min(lookahead, MAX_LOOKAHEAD), DEFAULTS.lease_seconds, int(price_estimates),
             "" if ceiling is None else int(ceiling), *(v for pair in counts for v in pair)])
        return parse_claim(reply, token)

    def complete(self, items: Sequence[tuple[str, str, str | bytes]], totals: dict[str, int],
                 clients: Sequence[str] | None = None) -> list[bool]:
        """Commit (id, lease token, result JSON) items; False where the lease was lost.

        ``clients``: each item's client (``Claimed.client``); None: read from Redis."""
        if not items:
            return []
        k = self.keys
        ids = [item[0] for item in items]
        clients = self.clients(ids) if clients is None else clients
        args: list[Any] = [k.result_prefix, k.reply_prefix, DEFAULTS.result_ttl,
                           ",".join(f"{name}={n}" for name, n in totals.items() if n)]
        for item, client in zip(items, clients, strict=True):
            args += (*item, client)
        flags = self.scripts.complete([k.requests, k.sched, k.attempts, k.leased, k.owner,
                                       k.settings, k.stats, k.history,
                                       *declared_keys(k, ids, clients)], args)
        return [bool(f) for f in flags]

    def _declared(self, items: Sequence[tuple[str, ...]], clients: Sequence[str] | None) -> list[str]:
        ids = [item[0] for item in items]
        return declared_keys(self.keys, ids, self.clients(ids) if clients is None else clients)

    def fail(self, items: Sequence[tuple[str, str, str | bytes]],
             clients: Sequence[str] | None = None) -> list[int]:
        """Failed (id, lease token, dead result JSON): 1 retried later, 2 dead, 0 lease lost.

        A dead letter's error becomes the run's error followed by how each attempt ended.
        ``clients`` as for :meth:`complete`."""
        if not items:
            return []
        k = self.keys
        args: list[Any] = [k.result_prefix, k.reply_prefix, DEFAULTS.max_attempts,
                           DEFAULTS.result_ttl, RETRY_BACKOFF_BASE_MS, RETRY_BACKOFF_CAP_MS,
                           DEFAULTS.dead_ttl]
        for item in items:
            args += item
        return [int(f) for f in self.scripts.fail(
            [k.requests, k.sched, k.attempts, k.leased, k.owner, k.delayed, k.dead,
             k.settings, k.depth, k.stats, k.history, k.call(new_call_id()),
             *self._declared(items, clients)], args)]

    def renew(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        """Heartbeat: extend held leases; returns the ids this worker no longer holds."""
        k = self.keys
        args: list[Any] = [worker_id, DEFAULTS.lease_seconds]
        for request_id, token in leases:
            args += [request_id, token]
        return list(self.scripts.renew([k.leased, k.owner, k.settings, k.workers], args))

    def head_rank(self) -> float | None:
        """The rank of the most urgent pending request; None when none is pending."""
        head = self.client.zrange(self.keys.pending, 0, 0, withscores=True)
        return head[0][1] if head else None

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for an enqueue's wake-up token; True if one came."""
        return bool(self.client.blpop([self.keys.wake], timeout=timeout_s))

    def wake_again(self) -> None:
        """Put back a wake-up token taken for nothing (what lua/enqueue.lua pushes)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(self.keys.wake, 1)
        pipe.ltrim(self.keys.wake, -WAKE_TOKENS, -1)
        pipe.execute()

    def take_reaper_turn(self, worker_id: str, ms: int) -> bool:
        """True for one worker per ``ms``: it reaps this turn (the others skip)."""
        return bool(self.client.set(self.keys.reaper_lock, worker_id, nx=True, px=ms))

    def depth(self) -> dict[str, int]:
        """Pending requests per priority class."""
        return {c: int(n) for c, n in self.client.hgetall(self.keys.depth).items()
                if ":" not in c}  # tenant:NAME fields count per tenant (see tenant_depth)

    def holders(self, ids: Sequence[str]) -> list[str | None]:
        """The lease token holding each request now; None once it was cancelled or
        finished (one read, for a check between decode steps)."""
        return list(self.client.hmget(self.keys.owner, list(ids))) if ids else []

    def reap(self, limit: int = 1000) -> Reaped:
        """Take back expired leases: back in the queue, or dead-lettered after their last
        attempt; forget dead letters older than dead_ttl."""
        k = self.keys
        fixed = [k.leased, k.owner, k.attempts, k.pending, k.sched, k.dead, k.settings, k.depth,
                 k.stats, k.requests, k.history, k.fair, k.fair_tenants, k.vtc]
        args = [k.result_prefix, k.reply_prefix, DEFAULTS.max_attempts, DEFAULTS.result_ttl,
                limit, DEFAULTS.dead_ttl]
        reaped = Reaped()
        extra: list[str] = []
        for _ in range(2):  # a second call declares the keys of those it dead-letters
            reply = self.scripts.reap(fixed + extra, args)
            requeued, dead, n = int(reply[0]), int(reply[1]), int(reply[3])
            pending, ids = reply[4:4 + n], reply[4 + n:]  # id, client pairs; the reaped ids
            reaped.requeued += ids[:requeued]
            reaped.dead += ids[requeued:requeued + dead]
            if not pending:  # the next beat takes any left
                break
            extra = declared_keys(k, pending[0::2], pending[1::2])
        return reaped

    def traces(self, ids: Sequence[str]) -> list[str | None]:
        """The trace context each stored request carries (None: none, or gone)."""
        raws = self.client.hmget(self.keys.requests, list(ids)) if ids else []
        return [stored_trace(r) for r in raws]

    def release(self, leases: Sequence[tuple[str, str]]) -> int:
        """Return claims this worker will not run to the queue, at their rank."""
        if not leases:
            return 0
        k = self.keys
        args = [v for lease in leases for v in lease]
        return int(self.scripts.release([k.leased, k.owner, k.pending, k.sched, k.depth,
                                         k.fair, k.fair_tenants, k.vtc], args))

    def forget_workers(self, older_than_s: float) -> int:
        """Drop registry entries of workers not heard from in ``older_than_s`` (they died);
        returns how many are live."""
        return self.live_workers(max(1, int(older_than_s * 1000)))

    def live_workers(self, forget_ms: int = 0) -> int:
        """Live workers, on the clock of the node that holds the queue (lua/workers.lua)."""
        k = self.keys
        return int(self.scripts.workers([k.workers, k.settings], [DEFAULTS.lease_seconds, forget_ms]))

    def leave(self, worker_id: str) -> None:
        self.client.zrem(self.keys.workers, worker_id)

    def attach_output(self, request_id: str, token: str, output: Any) -> bool:
        """Put ``output`` into the request's cancelled result, when the cancel found it
        leased under ``token`` and the result has none yet (lua/attach.lua): a generation's
        partial text. False: not this lease's to fill, filled already, or expired."""
        raw = self.client.get(self.keys.result(request_id))
        result = Result.from_json(raw, request_id) if raw else None
        if result is None or result.status != CANCELLED or result.output is not None:
            return False
        filled = replace(result, output=output).to_json()
        return bool(self.scripts.attach([self.keys.cancelled(request_id), self.keys.result(request_id)],
                                        [token, raw, filled]))

