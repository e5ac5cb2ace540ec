"""The result writer's group commit: the batches of one shard waiting to be written when
it comes to them go in one complete call, in order with the token streams written between
them; a group Redis refuses for good is written again a batch at a time, so only the
batch at fault gives up."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis

from batchery import Client
from batchery.batching.sharded import ShardedQueue, open_queue
from batchery.connection import RedisSettings
from batchery.workers.execution import Executed, ModelRun, Outcome
from batchery.workers.leases import Leases
from batchery.workers.results import ResultWriter
from tests.test_sharding import ids_on_every_shard

BATCH = 4


def claimed_batches(queue: Any, n: int, worker: str = "w") -> list[Executed]:
    """n batches of BATCH claimed as a worker claims them (one lease each), run: each
    request's output its input doubled."""
    out = []
    for b in range(n):
        reply = queue.claim(f"{worker}#{b}", BATCH, 10**6, 0, 64)
        assert len(reply.batch) == BATCH, reply
        outcomes = [Outcome(c, output={"doubled": 2 * c.input}, batch_size=BATCH) for c in reply.batch]
        out.append(Executed(reply.now_ms, outcomes, [ModelRun(BATCH, BATCH, BATCH)]))
    return out


def counting_commits(queue: ShardedQueue, events: list[Any]) -> None:
    """Record the size of each complete call ``queue`` makes (each still made on Redis)."""
    complete = queue.complete

    def counted(items: Any, totals: Any, clients: Any = None) -> list[bool]:
        events.append(len(items))
        return complete(items, totals, clients)
    queue.complete = counted  # type: ignore[method-assign]


def test_batches_waiting_are_committed_in_one_call_in_order_with_stream_writes(
        rconn: redis.Redis, redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"input": i} for i in range(7 * BATCH)])
        queue = open_queue(RedisSettings.from_url(redis_url).client(), queue_name)
        batches = claimed_batches(queue, 7)
        leases = Leases()
        leases.add(o.request for e in batches for o in e.outcomes)
        events: list[Any] = []
        counting_commits(queue, events)
        writer = ResultWriter(queue, "w", leases)
        # all waiting before the writer starts (its backlog holds 8): two batches, a
        # stream write, five more; a group takes four at most
        for executed in batches[:2]:
            writer.submit(executed)
        writer.later(lambda: events.append("stream"))
        for executed in batches[2:]:
            writer.submit(executed)
        writer.start()
        writer.close()
        results = [h.result(timeout=30) for h in handles]
    assert events == [2 * BATCH, "stream", 4 * BATCH, BATCH]
    assert [r.status for r in results] == ["ok"] * 7 * BATCH
    assert [r.output for r in results] == [{"doubled": 2 * i} for i in range(7 * BATCH)]
    assert {r.batch_size for r in results} == {BATCH}
    totals = queue.stats()["totals"]  # the group's totals summed: each batch counted once
    assert (totals["ok"], totals["batches"], totals["tokens"]) == (7 * BATCH, 7, 7 * BATCH)
    assert rconn.hlen(queue.first.keys.lease_ids) == 0 and len(leases) == 0


def test_a_group_redis_refuses_is_written_batch_by_batch_so_one_refused_batch_fails_alone(
        rconn: redis.Redis, redis_url: str, queue_name: str, caplog: pytest.LogCaptureFixture) -> None:
    """Redis refuses (for good: no permission) the reply list of one client: the group
    holding its batch is refused whole; written alone, the other client's batch commits,
    and the refused one is given up alone (failed, refused too, then released: back in
    the queue, not lost)."""
    with Client(redis_url, queue_name) as allowed, Client(redis_url, queue_name) as denied:
        ok_handles = allowed.enqueue_many([{"input": i} for i in range(BATCH)])
        denied_handles = denied.enqueue_many([{"input": i} for i in range(BATCH, 2 * BATCH)])
        prefix = allowed.queue.first.keys.reply_prefix
        base = prefix[:-len("reply:")]
        user = f"writer-{queue_name}"
        # every key of the queue but the reply lists, and the allowed client's list
        rconn.acl_setuser(user, enabled=True, passwords=["+pw"], commands=["+@all"],
                          keys=[f"{base}[^r]*", f"{base}r[^e]*", f"{base}re[^p]*",
                                f"{prefix}{allowed.client_id}*"])
        try:
            settings = RedisSettings.from_url(redis_url.replace("redis://", f"redis://{user}:pw@"))
            batches = claimed_batches(open_queue(rconn, queue_name), 2)
            queue = open_queue(settings.client(), queue_name)  # the writer's
            assert {o.request.client for o in batches[0].outcomes} == {allowed.client_id}
            leases = Leases()
            leases.add(o.request for e in batches for o in e.outcomes)
            events: list[Any] = []
            counting_commits(queue, events)
            writer = ResultWriter(queue, "w", leases)
            for executed in batches:
                writer.submit(executed)
            with caplog.at_level(logging.ERROR, logger="batchery.workers.results"):
                writer.start()
                writer.close()
            assert events == [2 * BATCH, BATCH, BATCH]  # the group, then each alone
            assert [h.result(timeout=30).output for h in ok_handles] == [
                {"doubled": 2 * i} for i in range(BATCH)]
            refused = [r.getMessage() for r in caplog.records]
            assert any(f"Redis refused the results of {BATCH} request(s): NoPermissionError" in m
                       for m in refused), refused
            k = queue.first.keys
            assert sorted(rconn.zrange(k.pending, 0, -1)) == sorted(h.id for h in denied_handles)
            assert rconn.hlen(k.lease_ids) == 0 and len(leases) == 0
            totals = open_queue(rconn, queue_name).stats()["totals"]  # the one batch, once
            assert (totals.get("ok"), totals.get("batches")) == (BATCH, 1), totals
        finally:
            rconn.acl_deluser(user)


def test_a_group_holds_the_batches_of_one_shard(rconn: redis.Redis, redis_url: str,
                                                 queue_name: str) -> None:
    """A group goes to one shard in one call: a batch of another shard waiting among them
    starts a group of its own, written after, in order."""
    open_queue(rconn, queue_name).update_settings(shards=2)
    ids = ids_on_every_shard(f"{queue_name}-", 2, 3 * BATCH)  # shard 0's, then shard 1's
    with Client(redis_url, queue_name) as client:
        handles = client.enqueue_many([{"id": i, "input": n} for n, i in enumerate(ids)])
        queue = open_queue(RedisSettings.from_url(redis_url).client(), queue_name)
        zero, one = [claimed_batches(shard, 3, f"w{n}") for n, shard in enumerate(queue.shards)]
        leases = Leases()
        leases.add(o.request for e in [*zero, *one] for o in e.outcomes)
        events: list[Any] = []
        counting_commits(queue, events)
        writer = ResultWriter(queue, "w", leases)
        for executed in [zero[0], one[0], zero[1], zero[2], one[1], one[2]]:
            writer.submit(executed)
        writer.start()
        writer.close()
        results = [h.result(timeout=30) for h in handles]
    assert events == [BATCH, BATCH, 2 * BATCH, 2 * BATCH]
    assert [r.output for r in results] == [{"doubled": 2 * n} for n in range(len(ids))]
