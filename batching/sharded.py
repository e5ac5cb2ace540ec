"""One logical queue over N shards: N hash tags, so N Redis Cluster slots (and nodes).

``open_queue(client, name)`` is how every caller opens a queue. The shard count is the
queue setting ``shards`` (`batchery queue config Q --shards N`), stored in every shard's
settings hash. Shard 0 is today's single-slot queue, tagged ``{Q}``; shard i >= 1 has
the tag ``keys.shard_tags`` gives it. A request lives on the shard of its id
(``shard_of``: CRC32 of the id mod N), so a retried enqueue of an id meets its first one.

``ShardedQueue`` has RequestQueue's interface, split by role: the layout and routing
(shard_layout.py: calls keyed by id go to their ids' shards, one call per shard, replies
back in the caller's order; with one shard, straight to it), producers' calls
(shard_producer.py: an enqueue's calls go out at once), workers' (shard_worker.py: the
worker registry, heartbeat reports and the reaper lock live on shard 0), claiming
across shards with the aging rule kept within SHARD_SLACK_MS (shard_claim.py), and
operators' (shard_operator.py: aggregates read every shard).
"""

from __future__ import annotations

from typing import Any

from batchery.batching.shard_claim import ShardClaims
from batchery.batching.shard_operator import OperatorCalls
from batchery.batching.shard_producer import ProducerCalls
from batchery.batching.shard_worker import WorkerCalls


def open_queue(client: Any, name: str) -> "ShardedQueue":
    """The queue ``name`` over its shards, as its settings say (read at its first call)."""
    return ShardedQueue(client, name)


class ShardedQueue(ProducerCalls, WorkerCalls, OperatorCalls, ShardClaims):
    """One logical queue over its shards (each a RequestQueue), with RequestQueue's calls:
    the layout and routing (shard_layout.py), and the calls of each role."""
