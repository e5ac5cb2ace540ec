"""The shard layout of one logical queue: its shards and the routing of calls to them.

A queue of N shards has N hash tags (batching/keys.py ``shard_tags``), so N Redis Cluster
slots. A request lives on the shard of its id (``shard_of``: CRC32 of the id mod N), so a
retried enqueue of an id meets its first one. ``ShardLayout`` reads the count from the
queue's settings (shard 0's hash) and routes calls keyed by id to their shards, one call
per shard, replies back in the caller's order; with one shard a call goes straight to it.
The roles built on it: shard_producer.py, shard_worker.py, shard_operator.py and
shard_claim.py, gathered in ``ShardedQueue`` (sharded.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import redis

from batchery.batching.keys import shard_of, shard_tags
from batchery.batching.queue import RequestQueue
from batchery.batching.scripts import Scripts
from batchery.batching.settings import QueueSettings

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


class ShardLayout:
    """A logical queue's shards (each a RequestQueue) and how calls reach them."""

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.scripts = Scripts(client)
        self.first = RequestQueue(client, name, scripts=self.scripts)
        self.name, self.keys = self.first.name, self.first.keys
        self.cluster = is_cluster(client)
        self._shards: tuple[RequestQueue, ...] = ()  # () until the settings are read
        self.route_listeners: list[Callable[[Sequence[str]], None]] = []
        self._senders: ThreadPoolExecutor | None = None  # a multi-shard enqueue's, on a Cluster

    def forked(self, listener: Callable[[Sequence[str]], None] | None) -> None:
        """In a forked child: the parent's enqueue threads did not cross the fork, so its
        pool is dropped (not shut down: that waits on them), and the parent's reply reader
        (``listener``) no longer follows the routes."""
        self._senders = None
        if listener in self.route_listeners:
            self.route_listeners.remove(listener)

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
        """Use the layout of ``n`` shards."""
        if n == len(self._shards):
            return
        self._shards = tuple(self.first if tag == self.name else
                            RequestQueue(self.client, self.name, tag, self.scripts)
                            for tag in shard_tags(self.name, n))

    def tags(self) -> list[str]:
        return [q.keys.tag for q in self.shards]

    def shard(self, request_id: str) -> RequestQueue:
        shards = self.shards
        return shards[shard_of(request_id, len(shards))]

    def _routed(self, items: Sequence[Any], call: Callable[[RequestQueue, list[Any]], Sequence[Any]],
                id_of: Callable[[Any], str] = str) -> list[Any]:
        """``call(shard, its items)`` per shard (an item's shard: its id's, ``id_of``);
        the replies, one per item, back in ``items``' order."""
        shards = self.shards
        if len(shards) == 1:  # one shard: its own call, nothing to split or merge
            return list(call(shards[0], list(items)))
        out = [None] * len(items)
        for i, positions in grouped([id_of(x) for x in items], len(shards)).items():
            for p, value in zip(positions, call(shards[i], [items[p] for p in positions])):
                out[p] = value
        return out

    def _per_shard(self, items: Sequence[Any], call: Callable[[RequestQueue, list[Any]], Any],
                   id_of: Callable[[Any], str] = str) -> list[Any]:
        """``call(shard, its items)`` per shard; one reply per shard."""
        shards = self.shards
        if len(shards) == 1:
            return [call(shards[0], list(items))]
        return [call(shards[i], [items[p] for p in positions])
                for i, positions in grouped([id_of(x) for x in items], len(shards)).items()]

    def _shard_at(self, tag: str) -> RequestQueue:
        return next((q for q in self.shards if q.keys.tag == tag), None) or \
            RequestQueue(self.client, self.name, tag, self.scripts)

    def settings(self) -> QueueSettings:
        """Shard 0's settings (every shard holds the same); the layout follows them."""
        current = self.first.settings()
        self._layout(current.shards)
        return current
