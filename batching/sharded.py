"""One logical queue over N shards: N hash tags, so N Redis Cluster slots (and nodes).

``open_queue(client, name)`` is how every caller opens a queue. The shard count is the
queue setting ``shards`` (`batchery queue config Q --shards N`), stored in every shard's
settings hash. Shard 0 is today's single-slot queue, tagged ``{Q}``; shard i >= 1 has
the tag ``keys.shard_tags`` gives it. A request lives on the shard of its id
(``shard_of``: CRC32 of the id mod N), so a retried enqueue of an id meets its first one.

``ShardedQueue`` has RequestQueue's interface. Calls keyed by id go to their ids'
shards (one call per shard, replies back in the caller's order; an enqueue's calls go
out at once); aggregates read every shard; the worker registry, heartbeat reports and
the reaper lock live on shard 0. With one shard the id-keyed calls are shard 0's own
methods: no cost added. Claiming across shards (the aging rule kept within
SHARD_SLACK_MS) is batching/shard_claim.py's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import redis

from batchery.batching.keys import shard_of, shard_tags
from batchery.batching.messages import Result
from batchery.batching.request import Request
from batchery.batching.inspection import OLDEST_LOOKAHEAD, dead_results, merge_loads, top_tenants
from batchery.batching.calls import Cancelled, Failed, Reaped
from batchery.batching.queue import RequestQueue
from batchery.batching.scripts import Scripts
from batchery.batching.settings import QueueSettings
from batchery.batching.shard_claim import ShardClaims
from batchery.errors import ConfigError, ShardsChanged

# Calls that go to shard 0 when the queue has one shard: bound to it, so they cost nothing.
DIRECT = ("cancel", "clients", "result", "results", "lookup", "forget_results", "complete",
          "fail", "release", "holders", "traces", "inputs", "attach_output", "keys_for",
          "is_known", "head_rank", "renew", "reap", "depth", "oldest", "revive",
          "purge", "active_ids")
RELAYOUT_TRIES = 3  # enqueue re-routes this often after a shard count change, then gives up


def is_cluster(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    return isinstance(client, (redis.cluster.RedisCluster, AsyncRedisCluster))


def grouped(ids: Sequence[str], shards: int) -> dict[int, list[int]]:
    """Shard -> the positions in ``ids`` of the ids it holds."""
    groups: dict[int, list[int]] = {}
    for position, request_id in enumerate(ids):
        groups.setdefault(shard_of(request_id, shards), []).append(position)
    return groups


def first_field(item: Any) -> str:
    return item[0]


def outcome(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or the exception it raised."""
    try:
        return call(*args)
    except Exception as exc:
        return exc


def open_queue(client: Any, name: str) -> "ShardedQueue":
    """The queue ``name`` over its shards, as its settings say (read at its first call)."""
    return ShardedQueue(client, name)


class ShardedQueue(ShardClaims):
    """One logical queue over its shards (each a RequestQueue), with RequestQueue's calls."""

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.scripts = Scripts(client)
        self.first = RequestQueue(client, name, scripts=self.scripts)
        self.name, self.keys = self.first.name, self.first.keys
        self.cluster = is_cluster(client)
        self._shards: tuple[RequestQueue, ...] = ()  # () until the settings are read
        self.route_listeners: list[Callable[[Sequence[str]], None]] = []
        self._senders: ThreadPoolExecutor | None = None  # a multi-shard enqueue's, on a Cluster

    @property
    def shards(self) -> tuple[RequestQueue, ...]:  # type: ignore[override]
        """The shards in force; the first call reads how many (no Redis call before)."""
        if not self._shards:
            self.settings()
        return self._shards

    @property
    def n(self) -> int:
        return len(self.shards)

    def _layout(self, n: int) -> None:
        """Use the layout of ``n`` shards; bind shard 0's own calls when ``n`` is 1."""
        if n == len(self._shards):
            return
        self._shards = tuple(self.first if tag == self.name else
                            RequestQueue(self.client, self.name, tag, self.scripts)
                            for tag in shard_tags(self.name, n))
        for call in DIRECT:
            if n == 1:
                setattr(self, call, getattr(self.first, call))
            else:
                self.__dict__.pop(call, None)

    def tags(self) -> list[str]:
        return [q.keys.tag for q in self.shards]

    def shard(self, request_id: str) -> RequestQueue:
        shards = self.shards
        return shards[shard_of(request_id, len(shards))]

    def _routed(self, items: Sequence[Any], call: Callable[[RequestQueue, list[Any]], Sequence[Any]],
                id_of: Callable[[Any], str] = str) -> list[Any]:
        """``call(shard, its items)`` per shard (an item's shard: its id's, ``id_of``);
        the replies, one per item, back in ``items``' order."""
        shards, out = self.shards, [None] * len(items)
        for i, positions in grouped([id_of(x) for x in items], len(shards)).items():
            for p, value in zip(positions, call(shards[i], [items[p] for p in positions])):
                out[p] = value
        return out

    def _per_shard(self, items: Sequence[Any], call: Callable[[RequestQueue, list[Any]], Any],
                   id_of: Callable[[Any], str] = str) -> list[Any]:
        """``call(shard, its items)`` per shard; one reply per shard."""
        shards = self.shards
        return [call(shards[i], [items[p] for p in positions])
                for i, positions in grouped([id_of(x) for x in items], len(shards)).items()]

    # -- producers -----------------------------------------------------------------------
    def register(self) -> None:
        self.first.register()

    def follow_routes(self, listener: Callable[[Sequence[str]], None]) -> None:
        """Call ``listener`` with the tags of the shards each enqueue (with a client id)
        is about to send to: the client's reply listener reads their reply lists."""
        self.route_listeners.append(listener)

    def enqueue(self, requests: Sequence[Request], client_id: str = "") -> list[bool]:
        """Accept requests, all or nothing per shard (one script call per shard their ids
        fall on, sent at once); a shard count changed since this queue read it is read
        again and the requests re-routed. Raises what RequestQueue.enqueue raises."""
        for attempt in range(RELAYOUT_TRIES):
            shards = self.shards
            try:
                return self._enqueue(shards, requests, client_id)
            except ShardsChanged as changed:
                if attempt == RELAYOUT_TRIES - 1:
                    raise ConfigError(f"queue {self.name!r} keeps changing its shard count "
                                      f"(now {changed.shards}); enqueue again") from None
                self.settings()
        raise AssertionError("unreachable")

    def _enqueue(self, shards: tuple[RequestQueue, ...], requests: Sequence[Request],
                 client_id: str) -> list[bool]:
        n = len(shards)
        if n == 1:
            if client_id:
                for listener in self.route_listeners:
                    listener((self.name,))
            return shards[0].enqueue(requests, client_id, 1)
        groups = grouped([r.id for r in requests], n)
        if client_id:
            for listener in self.route_listeners:
                listener([shards[i].keys.tag for i in groups])
        parts = [(shards[i], [requests[p] for p in positions]) for i, positions in groups.items()]
        flags = [False] * len(requests)
        for positions, accepted in zip(groups.values(), self._enqueue_parts(parts, client_id, n)):
            for p, flag in zip(positions, accepted):
                flags[p] = flag
        return flags

    def _enqueue_parts(self, parts: list[tuple[RequestQueue, list[Request]]], client_id: str,
                       n: int) -> list[list[bool]]:
        """Each shard's enqueue of its part, all sent at once rather than one shard after
        another: on a single Redis in one pipeline, on a Cluster (whose pipelines refuse
        EVALSHA) from threads. Once every part is answered, the first error (in ``parts``'
        order) is raised: all or nothing holds per shard."""
        if self.cluster:  # the first part from this thread, the others from the pool's
            if self._senders is None:
                self._senders = ThreadPoolExecutor(thread_name_prefix="batchery-enqueue")
            sent = [self._senders.submit(outcome, q.enqueue, part, client_id, n)
                    for q, part in parts[1:]]
            first, part = parts[0]
            outcomes = [outcome(first.enqueue, part, client_id, n), *(f.result() for f in sent)]
        else:
            pipe = self.client.pipeline(transaction=False)
            readers = [q.enqueue_in(pipe, part, client_id, n) for q, part in parts]
            outcomes = [outcome(read, reply)
                        for read, reply in zip(readers, pipe.execute(raise_on_error=False))]
        for result in outcomes:
            if isinstance(result, Exception):
                raise result
        return outcomes

    def cancel(self, ids: Sequence[str]) -> list[Cancelled]:
        return self._routed(ids, RequestQueue.cancel)

    def clients(self, ids: Sequence[str]) -> list[str]:
        return self._routed(ids, RequestQueue.clients)

    def lookup(self, ids: Sequence[str]) -> list[Result | bool]:
        """As RequestQueue.lookup; an id its shard knows nothing of is looked for on the
        others (a result written before the shard count changed)."""
        found = self._routed(ids, RequestQueue.lookup)
        missing = [p for p, f in enumerate(found) if f is False]
        for other in self.shards if missing else ():
            hits = other.lookup([ids[p] for p in missing])
            for p, hit in zip(missing, hits):
                found[p] = hit if hit is not False else found[p]
            missing = [p for p in missing if found[p] is False]
            if not missing:
                break
        return found

    def result(self, request_id: str) -> Result | None:
        found = self.lookup([request_id])[0]
        return found if isinstance(found, Result) else None

    def results(self, ids: Sequence[str]) -> list[Result | None]:
        return self._routed(ids, RequestQueue.results)

    def is_known(self, request_id: str) -> bool:
        return bool(self.lookup([request_id])[0])

    def forget_results(self, ids: Sequence[str]) -> None:
        self._per_shard(ids, RequestQueue.forget_results)

    def keys_for(self, request_id: str) -> Any:
        return self.shard(request_id).keys

    def pop_replies(self, client_id: str, block_s: float, most: int,
                    tags: Sequence[str] | None = None) -> list[Result]:
        """Results pushed onto this client's reply lists on the shards ``tags`` (None:
        every shard), in one blocking read: the tags must share a node (a single Redis)
        or be one (a Cluster: one reader per shard)."""
        keys = [self._shard_at(t).keys.reply(client_id) for t in tags or self.tags()]
        first = self.client.blpop(keys, timeout=block_s)
        if not first:
            return []
        rest = self.client.lpop(first[0], most - 1) or []
        return Result.from_json_many([first[1], *rest])

    def active_ids(self, match: str, count: int = 1000) -> list[str]:
        return [i for q in self.shards for i in q.active_ids(match, count)]

    # -- settings ------------------------------------------------------------------------
    def settings(self) -> QueueSettings:
        """Shard 0's settings (every shard holds the same); the layout follows them."""
        current = self.first.settings()
        self._layout(current.shards)
        return current

    def update_settings(self, **changes: Any) -> QueueSettings:
        """Write the changed settings to every shard. A new shard count is refused unless
        the queue is empty on every shard; then the retired shards get it too, so a
        producer still routing by the old count is refused there and routes again."""
        current = self.settings()
        new = current.updated(**changes)
        old_tags = self.tags()
        if new.shards != current.shards:
            self._check_empty(new.shards)
        new_tags = shard_tags(self.name, new.shards)
        # retired shards first (a stale producer is refused there), shard 0 last (it is
        # where producers read the count from)
        tags = [*(t for t in old_tags if t not in new_tags), *new_tags[::-1]]
        for tag in tags:
            self._shard_at(tag).write_settings(new)
        self._layout(new.shards)
        if new.shards != current.shards and not self._empty(old_tags):
            for tag in tags:  # an enqueue slipped in as the layout changed: undo
                self._shard_at(tag).write_settings(current)
            self._layout(current.shards)
            raise ConfigError(f"queue {self.name!r}: requests arrived while its shard count "
                              "changed, so it was left unchanged; try again once it is empty")
        return new

    def _shard_at(self, tag: str) -> RequestQueue:
        return next((q for q in self.shards if q.keys.tag == tag), None) or \
            RequestQueue(self.client, self.name, tag, self.scripts)

    def _held(self, tags: Sequence[str]) -> dict[str, int]:
        """What the shards ``tags`` hold together: pending, delayed, in flight, dead."""
        held: dict[str, int] = {}
        for tag in tags:
            for name, count in self._shard_at(tag).held().items():
                held[name] = held.get(name, 0) + count
        return held

    def _empty(self, tags: Sequence[str]) -> bool:
        return not any(self._held(tags).values())

    def _check_empty(self, shards: int) -> None:
        held = self._held(self.tags())
        if any(held.values()):
            what = ", ".join(f"{n} {name}" for name, n in held.items() if n)
            raise ConfigError(
                f"queue {self.name!r} cannot go from {self.n} to {shards} shard(s) while it "
                f"holds requests ({what}): stop its producers, let the workers drain it, "
                f"retry or purge its dead letters (`batchery queue dead retry|purge --all -q "
                f"{self.name}`), then change it")

    def announce_tokenizer(self, tokenizer: str, max_input_tokens: int) -> QueueSettings:
        settings = self.first.announce_tokenizer(tokenizer, max_input_tokens)
        for q in self.shards[1:]:
            q.write_settings(settings, only=("tokenizer", "max_input_tokens"))
        return settings

    # -- workers (claim, head_rank and wait_for_work: ShardClaims) ----------------------
    def complete(self, items: Sequence[tuple[str, str, str | bytes]], totals: dict[str, int],
                 clients: Sequence[str] | None = None) -> list[bool]:
        """Commit per shard; the batch totals are counted once, on the first."""
        clients = self.clients([i[0] for i in items]) if clients is None else clients
        first = [totals]

        def commit(q: RequestQueue, part: list[Any]) -> list[bool]:
            once = first.pop() if first else {}
            return q.complete([p[0] for p in part], once, [p[1] for p in part])
        return self._routed(list(zip(items, clients)), commit, lambda pair: pair[0][0])

    def fail(self, items: Sequence[tuple[str, str, str | bytes]],
             clients: Sequence[str] | None = None) -> list[Failed]:
        clients = self.clients([i[0] for i in items]) if clients is None else clients
        return self._routed(list(zip(items, clients)),
                            lambda q, part: q.fail([p[0] for p in part], [p[1] for p in part]),
                            lambda pair: pair[0][0])

    def release(self, leases: Sequence[tuple[str, str]]) -> int:
        return sum(self._per_shard(leases, RequestQueue.release, first_field))

    def renew(self, worker_id: str, leases: Sequence[tuple[str, str]]) -> list[str]:
        """Renew on shard 0 always (the worker registry) and on the shards holding leases."""
        shards = self.shards
        groups = grouped([lease[0] for lease in leases], len(shards))
        groups.setdefault(0, [])
        return [lost for i, positions in groups.items()
                for lost in shards[i].renew(worker_id, [leases[p] for p in positions])]

    def holders(self, ids: Sequence[str]) -> list[str | None]:
        return self._routed(ids, RequestQueue.holders)

    def traces(self, ids: Sequence[str]) -> list[str | None]:
        return self._routed(ids, RequestQueue.traces)

    def inputs(self, ids: Sequence[str]) -> list[Any]:
        return self._routed(ids, RequestQueue.inputs)

    def attach_output(self, request_id: str, token: str, output: Any) -> bool:
        return self.shard(request_id).attach_output(request_id, token, output)

    def reap(self, limit: int = 1000) -> Reaped:
        reaped = Reaped()
        for q in self.shards:
            one = q.reap(limit)
            reaped.requeued += one.requeued
            reaped.dead += one.dead
        return reaped

    def take_reaper_turn(self, worker_id: str, ms: int) -> bool:
        return self.first.take_reaper_turn(worker_id, ms)

    def forget_workers(self, older_than_s: float) -> int:
        """Forget silent workers on every shard (renew registers them where they hold
        leases); the live count is shard 0's, where every worker beats."""
        for q in self.shards[1:]:
            q.forget_workers(older_than_s)
        return self.first.forget_workers(older_than_s)

    def live_workers(self, forget_ms: int = 0) -> int:
        return self.first.live_workers(forget_ms)

    def leave(self, worker_id: str) -> None:
        for q in self.shards:
            q.leave(worker_id)

    def publish_worker(self, worker_id: str, info: dict[str, Any], lease_seconds: float) -> None:
        self.first.publish_worker(worker_id, info, lease_seconds)

    def worker_reports(self) -> tuple[int, list[dict[str, Any]]]:
        return self.first.worker_reports()

    # -- observation ---------------------------------------------------------------------
    def depth(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for q in self.shards:
            for c, n in q.depth().items():
                total[c] = total.get(c, 0) + n
        return total

    def top_tenants(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """The most loaded tenants over every shard, and the rest summed (top_tenants)."""
        return top_tenants(merge_loads(*(q.tenant_loads() for q in self.shards)))

    def oldest(self, classes: Sequence[str], limit: int = OLDEST_LOOKAHEAD) -> tuple[int, int, dict[str, int]]:
        now, looked, oldest = 0, 0, {}
        for q in self.shards:
            at, n, found = q.oldest(classes, limit)
            now, looked = max(now, at), looked + n
            for c, ms in found.items():
                oldest[c] = min(ms, oldest.get(c, ms))
        return now, looked, oldest

    def stats(self) -> dict[str, Any]:
        """RequestQueue.stats summed over the shards (paused and workers: shard 0's),
        and ``shards``."""
        merged = self.first.stats()
        for q in self.shards[1:]:
            s = q.stats(workers=False)
            for name in ("pending", "delayed", "inflight", "dead"):
                merged[name] += s[name]
            for group in ("pending_by_priority", "totals"):
                for k, v in s[group].items():
                    merged[group][k] = merged[group].get(k, 0) + v
        if self.n > 1:
            merged["tenants"], merged["tenants_other"] = self.top_tenants()
        merged["pending_by_priority"] = dict(sorted(merged["pending_by_priority"].items()))
        merged["totals"] = dict(sorted(merged["totals"].items()))
        return {**merged, "shards": self.n}

    @staticmethod
    def known_queues(client: Any) -> list[str]:
        return RequestQueue.known_queues(client)

    # -- dead letters --------------------------------------------------------------------
    def dead(self, limit: int = 100) -> list[Result]:
        """Dead letters of every shard, newest first."""
        entries = sorted((e for q in self.shards for e in q.dead_entries(limit)),
                         key=lambda e: -e[1])[:limit]
        ids = [i for i, _ in entries]
        return dead_results(ids, self.results(ids))

    def revive(self, ids: Sequence[str] = (), everything: bool = False) -> int:
        if everything:
            return sum(q.revive(everything=True) for q in self.shards)
        return sum(self._per_shard(ids, RequestQueue.revive))

    def purge(self, ids: Sequence[str] = (), everything: bool = False) -> int:
        if everything:
            return sum(q.purge(everything=True) for q in self.shards)
        return sum(self._per_shard(ids, RequestQueue.purge))
