"""One queue's operations on Redis: each multi-key change is a single Lua call.

``RequestQueue`` is the synchronous owner of the protocol; the call builders and reply
readers it shares with its asyncio twin are batching/calls.py's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import redis

from batchery.batching.calls import (KEYS_NEEDED, Call, Cancelled, Failed, Reaped, attach_call,
                                     cancel_call, complete_call, declared_keys, drain_call,
                                     enqueue_call, fail_call, fold_call, lookup_call, memory_full,
                                     parse_cancel, parse_clients, parse_enqueue, parse_fail,
                                     parse_lookup, parse_reap, reap_call, release_call,
                                     renew_call, workers_call)
from batchery.batching.claim_call import (ClaimReply, claim_call, claim_payload_ids, opened,
                                          parse_claim, payloads_read_ahead)
from batchery.batching.inspection import SERVED_KEPT, QueueInspection
from batchery.batching.keys import QUEUES, Keys, check_queue_name
from batchery.batching.messages import CANCELLED, Result, stored_trace
from batchery.batching.reply_lists import entry_id, keep_in, results_in
from batchery.batching.request import Request
from batchery.batching.scripts import Scripts, refined
from batchery.batching.settings import QueueSettings

log = logging.getLogger(__name__)
WAKE_TOKENS = 64              # a wake list's length cap, as lua/enqueue.lua trims it
# Counters one reaper turn looks at for dropping (lua/fold.lua): a page of a few ms, and
# at a turn per lease / 3 more than a million new job ids a day add.
COUNTERS_PAGE = 1000
# A client whose commit had to be keyed is committed keyed at once for this long, then
# keyless is tried again: a new reader marks itself reading alone once its first read went
# through (batching/reply_lists.py), a stopped one seldom comes back.
KEYED_FOR_S = 1.0
KEYED_CLIENTS_KEPT = 10_000   # clients remembered so at most (the lapsed ones dropped then)


class RequestQueue(QueueInspection):
    """The Redis protocol of one queue shard, over a synchronous client. Callers open a
    queue with batching/sharded.py's ``open_queue``: one logical queue over its shards."""

    def __init__(self, client: Any, name: str, tag: str | None = None,
                 scripts: Scripts | None = None) -> None:
        self.name = check_queue_name(name)
        self.keys = Keys(tag or name)  # shard 0 is tagged with the queue's own name
        self.client = client
        self.scripts = scripts or Scripts(client)
        self.counters_cursor = "0"  # where the reaper's walk through the counters is
        # clients whose results a commit stored under their keys lately (no reader reading
        # their list alone then) -> until when (monotonic s) their commits go keyed at once;
        # any other's go keyless first (lua/complete.lua)
        self.keyed_clients: dict[str, float] = {}
        # the payloads of the requests the last claim handed ahead (or to price), as read
        # then: id -> (payload, that claim's now_ms), so that their lease reads them once
        self.read_ahead: dict[str, tuple[Any, int]] = {}

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
        return self._enqueue(enqueue_call(self.keys, requests, client_id, shards), requests)

    def _enqueue(self, call: Call, requests: Sequence[Request]) -> list[bool]:
        try:
            reply = self._run("enqueue", call)
        except redis.OutOfMemoryError as exc:
            raise memory_full(exc) from None
        return parse_enqueue(reply, requests)

    def enqueue_in(self, pipe: Any, requests: Sequence[Request], client_id: str = "",
                   shards: int = 1) -> Callable[[Any], list[bool]]:
        """``enqueue``'s script call, added to the pipeline ``pipe`` (run with
        ``raise_on_error=False``); returns what reads its reply, as ``enqueue`` would
        return or raise. A script the server lost (NOSCRIPT) is loaded and the same call run
        then: the pipeline may be the connection's retry of one whose first run's reply was
        lost, which the script answers again from its memory under the call's key."""
        call = enqueue_call(self.keys, requests, client_id, shards)
        pipe.evalsha(self.scripts.enqueue.sha, len(call.keys), *call.keys, *call.args)

        def read(reply: Any) -> list[bool]:
            if isinstance(reply, redis.exceptions.NoScriptError):  # this attempt did not run
                return self._enqueue(call, requests)
            if isinstance(reply, redis.ResponseError):
                error = refined(reply)
                raise (memory_full(error) if isinstance(error, redis.OutOfMemoryError) else error)
            return parse_enqueue(reply, requests)
        return read

    def cancel(self, ids: Sequence[str]) -> list[Cancelled]:
        """What became of each id: cancelled while queued, while running (its output
        discarded), already, or not (too late, or unknown)."""
        if not ids:
            return []
        return parse_cancel(self._run("cancel", cancel_call(self.keys, ids, self.clients(ids))))

    def _run(self, script: str, call: Call) -> Any:
        return getattr(self.scripts, script)(call.keys, call.args)

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
        return parse_lookup(self._run("lookup", lookup_call(self.keys, ids)), ids)

    def pop_replies(self, client_id: str, most: int) -> list[Result]:
        """The results of up to ``most`` entries taken off a client's reply list (an entry
        of a keyless commit holds a run's), no reader marked (the commits keep them under
        their keys too): a look at a list for tools and tests;
        clients read theirs with ShardedQueue.pop_replies."""
        return Result.from_json_many(results_in(self.client.lpop(self.keys.reply(client_id), most)
                                                or []))

    def keep_results(self, results: Sequence[Result]) -> None:
        """Store results under their keys for result_ttl: those a reader popped from a
        list they were pushed onto alone (reply_lists.Popped) and that reached nobody, so that
        they stay readable by id as the others do."""
        if results:
            pipe = self.client.pipeline(transaction=False)
            keep_in(pipe, self.keys, results, self.settings().result_ttl)
            pipe.execute()

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
              counts: Sequence[tuple[str, int]] = (), ceiling: float | None = None,
              batches: int = 1) -> ClaimReply:
        """Lease the next batch (``batches`` 2: a deep queue's next one too, under its own
        ``lease_token``). ``price_estimates``: a worker that counts tokens is handed the
        estimated candidates (``to_price``) and claims again with their (id, exact tokens)
        as ``counts``. ``ceiling``: lease nothing ranked above it (a sharded queue's)."""
        call = claim_call(self.keys, token, max_batch_size, max_batch_tokens, max_wait_ms,
                          lookahead, price_estimates, counts, ceiling, batches)
        reply = opened(self._run("claim", call))
        ids = claim_payload_ids(reply)  # read after the script: a plain read costs Redis less
        known = payloads_read_ahead(reply, self.read_ahead)
        to_read = [i for n, i in enumerate(ids) if n not in known]
        read = iter(self.client.hmget(self.keys.requests, to_read) if to_read else ())
        payloads = [known[n] if n in known else next(read) for n in range(len(ids))]
        claimed = parse_claim(reply, token, payloads)
        if claimed.nothing_pending:
            self.read_ahead = {}
        elif ids:  # those handed ahead, or to price: the next claim's batch, likely
            n_leased = len(claimed.batch) + len(claimed.expired)
            self.read_ahead = {i: (p, claimed.now_ms) for i, p
                               in zip(ids[n_leased:], payloads[n_leased:]) if p is not None}
        return claimed

    def complete(self, items: Sequence[tuple[str, str, str | bytes]], totals: dict[str, int],
                 clients: Sequence[str] | None = None) -> list[bool]:
        """Commit (id, lease token, result JSON) items; False where the lease was lost.

        ``clients``: each item's client (``Claimed.client``); None: read from Redis."""
        if not items:
            return []
        clients = self.clients([item[0] for item in items]) if clients is None else clients
        now = time.monotonic()
        if all(clients) and not any(self.keyed_clients.get(c, 0) > now for c in set(clients)):
            # keyless: a key a request fewer
            flags = self._run("complete", complete_call(self.keys, items, totals, clients, keyed=False))
            if not flags.startswith(KEYS_NEEDED):
                return [f == "1" for f in flags]  # a digit a request (lua/complete.lua)
            if len(self.keyed_clients) >= KEYED_CLIENTS_KEPT:
                self.keyed_clients = {c: t for c, t in self.keyed_clients.items() if t > now}
            until = now + KEYED_FOR_S
            self.keyed_clients.update((c, until) for c in flags.split("\n")[1:])
        flags = self._run("complete", complete_call(self.keys, items, totals, clients))
        return [f == "1" for f in flags]

    def fail(self, items: Sequence[tuple[str, str, str | bytes]],
             clients: Sequence[str] | None = None) -> list[Failed]:
        """Failed (id, lease token, dead result JSON): each retried later, dead, or its
        lease lost.

        A dead letter's error becomes the run's error followed by how each attempt ended.
        ``clients`` as for :meth:`complete`."""
        if not items:
            return []
        clients = self.clients([item[0] for item in items]) if clients is None else clients
        return parse_fail(self._run("fail", fail_call(self.keys, items, clients)))

    def renew(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        """Heartbeat: extend held leases; returns the ids this worker no longer holds."""
        return list(self._run("renew", renew_call(self.keys, worker_id, leases)))

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

    def holders(self, leases: Sequence[tuple[str, str]]) -> list[str | None]:
        """For each (id, lease token): the token while that claim still holds the request;
        '' once that claim no longer holds it but Redis still does (another claim holds
        it, it is queued again or waits for a retry, it was dead-lettered); None once it
        was cancelled or finished. One read (two when some is no longer held), for a
        check between decode steps."""
        if not leases:
            return []
        tokens = list(dict.fromkeys(token for _, token in leases))
        held = {token: set(text.split("\n")) for token, text
                in zip(tokens, self.client.hmget(self.keys.lease_ids, tokens)) if text}
        out: list[str | None] = [token if i in held.get(token, ()) else None for i, token in leases]
        lost = [n for n, token in enumerate(out) if token is None]
        if lost:
            pipe = self.client.pipeline(transaction=False)
            for n in lost:
                pipe.hexists(self.keys.requests, leases[n][0])
            for n, queued in zip(lost, pipe.execute()):
                out[n] = "" if queued else None
        return out

    def reap(self, limit: int = 1000) -> Reaped:
        """Take back expired leases: back in the queue, or dead-lettered after their last
        attempt; forget dead letters older than dead_ttl."""
        reaped, declared = Reaped(), []
        for _ in range(2):  # a second call declares the keys of those it dead-letters
            ids, clients = parse_reap(self._run("reap", reap_call(self.keys, limit, declared)),
                                      reaped)
            if not ids:  # the next beat takes any left
                break
            declared = declared_keys(self.keys, ids, clients)
        try:
            self.fold_tenants()
        except redis.ResponseError as exc:  # e.g. a worker ACL from before the fold (no +hlen)
            log.warning("reaper: could not fold the tenants' totals (%s): the reaping stands", exc)
        try:
            self.drain_readers()
        except redis.ResponseError as exc:  # e.g. a worker ACL from before the readers
            log.warning("reaper: could not keep what stopped clients' readers left on their "
                        "reply lists (%s): grant the worker the commands of "
                        "docs/guides/least-privilege.md, or those results expire with "
                        "their lists", exc)
        return reaped

    def drain_readers(self) -> int:
        """Keep under their result keys the results that readers which stopped (their
        marks lapsed: closed, or died) left on their lists (lua/drain.lua); returns how
        many. A reader back before its turn is left alone."""
        k = self.keys
        clients = sorted(self.client.smembers(k.readers))
        if not clients:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for client in clients:
            pipe.exists(k.reader(client))
        stopped = [c for c, live in zip(clients, pipe.execute()) if not live]
        if not stopped:
            return 0
        pipe = self.client.pipeline(transaction=False)  # every stopped reader's lists at once
        for client in stopped:
            for key in (k.inbox(client, 0), k.inbox(client, 1), k.reply(client)):
                pipe.lrange(key, 0, -1)
        lists = pipe.execute()
        kept = 0
        for n, client in enumerate(stopped):
            entries = results_in([e for found in lists[3 * n:3 * n + 3] for e in found])
            ids = [i for i in map(entry_id, entries) if i is not None]
            kept += max(0, int(self._run("drain", drain_call(k, client, ids))))
        return kept

    def fold_tenants(self, keep: int = SERVED_KEPT) -> int:
        """Keep the per-tenant fields bounded (lua/fold.lua): past ``keep`` tenants served,
        the idle ones served least are summed into one total; one page of counters at
        their class's floor is dropped. Returns the tenants folded."""
        reply = self._run("fold", fold_call(self.keys, keep, self.counters_cursor, COUNTERS_PAGE))
        cursor = reply[1]
        self.counters_cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        return int(reply[0])

    def traces(self, ids: Sequence[str]) -> list[str | None]:
        """The trace context each stored request carries (None: none, or gone)."""
        raws = self.client.hmget(self.keys.requests, list(ids)) if ids else []
        return [stored_trace(r) for r in raws]

    def release(self, leases: Sequence[tuple[str, str]]) -> int:
        """Return claims this worker will not run to the queue, at their rank."""
        if not leases:
            return 0
        return int(self._run("release", release_call(self.keys, leases)))

    def forget_workers(self, older_than_s: float) -> int:
        """Drop registry entries of workers not heard from in ``older_than_s`` (they died);
        returns how many are live."""
        return self.live_workers(max(1, int(older_than_s * 1000)))

    def live_workers(self, forget_ms: int = 0) -> int:
        """Live workers, on the clock of the node that holds the queue (lua/workers.lua)."""
        return int(self._run("workers", workers_call(self.keys, forget_ms)))

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
        return bool(self._run("attach", attach_call(self.keys, request_id, token, raw, filled)))

