"""What a worker does across the shards of a queue on a single Redis: its reaper takes
back expired leases on every shard, and its idle wait ends for a request on any shard."""

from __future__ import annotations

import threading

import pytest
import redis

from batchery.batching.request import Request
from batchery.batching.sharded import open_queue
from tests.conftest import wait_for
from tests.test_sharding import _timed, configure, ids_on_every_shard

pytestmark = pytest.mark.slow


def test_the_reaper_takes_back_expired_leases_on_every_shard(redis_url: str,
                                                              queue_name: str) -> None:
    """A worker that died holding leases on every shard: the reaper (whose lock lives on
    shard 0) takes them all back, whichever shard holds them."""
    configure(redis_url, queue_name, "--shards", "3", "--lease-seconds", "1")
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    queue = open_queue(conn, queue_name)
    ids = ids_on_every_shard("lapse", 3, 2)
    queue.enqueue([Request(id=i, input=i) for i in ids])
    for shard in queue.shards:  # one claim per shard: the dead worker held them all
        assert len(shard.claim("dead#1", 10, 10_000, 0, 16).batch) == 2
    assert queue.stats()["inflight"] == 6
    reaped = wait_for(lambda: queue.reap().requeued, 30, 0.1, "the leases to lapse and be reaped")
    reaped += queue.reap().requeued  # a shard whose lease lapsed a moment later
    assert sorted(reaped) == sorted(ids)
    assert queue.stats()["pending"] == 6 and queue.stats()["inflight"] == 0
    conn.close()


def test_idle_worker_wakes_for_any_shard_on_one_redis(redis_url: str, queue_name: str) -> None:
    """On a single Redis an idle worker's one BLPOP covers every shard's wake list: a
    request enqueued into any shard ends its wait at once, not at its poll timeout."""
    configure(redis_url, queue_name, "--shards", "3")
    conn = redis.Redis.from_url(redis_url, decode_responses=True, client_name=queue_name)
    queue = open_queue(conn, queue_name)
    for i, request_id in enumerate(ids_on_every_shard("wake", 3, 1)):
        woke: list[float] = []
        waiter = threading.Thread(target=lambda: woke.append(_timed(queue.wait_for_work, 60)))
        waiter.start()
        # blocked in its BLPOP (CLIENT LIST shows the command) before the enqueue
        wait_for(lambda: any(c["cmd"] == "blpop" and c["name"] == queue_name
                             for c in conn.client_list()), 30, 0.01, "the worker to block")
        queue.enqueue([Request(id=request_id, input=i)])
        waiter.join(60)
        assert woke and woke[0] < 30, (request_id, woke)  # far below the 60 s timeout
    conn.close()
