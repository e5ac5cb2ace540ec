"""The producer side of ShardedQueue: enqueue (re-routed when the shard count changed),
cancel, lookups and results, reply lists."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from batchery.batching.calls import Cancelled
from batchery.batching.reply_lists import (Popped, parse_reply_read, reply_read, unmark_in,
                                           waiting_in)
from batchery.batching.messages import Result
from batchery.batching.queue import RequestQueue
from batchery.batching.request import Request
from batchery.batching.shard_layout import RELAYOUT_TRIES, ShardLayout, grouped, outcome
from batchery.errors import ConfigError, ShardsChanged


class ProducerCalls(ShardLayout):
    """What producers call (mixed into ShardedQueue)."""

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
        if self.n == 1:
            return self.first.result(request_id)
        found = self.lookup([request_id])[0]
        return found if isinstance(found, Result) else None

    def results(self, ids: Sequence[str]) -> list[Result | None]:
        return self._routed(ids, RequestQueue.results)

    def is_known(self, request_id: str) -> bool:
        if self.n == 1:
            return self.first.is_known(request_id)
        return bool(self.lookup([request_id])[0])

    def forget_results(self, ids: Sequence[str]) -> None:
        self._per_shard(ids, RequestQueue.forget_results)

    def keep_results(self, results: Sequence[Result]) -> None:
        self._per_shard(results, RequestQueue.keep_results, lambda result: result.id)

    def keys_for(self, request_id: str) -> Any:
        return self.shard(request_id).keys

    def pop_replies(self, client_id: str, block_s: float, tags: Sequence[str] | None = None,
                    forget: Sequence[str] = (), parity: int = 0, alone: bool = False,
                    mark: bool = True) -> Popped:
        """Results pushed onto this client's reply lists on the shards ``tags`` (None:
        every shard), in one round trip that first deletes the results of ``forget`` (ids
        the last read delivered) and what the last read (of the other ``parity``) took,
        and with ``mark`` marks the reader there (reading ``alone``):
        reply_lists.reply_read. The tags must
        share a node (a single Redis) or be one (a Cluster: one reader per shard, whose
        results are its own)."""
        shards = [self._shard_at(t).keys for t in tags or self.tags()]
        pipe = self.client.pipeline(transaction=False)
        forgotten = [self.keys_for(i).result(i) for i in forget]
        deletes = reply_read(pipe, shards, client_id, parity, alone, block_s, forgotten,
                             self.cluster, mark)
        replies = pipe.execute(raise_on_error=False)
        return parse_reply_read(replies, deletes, len(shards), mark)

    def replies_waiting(self, client_id: str, tags: Sequence[str], others: bool = False) -> bool:
        """Whether results may be on their way: this client's reply lists or its reads'
        inboxes on the shards ``tags`` hold anything; with ``others`` (results of other
        clients' requests), or a reader that stopped (its mark lapsed) is listed still, on
        any shard: what it left, the reaper has yet to keep under the result keys
        (RequestQueue.drain_readers)."""
        pipe = self.client.pipeline(transaction=False)
        own = waiting_in(pipe, [self._shard_at(t).keys for t in tags], client_id)
        for q in self.shards if others else ():
            pipe.smembers(q.keys.readers)
        found = pipe.execute()
        if any(found[:own]) or not others:
            return any(found[:own])
        listed = [(q.keys, c) for q, members in zip(self.shards, found[own:])
                  for c in members if c != client_id]
        pipe = self.client.pipeline(transaction=False)
        for k, client in listed:
            pipe.exists(k.reader(client))
        return bool(listed) and not all(pipe.execute())

    def unmark_reader(self, client_id: str, tags: Sequence[str], parity: int) -> None:
        """A reader that stops: the last read's inbox deleted (delivered), its marks lifted
        (results are kept under their keys again); what its lists still hold the reaper
        keeps under the keys (lua/drain.lua)."""
        pipe = self.client.pipeline(transaction=False)
        unmark_in(pipe, [self._shard_at(t).keys for t in tags], client_id, parity)
        pipe.execute()

    def active_ids(self, match: str, count: int = 1000) -> list[str]:
        return [i for q in self.shards for i in q.active_ids(match, count)]

