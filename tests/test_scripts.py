"""Each Lua script against a real Redis, through RequestQueue."""

from __future__ import annotations

import itertools
import json
import struct
import time
import uuid
from typing import Iterator

import pytest
import redis
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from batchery import InvalidRequest, QueueFull, RequestTooLarge, Result
from batchery.batching.request import Request
from batchery.batching.calls import Cancelled, Failed, Reaped
from batchery.batching.claim_call import (claim_call, claim_payload_ids, enqueued_before,
                                          opened, packed_array, parse_claim)
from batchery.batching.queue import RequestQueue
from tests.conftest import wait_for


def server_ms(queue: RequestQueue) -> int:
    """Now on the Redis clock, in ms."""
    seconds, micros = queue.client.time()
    return seconds * 1000 + micros // 1000


def requests(*inputs: object, priority: str = "normal", **fields: object) -> list[Request]:
    return [Request.validated(id=f"r{i}", input=v, priority=priority, **fields)
            for i, v in enumerate(inputs)]


def ok(queue: RequestQueue, claimed: list, output: object = "out") -> list[bool]:
    return queue.complete([(r.id, r.lease_token, Result(r.id, "ok", output).to_json()) for r in claimed],
                          {"requests": len(claimed)})


@pytest.fixture
def queue(rconn: redis.Redis, queue_name: str) -> RequestQueue:
    return RequestQueue(rconn, queue_name)


def test_enqueue_is_idempotent_by_id_and_counts_depth(queue: RequestQueue) -> None:
    assert queue.enqueue(requests("a", "b", priority="batch"), "c1") == [True, True]
    assert queue.enqueue(requests("a", "b", "c"), "c1") == [False, False, True]
    stats = queue.stats()
    assert stats["pending"] == 3
    assert stats["pending_by_priority"] == {"batch": 2, "normal": 1}
    claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch
    ok(queue, claimed)
    # an id with a result is known too: enqueueing it again changes nothing
    assert queue.enqueue(requests("a"), "c1") == [False]
    assert queue.result("r0").output == "out"


def test_enqueue_refuses_all_or_nothing(queue: RequestQueue) -> None:
    queue.update_settings(max_pending=3, max_request_bytes=100)
    with pytest.raises(RequestTooLarge, match="max_request_bytes of 100"):
        queue.enqueue(requests("x", "y" * 200), "c")
    assert queue.stats()["pending"] == 0
    queue.enqueue(requests("x", "y"), "c")
    with pytest.raises(QueueFull, match="max_pending of 3"):
        queue.enqueue([Request.validated(id=f"n{i}", input=i) for i in range(2)], "c")
    assert queue.stats()["pending"] == 2
    with pytest.raises(InvalidRequest, match="unknown priority class 'urgent'"):
        queue.enqueue([Request.validated(id="z", input="z", priority="urgent")], "c")


def test_priority_classes_and_integer_delays_rank_as_documented(queue: RequestQueue) -> None:
    queue.enqueue([Request.validated(id="slow", input=1, priority="batch"),
                   Request.validated(id="mid", input=1, priority=5),
                   Request.validated(id="fast", input=1, priority="realtime")], "c")
    order = queue.client.zrange(queue.keys.pending, 0, -1, withscores=True)
    assert [i for i, _ in order] == ["fast", "mid", "slow"]
    ranks = dict(order)
    assert ranks["mid"] - ranks["fast"] == 5000 and ranks["slow"] - ranks["fast"] == 60_000
    assert queue.stats()["pending_by_priority"] == {"batch": 1, "normal": 1, "realtime": 1}


def test_claim_leases_and_only_the_lease_holder_commits(queue: RequestQueue) -> None:
    queue.enqueue(requests("a", "b"), "c")
    claim = queue.claim("w1#1", 10, 10_000, 0, 10)
    assert [r.id for r in claim.batch] == ["r0", "r1"] and claim.batch[0].attempt == 1
    assert queue.stats()["inflight"] == 2
    forged = [(r.id, "w2#9", Result(r.id, "ok", "forged").to_json()) for r in claim.batch]
    assert queue.complete(forged, {}) == [False, False]
    assert ok(queue, claim.batch) == [True, True]
    assert queue.stats()["inflight"] == 0
    assert queue.client.lrange(queue.keys.reply("c"), 0, -1)  # pushed to the client's list


def test_a_late_result_after_takeover_is_discarded(queue: RequestQueue) -> None:
    queue.update_settings(lease_seconds=1)
    queue.enqueue(requests("a"), "c")
    first = queue.claim("dead-worker#1", 10, 10_000, 0, 10).batch
    time.sleep(1.1)
    assert queue.reap() == Reaped(requeued=["r0"])
    second = queue.claim("live-worker#1", 10, 10_000, 0, 10).batch
    assert second[0].attempt == 2  # the lost lease counted as an attempt
    assert ok(queue, first, "late") == [False]
    assert ok(queue, second, "fresh") == [True]
    assert queue.result("r0").output == "fresh"


def test_renew_keeps_leases_and_reports_lost_ones(queue: RequestQueue) -> None:
    queue.update_settings(lease_seconds=1)
    queue.enqueue(requests("a", "b"), "c")
    claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch

    def expiries() -> list[float]:
        return [queue.client.zscore(queue.keys.lease_expiry, r.lease_token) for r in claimed]
    first = expiries()
    for _ in range(3):  # renewed each time half a lease has passed
        previous = expiries()
        wait_for(lambda: server_ms(queue) >= min(previous) - 500, 30, interval=0.01)
        renewed_at = server_ms(queue)
        assert queue.renew("w", [(r.id, r.lease_token) for r in claimed]) == []
        assert all(e >= renewed_at + 1000 > p for e, p in zip(expiries(), previous))
    assert server_ms(queue) > max(first)  # without the renewals these leases had expired
    assert queue.reap() == Reaped()
    assert queue.renew("w", [("r0", "someone-else")]) == ["r0"]


def test_a_claim_is_one_lease_that_ends_with_its_last_request(queue: RequestQueue) -> None:
    """A claim leases its batch as one lease (its ids, one expiry): a commit of part of it
    keeps the lease for the rest; once that lapses the reaper takes back the rest alone
    (not what was committed, cancelled, or given back and claimed by another), and
    nothing of a lease is left once its last request is done."""
    queue.update_settings(max_attempts=3)
    queue.enqueue(requests("a", "b", "c", "d"), "c")
    claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch
    k, conn = queue.keys, queue.client
    assert conn.hget(k.lease_ids, "w#1") == "r0\nr1\nr2\nr3"
    assert conn.zrange(k.lease_expiry, 0, -1) == ["w#1"]
    assert ok(queue, claimed[:1]) == [True]
    assert queue.cancel(["r1"]) == [2]  # running: cancelled
    assert conn.zrange(k.lease_expiry, 0, -1) == ["w#1"]  # r2 and r3 still held by it
    conn.zadd(k.lease_expiry, {"w#1": 0})  # it lapses
    assert queue.reap().requeued == ["r2", "r3"]
    assert not conn.hlen(k.lease_ids) and not conn.zcard(k.lease_expiry)
    again = queue.claim("w#2", 10, 10_000, 0, 10).batch
    assert [(r.id, r.attempt) for r in again] == [("r2", 2), ("r3", 2)]
    # r2 given back and claimed by another: its first claim's lapse leaves it to that one
    assert queue.release([("r2", "w#2")]) == 1
    assert [r.id for r in queue.claim("w#3", 10, 10_000, 0, 10).batch] == ["r2"]
    conn.zadd(k.lease_expiry, {"w#2": 0})
    assert queue.reap().requeued == ["r3"] and queue.leases() == {"w#3": ["r2"]}
    last = queue.claim("w#4", 10, 10_000, 0, 10).batch
    assert ok(queue, last) == [True]  # the whole claim committed: its lease ends
    assert conn.zrange(k.lease_expiry, 0, -1) == ["w#3"]
    assert queue.complete([("r2", "w#3", Result("r2", "ok", "out").to_json())], {}) == [True]
    assert not conn.hlen(k.lease_ids) and not conn.zcard(k.lease_expiry)


def test_a_claim_retried_after_its_memory_lapsed_keeps_what_its_lease_held(
        queue: RequestQueue) -> None:
    """A claim whose reply was lost, sent again under its token after the claim's memory
    of it lapsed (or was evicted), leases anew: what its lease held stays in it, and comes
    back when it lapses, never held by no lease."""
    queue.enqueue(requests("a", "b"), "c")
    assert [r.id for r in queue.claim("w#1", 10, 10_000, 0, 10).batch] == ["r0", "r1"]
    k, conn = queue.keys, queue.client
    conn.delete(k.claim("w#1"))  # its memory gone; the reply never reached the worker
    queue.enqueue([Request.validated(id="late", input="c")], "c")
    again = queue.claim("w#1", 10, 10_000, 0, 10).batch
    assert [r.id for r in again] == ["late"] and queue.leases() == {"w#1": ["r0", "r1", "late"]}
    assert ok(queue, again) == [True]
    conn.zadd(k.lease_expiry, {"w#1": 0})
    assert queue.reap().requeued == ["r0", "r1"] and queue.leases() == {}


def test_a_deep_queues_claim_leases_the_next_batch_too_under_a_lease_of_its_own(
        queue: RequestQueue) -> None:
    """A claim that may lease two batches (a worker that runs them in turn) leases the
    batch after its own too while more than its lookahead is pending past both, under the
    token + "+": a lease of its own, committed whole apart from the first, reaped alone.
    The same claim sent again (its reply lost) hands back what both still hold; a claim of
    a queue no deeper, or of a worker from before (one batch), leases one batch."""
    queue.update_settings(max_attempts=3)
    queue.enqueue(requests(*"abcdefghijklmnopq"), "c")  # 17 alike: past 8 + 2 * 4
    k, conn = queue.keys, queue.client
    order = conn.zrange(k.pending, 0, -1)
    reply = queue.claim("w#1", 4, 10_000, 0, 8, batches=2)
    assert [(r.id, r.lease_token) for r in reply.batch] == (
        [(i, "w#1") for i in order[:4]] + [(i, "w#1+") for i in order[4:8]])
    assert queue.leases() == {"w#1": order[:4], "w#1+": order[4:8]}
    assert sorted(conn.zrange(k.lease_expiry, 0, -1)) == ["w#1", "w#1+"]
    again = queue.claim("w#1", 4, 10_000, 0, 8, batches=2)  # its reply lost: sent again
    assert [(r.id, r.lease_token) for r in again.batch] == [
        (r.id, r.lease_token) for r in reply.batch]
    assert ok(queue, reply.batch[4:]) == [True] * 4  # the next batch, whole: its lease ends
    assert queue.leases() == {"w#1": order[:4]} and conn.zrange(k.lease_expiry, 0, -1) == ["w#1"]
    assert [(r.id, r.lease_token) for r in queue.claim("w#1", 4, 10_000, 0, 8, batches=2).batch] == [
        (i, "w#1") for i in order[:4]]
    # 9 pending, no more than 8 + 2 * 4: a batch a claim
    assert [r.lease_token for r in queue.claim("w#2", 4, 10_000, 0, 8, batches=2).batch] == ["w#2"] * 4
    queue.enqueue([Request.validated(id=f"s{i:02d}", input="z") for i in range(20)], "c")
    assert [r.lease_token for r in queue.claim("w#3", 4, 10_000, 0, 8).batch] == ["w#3"] * 4
    deeper = queue.claim("w#4", 4, 10_000, 0, 8, batches=2).batch
    assert [r.lease_token for r in deeper] == ["w#4"] * 4 + ["w#4+"] * 4
    conn.zadd(k.lease_expiry, {"w#4+": 0})  # the next batch's lease lapses: it comes back alone
    assert queue.reap().requeued == [r.id for r in deeper[4:]]
    assert set(queue.leases()) == {"w#1", "w#2", "w#3", "w#4"}


def test_a_deep_claim_cut_short_by_its_ceiling_plans_none_of_what_it_leased(
        queue: RequestQueue) -> None:
    """A deep queue's claim whose rank ceiling (a sharded claim's) lets fewer than two
    batches' worth of alike candidates through leases its batch and the next from them and
    keeps no plan: a plan is made from what a claim read past alike candidates, never of
    requests it leased."""
    k, conn = queue.keys, queue.client
    base = server_ms(queue) - 60_000
    ids = [f"r{i:02d}" for i in range(20)]  # alike: one token each, one class, 1 ms apart
    for i, rid in enumerate(ids):
        conn.zadd(k.pending, {rid: base + i})
        conn.hset(k.sched, rid, f"1:0:{base + i - 5000}:{base + i}:normal:")
        conn.hset(k.requests, rid, json.dumps({"input": rid}))
    # a batch of one (a token budget of 1), 8 read first; the ceiling lets 7 through
    reply = queue.claim("w#1", 4, 1, 0, 8, ceiling=base + 6, batches=2)
    assert [(r.id, r.lease_token) for r in reply.batch] == [("r00", "w#1"), ("r01", "w#1+")]
    assert not conn.get(k.plan)
    assert [r.id for r in queue.claim("w#2", 4, 1, 0, 8, batches=2).batch] == ["r02", "r03"]


def test_a_lease_of_an_earlier_version_per_request_is_reaped(queue: RequestQueue) -> None:
    """A request leased by a version that kept one lease per request (its expiry in the
    `leased` set, its holder in `owner`, no lease of its claim) still comes back when that
    lease lapses."""
    queue.enqueue(requests("a", "b"), "c")
    claimed = queue.claim("w#1", 1, 10_000, 0, 10).batch
    k, conn = queue.keys, queue.client
    conn.delete(k.lease_ids, k.lease_expiry)  # as the earlier version left it:
    conn.zadd(k.leased, {claimed[0].id: 0})  # its expiry per request, lapsed
    conn.hset(k.owner, claimed[0].id, "w#1")
    assert queue.reap().requeued == [claimed[0].id]
    assert not conn.zcard(k.leased) and not conn.hlen(k.owner)
    assert [r.id for r in queue.claim("w#2", 10, 10_000, 0, 10).batch] == ["r0", "r1"]


PLANTED = {"hash": lambda c, k: c.hset(k, "f", "v"), "list": lambda c, k: c.rpush(k, "v"),
           "set": lambda c, k: c.sadd(k, "v"), "sorted set": lambda c, k: c.zadd(k, {"v": 1}),
           "string": lambda c, k: c.set(k, "stale")}
EXAMPLES = itertools.count()  # fresh ids for each example on the one queue


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(sorted(PLANTED)), min_size=1, max_size=4))
def test_a_result_key_holding_anything_is_overwritten_and_blocks_no_commit(
        queue: RequestQueue, kinds: list[str]) -> None:
    """Whatever a request's result key holds before it ends (damaged, or written by
    another program: any type), its result is stored over it with its TTL, whether
    committed, cancelled or dead-lettered, and its batch-mates' results are stored too;
    a late result for such a key (its lease lost), a cancel of an id that has one and a
    lookup of it fail that id alone, not the call.
    (SET's GET option, which would spare Lua the OK reply's table, refuses a key of another
    type: a script error that would fail the whole batch's commit, again at every retry.)"""
    n = next(EXAMPLES)
    q = RequestQueue(queue.client, f"{queue.name}x{n}")  # each example on a queue of its own
    done = [f"d{i}" for i in range(2 * len(kinds))]
    planted = [*done[1::2], "cancelled", "dead", "unknown"]
    q.update_settings(max_attempts=1)
    q.enqueue([Request.validated(id=i, input=i) for i in [*done, "cancelled", "dead"]], "")
    conn, k = q.client, q.keys
    for request_id, kind in zip(planted, [*kinds, kinds[0], kinds[-1], kinds[0]]):
        PLANTED[kind](conn, k.result(request_id))
    found = q.lookup(planted)
    assert [f.error["type"] for f in found[:len(kinds)]] == ["ResultUnreadable"] * len(kinds)
    assert q.cancel(["cancelled", "unknown"]) == [Cancelled.QUEUED, Cancelled.NOT]
    claimed = {r.id: r for r in q.claim("w#1", 100, 1_000_000, 0, 100).batch}
    assert sorted(claimed) == sorted([*done, "dead"])
    late = ("dead", "w#lost", Result("dead", "ok", "late").to_json())  # a lease it does not hold
    assert q.complete([late, *((i, claimed[i].lease_token, Result(i, "ok", "out").to_json())
                               for i in done)], {"requests": len(done)}) == [False] + [True] * len(done)
    dead_json = Result("dead", "dead", error={"type": "E", "message": "boom"}, attempts=1).to_json()
    assert q.fail([("dead", claimed["dead"].lease_token, dead_json)]) == [2]
    assert [q.result(i).status for i in [*done, "cancelled", "dead"]] == \
        ["ok"] * len(done) + ["cancelled", "dead"]
    for request_id in [*done, "cancelled", "dead"]:
        assert conn.type(k.result(request_id)) == "string" and conn.ttl(k.result(request_id)) > 0


def test_fail_backs_off_then_dead_letters_and_revive_purge(queue: RequestQueue) -> None:
    queue.update_settings(max_attempts=2)
    queue.enqueue(requests("bad"), "c")
    first = queue.claim("w#1", 10, 10_000, 0, 10).batch[0]
    dead_json = Result("r0", "dead", error={"type": "E", "message": "boom"}, attempts=1).to_json()
    assert queue.fail([(first.id, first.lease_token, dead_json)]) == [1]
    waiting = queue.claim("w#2", 10, 10_000, 0, 10)
    assert not waiting.batch and 0 < waiting.wait_ms <= 500  # backoff before the retry
    time.sleep(waiting.wait_ms / 1000 + 0.05)
    second = queue.claim("w#3", 10, 10_000, 0, 10).batch[0]
    assert second.attempt == 2
    assert queue.fail([(second.id, second.lease_token, dead_json)]) == [2]
    assert queue.result("r0").status == "dead"
    assert [r.id for r in queue.dead()] == ["r0"] and queue.stats()["dead"] == 1
    assert queue.revive(["r0"]) == 1
    assert queue.result("r0") is None and queue.stats()["pending"] == 1
    again = queue.claim("w#4", 10, 10_000, 0, 10).batch[0]
    assert again.attempt == 1
    assert queue.fail([(again.id, again.lease_token, dead_json)]) == [1]
    time.sleep(0.6)
    last = queue.claim("w#5", 10, 10_000, 0, 10).batch[0]
    assert queue.fail([(last.id, last.lease_token, dead_json)]) == [2]
    assert queue.purge(everything=True) == 1
    assert queue.stats()["dead"] == 0 and not queue.client.hexists(queue.keys.requests, "r0")


def failed(queue: RequestQueue, claimed: list, message: str = "boom") -> list[int]:
    """Fail each claimed request with a RuntimeError(message), as a worker does."""
    return queue.fail([(r.id, r.lease_token, Result(r.id, "dead", error={
        "type": "RuntimeError", "message": message}, attempts=r.attempt).to_json()) for r in claimed])


def history(queue: RequestQueue, request_id: str) -> list[dict] | None:
    raw = queue.client.hget(queue.keys.history, request_id)
    return json.loads(raw) if raw else None


def test_a_dead_letter_says_how_each_attempt_ended(queue: RequestQueue) -> None:
    queue.update_settings(lease_seconds=1, max_attempts=3)
    queue.enqueue(requests("a"), "c")
    first = queue.claim("w#1", 10, 10_000, 0, 10).batch
    assert failed(queue, first) == [1]
    assert failed(queue, first) == [0]  # a replay (a dropped reply) is discarded, not counted
    assert history(queue, "r0") == [{"type": "RuntimeError", "message": "boom"}]
    time.sleep(0.55)
    assert failed(queue, queue.claim("w#2", 10, 10_000, 0, 10).batch) == [1]
    time.sleep(1.05)
    assert queue.claim("w#3", 10, 10_000, 0, 10).batch[0].attempt == 3  # then it dies
    time.sleep(1.1)
    assert queue.reap() == Reaped(dead=["r0"])
    assert queue.result("r0").error == {"type": "RuntimeError", "message": (
        "boom (attempt 1: RuntimeError: boom; attempt 2: RuntimeError: boom; "
        "attempt 3: lease expired, the worker died or hung)")}


def test_a_dead_letter_of_lost_leases_only_is_a_lease_expired(queue: RequestQueue) -> None:
    queue.update_settings(lease_seconds=1, max_attempts=2)
    queue.enqueue(requests("a"), "c")
    for attempt in (1, 2):
        assert queue.claim(f"w#{attempt}", 10, 10_000, 0, 10).batch[0].attempt == attempt
        time.sleep(1.1)
        assert queue.reap() == (Reaped(requeued=["r0"]) if attempt == 1 else Reaped(dead=["r0"]))
    assert queue.result("r0").error == {"type": "LeaseExpired", "message": (
        "the worker running this request stopped renewing its lease (attempt 1: lease "
        "expired, the worker died or hung; attempt 2: lease expired, the worker died or hung)")}


def test_history_is_clipped_and_goes_with_the_working_state(queue: RequestQueue) -> None:
    queue.update_settings(max_attempts=2)
    queue.enqueue(requests("a", "b", "c"), "c")
    long = "a" + "é" * 300  # 601 bytes: clipped to whole characters, still UTF-8
    assert failed(queue, queue.claim("w#1", 10, 10_000, 0, 10).batch, long) == [1, 1, 1]
    assert queue.cancel(["r2"]) == [1] and history(queue, "r2") is None
    time.sleep(0.55)
    r0, r1 = queue.claim("w#2", 10, 10_000, 0, 10).batch
    assert ok(queue, [r1]) == [True] and history(queue, "r1") is None
    assert failed(queue, [r0], long) == [2]
    clipped = "a" + "é" * 99 + "..."  # 199 bytes: the 200th starts a character
    assert history(queue, "r0") == [{"type": "RuntimeError", "message": clipped}] * 2
    assert queue.result("r0").error["message"] == (  # the last error itself in full
        f"{long} (attempt 1: RuntimeError: {clipped}; attempt 2: RuntimeError: {clipped})")
    assert queue.revive(["r0"]) == 1 and history(queue, "r0") is None  # a fresh start
    assert failed(queue, queue.claim("w#3", 10, 10_000, 0, 10).batch) == [1]
    assert history(queue, "r0") == [{"type": "RuntimeError", "message": "boom"}]
    time.sleep(0.55)
    assert failed(queue, queue.claim("w#4", 10, 10_000, 0, 10).batch) == [2]
    assert queue.result("r0").error["message"] == (
        "boom (attempt 1: RuntimeError: boom; attempt 2: RuntimeError: boom)")
    assert queue.purge(everything=True) == 1
    for key in (queue.keys.history, queue.keys.attempts):
        assert queue.client.hlen(key) == 0


def test_deadlines_expire_queued_requests(queue: RequestQueue) -> None:
    queue.enqueue(requests("a", deadline=0.05) + [Request.validated(id="keep", input="b")], "c")
    time.sleep(0.1)
    claim = queue.claim("w#1", 10, 10_000, 0, 10)
    assert [r.id for r in claim.expired] == ["r0"]
    assert [r.id for r in claim.batch] == ["keep"]


def test_cancel_queued_and_running(queue: RequestQueue) -> None:
    queue.enqueue(requests("a", "b", "c"), "c")
    running = queue.claim("w#1", 1, 10_000, 0, 10).batch
    assert queue.cancel(["r1", running[0].id, "unknown"]) == [1, 2, 0]
    assert queue.result("r1").status == "cancelled"
    assert ok(queue, running) == [False]  # its output is discarded
    assert queue.result(running[0].id).status == "cancelled"
    assert queue.stats()["pending"] == 1 and queue.stats()["pending_by_priority"] == {"normal": 1}


def test_release_returns_claims_without_counting_an_attempt(queue: RequestQueue) -> None:
    queue.enqueue(requests("a", "b"), "c")
    claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch
    assert queue.release([(r.id, r.lease_token) for r in claimed]) == 2
    again = queue.claim("w#2", 10, 10_000, 0, 10).batch
    assert [r.attempt for r in again] == [1, 1]


def test_reaper_dead_letters_after_max_attempts(queue: RequestQueue) -> None:
    queue.update_settings(lease_seconds=1, max_attempts=1)
    queue.enqueue(requests("a"), "client-x")
    queue.claim("w#1", 10, 10_000, 0, 10)
    time.sleep(1.1)
    assert queue.reap() == Reaped(dead=["r0"])
    result = queue.result("r0")
    assert result.status == "dead" and result.error["type"] == "LeaseExpired"
    pushed = queue.client.lrange(queue.keys.reply("client-x"), 0, -1)
    assert Result.from_json(pushed[0]).status == "dead"


def test_stored_garbage_becomes_an_error_not_a_crash(queue: RequestQueue) -> None:
    queue.enqueue(requests("a", "b"), "c")
    queue.client.hset(queue.keys.requests, "r0", b"\xff\xfe not json")
    claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch
    assert claimed[0].invalid and claimed[1].invalid is None and claimed[1].input == "b"


def test_estimated_requests_are_handed_to_a_counting_worker_then_claimed_on_exact_counts(
        queue: RequestQueue) -> None:
    queue.enqueue(requests("x" * 400, "y" * 40))            # estimated: ~102 and ~12
    enqueued_ms = server_ms(queue)
    wait_for(lambda: server_ms(queue) > enqueued_ms, 5)  # "exact" ranks after r0 and r1
    queue.enqueue([Request.validated(id="exact", input="z", tokens=7)])
    sched = queue.client.hgetall(queue.keys.sched)
    assert (sched["r0"].split(":")[0], sched["exact"].split(":")[0]) == ("~102", "7")
    # a counting worker is handed the estimated candidates first, and nothing is leased
    reply = queue.claim("w#1", 10, 10_000, 0, 10, price_estimates=True)
    assert reply.batch == [] and queue.stats()["inflight"] == 0
    assert reply.to_price == [("r0", "x" * 400), ("r1", "y" * 40)]
    # it claims again with its counts (an id twice: its first count; not a count: ignored);
    # a batch of 1 takes r0 on its count, and r1's count is kept for the next claim
    counts = [("r0", 3), ("r1", 5), ("r1", 99), ("exact", 99), ("r0", "5:0")]
    first = queue.claim("w#1", 1, 10_000, 0, 10, price_estimates=True, counts=counts).batch
    assert [(r.id, r.tokens) for r in first] == [("r0", 3)]
    sched = queue.client.hgetall(queue.keys.sched)
    assert (sched["r1"].split(":")[0], sched["exact"].split(":")[0]) == ("5", "7")
    claimed = queue.claim("w#2", 10, 10_000, 0, 10, price_estimates=True).batch
    assert {r.id: r.tokens for r in claimed} == {"r1": 5, "exact": 7}


def test_a_leasing_claim_prices_the_next_batch_ahead(queue: RequestQueue) -> None:
    """A counting worker's claim that leases also hands over the estimated requests next
    in line; sent with its next claim, their counts lease at once (no pricing round). A
    claim without them prices them first, as before."""
    queue.enqueue(requests(*"abcdef"))  # all estimated
    priced = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True)
    assert [i for i, _ in priced.to_price] == ["r0", "r1"] and priced.batch == []
    first = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True,
                        counts=[(i, 1) for i, _ in priced.to_price])
    assert [r.id for r in first.batch] == ["r0", "r1"]
    assert first.price_ahead == [("r2", "c"), ("r3", "d")]
    second = queue.claim("w#2", 2, 10_000, 0, 10, price_estimates=True,
                         counts=[(i, 3) for i, _ in first.price_ahead])
    assert [(r.id, r.tokens) for r in second.batch] == [("r2", 3), ("r3", 3)]
    assert second.price_ahead == [("r4", "e"), ("r5", "f")]
    again = queue.claim("w#2", 2, 10_000, 0, 10, price_estimates=True)  # a retried call
    assert [r.id for r in again.batch] == ["r2", "r3"] and again.price_ahead == []
    other = queue.claim("w#3", 2, 10_000, 0, 10, price_estimates=True)  # without the counts
    assert [i for i, _ in other.to_price] == ["r4", "r5"] and other.batch == []
    last = queue.claim("w#3", 2, 10_000, 0, 10, price_estimates=True, counts=[("r4", 1), ("r5", 1)])
    assert [r.id for r in last.batch] == ["r4", "r5"] and last.price_ahead == []
    plain = queue.claim("w#4", 2, 10_000, 0, 10)
    assert plain.batch == [] and plain.price_ahead == []


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def test_a_payload_read_ahead_is_not_read_again_unless_its_id_was_enqueued_again_since(
        queue: RequestQueue) -> None:
    """The payloads of the requests a claim hands ahead are read then, once: their lease
    does not read them again. One cancelled and enqueued again under its id in between
    (its result delivered and deleted) is enqueued after that claim: its new payload is
    read, never the old one run."""
    queue.enqueue(requests(*"abcdef"))
    enqueued = redis_ms(queue.client)
    wait_for(lambda: redis_ms(queue.client) > enqueued, 5, 0.001, "Redis's clock to move on")
    fields: list[str] = []
    hmget = queue.client.hmget

    def counted(key: str, ids: list[str]) -> list:
        fields.extend(ids)
        return hmget(key, ids)
    queue.client.hmget = counted  # type: ignore[method-assign]  # (reads through, counted)
    priced = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True)
    first = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True,
                        counts=[(i, 1) for i, _ in priced.to_price])
    second = queue.claim("w#2", 2, 10_000, 0, 10, price_estimates=True,
                         counts=[(i, 1) for i, _ in first.price_ahead])
    assert [(r.id, r.input) for r in first.batch + second.batch] == [
        ("r0", "a"), ("r1", "b"), ("r2", "c"), ("r3", "d")]
    assert fields == ["r0", "r1", "r2", "r3", "r4", "r5"]  # each read once
    assert queue.cancel(["r4"]) == [Cancelled.QUEUED]
    queue.client.delete(queue.keys.result("r4"))  # delivered, deleted
    assert queue.enqueue([Request.validated(id="r4", input="again")]) == [True]
    fields.clear()
    third = queue.claim("w#3", 2, 10_000, 0, 10, price_estimates=True,
                        counts=[(i, 1) for i, _ in second.price_ahead])
    assert [(r.id, r.input) for r in third.batch] == [("r5", "f"), ("r4", "again")]
    assert fields == ["r4"]  # the one enqueued again since it was read (in the same ms or after)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(st.tuples(st.just("claim"), st.integers(1, 3)),
                              st.tuples(st.just("replace"), st.integers(0, 3))),
                    min_size=1, max_size=20))
def test_a_leased_request_runs_its_latest_payload_whatever_was_read_ahead(
        rconn: redis.Redis, ops: list[tuple[str, int]]) -> None:
    """A worker's claims, each with the counts of what the last one handed ahead, between
    replacements (a request cancelled, its result delivered and deleted, and its id
    enqueued again with a new payload, which it is unless the id is still held): every
    request leased runs the payload its id was last accepted with, whether its payload was
    read ahead, read ahead and then replaced, or read with its lease."""
    queue = RequestQueue(rconn, f"t-{uuid.uuid4().hex[:10]}")
    ids, latest, version = [f"r{i}" for i in range(4)], {}, itertools.count()

    def put(request_id: str) -> None:
        value = f"{request_id}-v{next(version)}"
        if queue.enqueue([Request.validated(id=request_id, input=value)]) == [True]:
            latest[request_id] = value
    for request_id in ids:
        put(request_id)
    ahead: list = []
    for n, (op, arg) in enumerate(ops):
        if op == "claim":
            reply = queue.claim(f"w#{n}", arg, 10_000, 0, 8, price_estimates=True,
                                counts=[(i, 1) for i, _ in ahead])
            if reply.to_price:
                reply = queue.claim(f"w#{n}b", arg, 10_000, 0, 8, price_estimates=True,
                                    counts=[(i, 1) for i, _ in reply.to_price])
            assert [(r.id, r.input) for r in reply.batch] == [(r.id, latest[r.id])
                                                              for r in reply.batch]
            assert ok(queue, reply.batch) == [True] * len(reply.batch)
            ahead = reply.price_ahead
        else:
            queue.cancel([ids[arg]])
            queue.client.delete(queue.keys.result(ids[arg]))
            put(ids[arg])


def test_a_payload_read_ahead_counts_only_for_a_request_enqueued_before_it_was_read() -> None:
    """The guard's rule on its own: enqueued in the ms of the claim that handed it ahead,
    or after, or with an entry that cannot be read, is read again."""
    assert enqueued_before("~1:0:1699:1700:normal:c1:t", 1700)
    assert not enqueued_before("~1:0:1700:1700:normal:c1:t", 1700)
    assert not enqueued_before("~1:0:1701:1701:normal:c1:t", 1700)
    assert not enqueued_before("~1:0:x:1701:normal:c1:t", 1700)
    assert not enqueued_before("garbage", 1700)


def test_a_request_next_in_line_without_its_payload_is_not_priced_ahead(
        queue: RequestQueue) -> None:
    """The requests handed ahead come with their payloads, in line order; one pending
    whose payload is gone (damaged in Redis) is left out of them, not handed over empty,
    and a later claim leases it marked invalid, to be failed alone."""
    queue.enqueue(requests(*"abcdef"))
    priced = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True)
    queue.client.hdel(queue.keys.requests, "r3")
    first = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True,
                        counts=[(i, 1) for i, _ in priced.to_price])
    assert [r.id for r in first.batch] == ["r0", "r1"]
    assert first.price_ahead == [("r2", "c")]
    second = queue.claim("w#2", 2, 10_000, 0, 10, price_estimates=True, counts=[("r2", 1)])
    assert second.to_price[0] == ("r3", None)  # still estimated: priced, with no input
    third = queue.claim("w#2", 2, 10_000, 0, 10, price_estimates=True,
                        counts=[("r2", 1), *((i, 1) for i, _ in second.to_price)])
    assert [(r.id, r.input, r.invalid is None) for r in third.batch] == [("r2", "c", True),
                                                                         ("r3", None, False)]


def claims_as_a_worker(q: RequestQueue, size: int, count: int, most: int) -> Iterator[tuple]:
    """Claims as a counting worker makes them until nothing is pending (at most ``most``):
    each one's pricing round (the candidates to price, counted ``count`` each, or []) and
    its reply; the counts of what it handed ahead go with the next claim."""
    ahead: list = []
    for claims in range(1, most + 1):
        token, priced = f"w#{claims}", []
        reply = q.claim(token, size, 10_000, 0, 16, price_estimates=True,
                        counts=[(i, count) for i, _ in ahead])
        if reply.to_price:
            priced = reply.to_price
            reply = q.claim(token, size, 10_000, 0, 16, price_estimates=True,
                            counts=[(i, count) for i, _ in priced])
        ahead = reply.price_ahead
        yield priced, reply
        if reply.nothing_pending:
            return


INPUT = st.one_of(st.text(max_size=30), st.integers(-2**53, 2**53), st.none(),
                  st.lists(st.text(max_size=5), max_size=3),
                  st.dictionaries(st.sampled_from(["text", "prompt", "k"]), st.text(max_size=12),
                                  max_size=2))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inputs=st.lists(INPUT, min_size=1, max_size=24), size=st.integers(1, 7),
       gone=st.sets(st.integers(0, 23), max_size=4), exact=st.booleans())
# distinct inputs over several batches, estimated: requests handed ahead, whose payloads
# are read after the leased ones' (left to the draws, alike inputs or one batch hide a
# mix-up of the two: make mutants let one survive a run in about four)
@example(inputs=list(range(14)), size=3, gone=set(), exact=False)
def test_each_request_leased_priced_or_handed_ahead_comes_with_its_own_input(
        queue: RequestQueue, inputs: list, size: int, gone: set, exact: bool) -> None:
    """A claim hands over ids; their payloads are read after it, in one plain read of the
    ids leased and then the ones handed ahead (or the ones to price). Whatever the inputs,
    the batch size and the producer's pricing, each request comes with its own input, in
    its place; one whose payload is gone is leased marked as one that cannot run (failed
    alone), never handed ahead, and takes no other's input."""
    q = RequestQueue(queue.client, f"{queue.name}p{next(EXAMPLES)}")
    sent = {f"r{i}": v for i, v in enumerate(inputs)}
    q.enqueue([Request.validated(id=i, input=v, **({"tokens": 3} if exact else {}))
               for i, v in sent.items()])
    lost = {f"r{i}" for i in gone if i < len(inputs)}
    if lost:
        q.client.hdel(q.keys.requests, *lost)
    leased = []
    for priced, reply in claims_as_a_worker(q, size, 2, 3 * len(inputs) + 2):
        assert all(v == (None if i in lost else sent[i]) for i, v in priced)
        for r in reply.batch:
            assert (r.invalid is not None, r.input) == ((True, None) if r.id in lost
                                                        else (False, sent[r.id]))
        assert all(i not in lost and v == sent[i] for i, v in reply.price_ahead)
        leased += [r.id for r in reply.expired + reply.batch]
    assert sorted(leased) == sorted(sent)


def test_a_request_cancelled_between_its_claim_and_the_read_of_its_payload_stays_cancelled(
        queue: RequestQueue) -> None:
    """The payloads are read after the claim's script: a request cancelled in between is
    handed to its worker without its payload (as one that cannot run), and what the worker
    reports of it is discarded: the cancel stands, its batch-mate runs."""
    queue.enqueue(requests("a", "b"), "c1")
    reply = opened(queue._run("claim", claim_call(queue.keys, "w#1", 10, 10_000, 0, 10, False, [],
                                                  None)))
    assert queue.cancel(["r1"]) == [Cancelled.RUNNING]
    payloads = queue.client.hmget(queue.keys.requests, claim_payload_ids(reply))
    first, second = parse_claim(reply, "w#1", payloads).batch
    assert (first.input, first.invalid) == ("a", None)
    assert (second.id, second.input) == ("r1", None) and second.invalid
    invalid = Result("r1", "error", error={"type": "InvalidRequest", "message": second.invalid})
    # as its worker reports it (a request that cannot run is committed with its error), or
    # as a failure: either way discarded
    assert queue.complete([("r1", "w#1", invalid.to_json()), ("r0", "w#1", Result(
        "r0", "ok", "out").to_json())], {"requests": 2}) == [False, True]
    assert queue.fail([("r1", "w#1", invalid.to_json())]) == [Failed.LEASE_LOST]
    assert queue.result("r1").status == "cancelled"
    assert queue.result("r0").output == "out"


NAME = st.one_of(st.text(min_size=1, max_size=30),
                 st.sampled_from(["{tag}", "}{", "a:b:c", "x" * 512, "日本語", "🙂", "1", " ",
                                  "result:x", "r\u2028s"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(NAME, min_size=1, max_size=10, unique=True), size=st.integers(1, 4))
def test_any_valid_id_goes_through_enqueue_claim_commit_and_lookup(
        queue: RequestQueue, names: list[str], size: int) -> None:
    """A request id is any name check_name lets through: any Unicode but control
    characters, with colons, braces or a key's own words in it, up to 512 characters. Each
    is accepted once (again: known), leased once with its own input (its payload read
    after the claim, its count handed ahead), committed, and read back by id with its own
    result: an id is cut from its result key whole, and joined with others in a lease
    without running into them."""
    q = RequestQueue(queue.client, f"{queue.name}i{next(EXAMPLES)}")
    made = []
    for name in names:
        try:
            made.append(Request.validated(id=name, input=["in", name]))
        except InvalidRequest:
            pass
    assume(made)
    ids = [r.id for r in made]
    assert q.enqueue(made, "c1") == [True] * len(made)
    assert q.enqueue(made, "c1") == [False] * len(made)
    leased = []
    for _, reply in claims_as_a_worker(q, size, 1, 2 * len(made) + 2):
        assert all(r.invalid is None and r.input == ["in", r.id] for r in reply.batch)
        items = [(r.id, r.lease_token, Result(r.id, "ok", {"of": r.id}).to_json())
                 for r in reply.batch]
        assert q.complete(items, {"requests": len(items)}) == [True] * len(items)
        leased += [r.id for r in reply.batch]
    assert sorted(leased) == sorted(ids)
    assert [(r.id, r.output) for r in q.results(ids)] == [(i, {"of": i}) for i in ids]
    assert q.enqueue(made, "c1") == [False] * len(made)  # known by its result


def test_what_a_claim_prices_ahead_follows_what_its_candidates_were(queue: RequestQueue) -> None:
    """All of a claim's candidates estimated: the next batch's worth is handed ahead as it
    stands (an exact one among them is counted again, and that count ignored); a mix:
    only the estimated ones among them; none estimated: nothing is handed ahead, and a
    claim of exact requests needs no pricing round."""
    def request(i: int, exact: bool) -> Request:
        return Request.validated(id=f"r{i}", input="abcdefgh"[i], **({"tokens": 1} if exact else {}))
    queue.enqueue([request(i, exact) for i, exact in enumerate([0, 0, 1, 0, 0, 1, 1, 1])])
    priced = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True)
    first = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True,
                        counts=[(i, 1) for i, _ in priced.to_price])
    assert [r.id for r in first.batch] == ["r0", "r1"]
    assert first.price_ahead == [("r2", "c"), ("r3", "d")]  # all estimated: as it stands
    second = queue.claim("w#2", 2, 10_000, 0, 10, price_estimates=True,
                         counts=[("r2", 99), ("r3", 1)])
    assert [(r.id, r.tokens) for r in second.batch] == [("r2", 1), ("r3", 1)]
    assert second.price_ahead == [("r4", "e")]  # a mix: the estimated one of r4, r5
    third = queue.claim("w#3", 2, 10_000, 0, 10, price_estimates=True, counts=[("r4", 1)])
    assert [r.id for r in third.batch] == ["r4", "r5"] and third.price_ahead == []
    fourth = queue.claim("w#4", 2, 10_000, 0, 10, price_estimates=True)
    assert [r.id for r in fourth.batch] == ["r6", "r7"] and fourth.price_ahead == []


def test_priced_ahead_leaves_out_what_the_worker_just_counted_and_follows_exact_candidates(
        queue: RequestQueue) -> None:
    """The candidates a full batch left were counted with this claim and stay exact: they
    are not handed ahead again. After a claim of exact candidates nothing is handed ahead,
    even with an estimated request next in line: it gets its pricing round."""
    def request(i: int, exact: bool) -> Request:
        return Request.validated(id=f"r{i}", input="abcde"[i], **({"tokens": 1} if exact else {}))
    queue.enqueue([request(i, exact) for i, exact in enumerate([0, 0, 0, 1, 0])])
    priced = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True)
    assert [i for i, _ in priced.to_price] == ["r0", "r1"]
    first = queue.claim("w#1", 2, 10_000, 0, 10, price_estimates=True,
                        counts=[("r0", 1), ("r1", 1), ("r2", 1)])
    assert [r.id for r in first.batch] == ["r0", "r1"]
    assert first.price_ahead == [("r3", "d")]  # r2 was counted just now
    second = queue.claim("w#2", 2, 10_000, 0, 10, price_estimates=True, counts=[("r3", 99)])
    assert [(r.id, r.tokens) for r in second.batch] == [("r2", 1), ("r3", 1)]
    assert second.price_ahead == []  # its candidates were exact
    third = queue.claim("w#3", 2, 10_000, 0, 10, price_estimates=True)
    assert third.to_price == [("r4", "e")] and third.batch == []


COUNT = st.one_of(st.integers(1, 60), st.sampled_from([0, -3, None, "5:0", "7,1", "x\ny", 2.0,
                                                      99_999_999, 10**8, 2**40]))


def a_count(value: object) -> bool:
    """What the claim takes as a count: a positive integer of at most 8 digits."""
    return type(value) is int and 0 < value < 10**8


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(1, 12), size=st.integers(1, 6), budget=st.integers(20, 400))
def test_counts_sent_in_line_or_in_another_order_claim_alike(
        queue: RequestQueue, data: st.DataObject, n: int, size: int, budget: int) -> None:
    """A worker's counts come as the ids it counted and their counts, in one order. When the
    ids are the claim's first candidates, in line (what an earlier claim handed it ahead),
    each count is its candidate's by place; in any other order, by id, an id's first count
    standing: the same counts, so the same batch, the same requests handed to price, the
    same counts written back for the ones left queued. A count that is not a positive
    integer is ignored either way, and shifts none of the others; one for an id not pending
    is ignored. (The leased ones are
    counted again by their worker: their entries are left as they were.)"""
    example = next(EXAMPLES)
    queues = [RequestQueue(queue.client, f"{queue.name}c{example}{side}") for side in "ab"]
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    for q in queues:
        q.enqueue([Request.validated(id=f"r{i}", input="w " * length)
                   for i, length in enumerate(lengths)])
    line = queue.client.zrange(queues[0].keys.pending, 0, -1)  # the candidates, in line
    counted = data.draw(st.integers(1, n))
    counts = [(i, data.draw(COUNT)) for i in line[:counted]]
    # the same counts in any order, always matched by id: with a count for an id that is not
    # pending, and an id's count again (its first one stands)
    again = 99 if a_count(counts[0][1]) else None
    shuffled = [*data.draw(st.permutations(counts)), ("ghost", 5), (counts[0][0], again)]
    outcomes = []
    for q, sent in zip(queues, [counts, shuffled]):
        reply = q.claim("w#1", size, budget, 0, 16, price_estimates=True, counts=sent)
        entries = q.client.hgetall(q.keys.sched)
        outcomes.append(([(r.id, r.tokens) for r in reply.batch], reply.to_price,
                         reply.price_ahead, {i: e.split(":")[0] for i, e in entries.items()}))
    assert outcomes[0] == outcomes[1]
    leased, to_price, _, tokens = outcomes[0]
    given_counts = {i: c for i, c in reversed(counts) if a_count(c)}
    for request_id, count in leased:  # leased on its count, where it had one
        assert count == given_counts.get(request_id, count)
    for request_id, text in tokens.items():  # left queued: exact where counted, else estimated
        if request_id not in dict(leased):
            assert text == str(given_counts[request_id]) if request_id in given_counts \
                else text.startswith("~")
    assert not to_price or not leased


# Redis' own MessagePack reading what packed_array wrote: each item as its type and value
UNPACK = """local t = cmsgpack.unpack(ARGV[1])
local out = {}
for i = 1, #t do
  out[i] = type(t[i]) == 'number' and {'n', tostring(t[i])} or {type(t[i]), t[i]}
end
return {#t, out}"""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.one_of(st.text(max_size=300), st.integers(0, 99_999_999)), max_size=40))
@example(items=["x" * 31, "y" * 32, "z" * 255, "w" * 256, "v" * 65_535, "u" * 65_536, 127, 128,
                99_999_999, "", "é" * 20])
@example(items=list(range(15)))  # arrays at each of their header's bounds
@example(items=list(range(16)))
@example(items=[1] * 65_535)
@example(items=[1] * 65_536)
@example(items=["doc-\udcff", "\udc80\udcfe"])  # bytes that are not UTF-8, read from Redis
def test_packed_arrays_unpack_in_redis_as_they_were_packed(queue: RequestQueue,
                                                          items: list[str | int]) -> None:
    """A worker's counts go to the claim as two MessagePack arrays (ids and counts), which
    the claim reads with Redis' own cmsgpack: every text (any length, any characters, bytes
    that are not UTF-8 as the client reads them) and every count comes back as it was, in
    its place."""
    n, out = queue.client.eval(UNPACK, 0, packed_array(items))
    assert n == len(items)
    assert [("n", str(i)) if type(i) is int else ("string", i) for i in items] == \
        [tuple(pair) for pair in out]


def test_counts_sent_in_line_are_written_back_for_the_candidates_left_queued(
        queue: RequestQueue) -> None:
    """Counts sent in line for every candidate, and a budget that takes two of three: the
    one left queued keeps its count, exact, for the next claim (no pricing round)."""
    queue.enqueue([Request.validated(id=f"r{i}", input="w " * (i + 1)) for i in range(3)])
    line = queue.client.zrange(queue.keys.pending, 0, -1)
    counts = dict(zip(line, [5, 5, 50]))
    first = queue.claim("w#1", 3, 10, 0, 16, price_estimates=True, counts=list(counts.items()))
    assert [(r.id, r.tokens) for r in first.batch] == [(i, 5) for i in line[:2]]
    assert queue.client.hget(queue.keys.sched, line[2]).split(":")[0] == "50"
    second = queue.claim("w#2", 3, 100, 0, 16, price_estimates=True)
    assert [(r.id, r.tokens) for r in second.batch] == [(line[2], 50)] and not second.to_price


@pytest.mark.parametrize("sent, leased, to_price, written", [
    # in line: each count its candidate's by place
    ([("a", 5), ("b", 6), ("c", 8)], [("a", 5)], [], {"b": "6", "c": "8"}),
    # another order: by id
    ([("b", 6), ("a", 5), ("c", 8)], [("a", 5)], [], {"b": "6", "c": "8"}),
    # the first ones in line, the last not: all by id, none by place
    ([("a", 5), ("b", 6), ("ghost", 7)], [], ["c"], {"a": "5", "b": "6", "c": "~"}),
    # the last ones in line, the first not: by id; the head is priced
    ([("ghost", 7), ("b", 6), ("c", 8)], [], ["a"], {"b": "6", "c": "8"}),
], ids=["in line", "another order", "last one off", "first one off"])
def test_counts_are_matched_by_place_only_when_every_id_is_in_line(
        queue: RequestQueue, sent: list[tuple[str, int]], leased: list[tuple[str, int]],
        to_price: list[str], written: dict[str, str]) -> None:
    """Counts go by place only when the ids sent are the first candidates, each in its
    place; one id off, first or last, and every count goes by its id (a count never lands
    on a request it was not made for)."""
    queue.enqueue([Request.validated(id=i, input="w") for i in "abc"])
    # three candidates read (a batch of 3), a budget that takes the head alone
    reply = queue.claim("w#1", 3, 5, 0, 16, price_estimates=True, counts=sent)
    assert [(r.id, r.tokens) for r in reply.batch] == leased
    assert [i for i, _ in reply.to_price] == to_price
    for request_id, tokens in written.items():
        assert queue.client.hget(queue.keys.sched, request_id).split(":")[0].startswith(tokens)


def test_the_claim_takes_a_count_of_at_most_eight_digits_and_whole(queue: RequestQueue) -> None:
    """The claim's own check of what it is sent (the worker sends only counts): 9 digits
    and a fraction are not counts; their requests stay estimated."""
    queue.enqueue([Request.validated(id=i, input="w") for i in "abcd"])
    call = claim_call(queue.keys, "w#1", 1, 10_000, 0, 16, True,
                      [(i, 1) for i in "abcd"], None)
    whole_float = b"\xcb" + struct.pack(">d", 3.0)  # a count as a float: taken as 3
    call.args[9] = (b"\x94\x05" + struct.pack(">BI", 0xCE, 10**8)
                     + b"\xcb" + struct.pack(">d", 2.5) + whole_float)
    reply = queue._run("claim", call)
    assert reply[4] == "a" and reply[5].startswith("5:")  # leased on its count
    tokens = {i: queue.client.hget(queue.keys.sched, i).split(":")[0] for i in "bcd"}
    assert tokens["b"].startswith("~") and tokens["c"].startswith("~") and tokens["d"] == "3"


def test_a_count_of_eight_digits_is_taken_and_one_of_nine_is_not(queue: RequestQueue) -> None:
    """The bounds of a count: 99,999,999 is one (written back exact for a request left
    queued), 100,000,000 is not (its request stays estimated, priced again)."""
    queue.enqueue([Request.validated(id=f"r{i}", input="w") for i in range(3)])
    line = queue.client.zrange(queue.keys.pending, 0, -1)
    counts = list(zip(line, [5, 99_999_999, 10**8]))
    reply = queue.claim("w#1", 1, 10, 0, 16, price_estimates=True, counts=counts)
    assert [(r.id, r.tokens) for r in reply.batch] == [(line[0], 5)]
    tokens = [queue.client.hget(queue.keys.sched, i).split(":")[0] for i in line[1:]]
    assert tokens[0] == "99999999" and tokens[1].startswith("~")


def test_claims_that_read_the_whole_lookahead_price_ahead_what_the_next_one_reads_first(
        queue: RequestQueue) -> None:
    """Varied lengths: a claim reads past its batch's worth, to the lookahead, and the next
    claim reads as far, so the requests it sees first are those past this one's end. Those
    are handed ahead to count, and a counting worker's claims over an estimated backlog
    need one pricing round, not one before nearly every claim; every request is leased
    once, on its exact count."""
    texts = [" ".join(["word"] * (1 + (i * 37) % 23)) for i in range(120)]
    queue.enqueue([Request.validated(id=f"r{i:03d}", input=t) for i, t in enumerate(texts)])
    exact = {f"r{i:03d}": 2 + len(t.split()) for i, t in enumerate(texts)}  # not the estimates
    rounds, leased, counts = 0, [], []
    for claim in range(1, 200):
        reply = queue.claim(f"w#{claim}", 4, 10_000, 0, 16, price_estimates=True, counts=counts)
        if reply.to_price:
            rounds += 1
            reply = queue.claim(f"w#{claim}", 4, 10_000, 0, 16, price_estimates=True,
                                counts=[(i, exact[i]) for i, _ in reply.to_price])
        if not reply.batch:
            break
        assert all(r.tokens == exact[r.id] for r in reply.batch)
        leased += [r.id for r in reply.batch]
        counts = [(i, exact[i]) for i, _ in reply.price_ahead]
    assert sorted(leased) == sorted(exact)
    assert rounds == 1


def test_a_worker_that_cannot_count_claims_on_the_estimates(queue: RequestQueue) -> None:
    queue.enqueue(requests("x" * 400))
    claimed = queue.claim("w#1", 10, 10_000, 0, 10).batch
    assert [(r.id, r.tokens) for r in claimed] == [("r0", 102)]


def test_retry_back_off_doubles_up_to_sixty_seconds(queue: RequestQueue) -> None:
    """Failure n waits min(60 s, 0.5 s x 2^(n-1)) before its retry. The test moves each
    retry's due time to now (its clock skips the wait) and reads the next wait as Redis
    wrote it."""
    queue.update_settings(max_attempts=12)
    queue.enqueue(requests("bad"), "c")
    waits = []
    for n in range(11):
        claimed = queue.claim(f"w#{n}", 10, 10_000, 0, 10).batch
        assert [r.id for r in claimed] == ["r0"]
        before = server_ms(queue)
        assert failed(queue, claimed) == [1]
        due = queue.client.zscore(queue.keys.delayed, "r0")
        waits.append(due - before)
        queue.client.zadd(queue.keys.delayed, {"r0": server_ms(queue) - 1})  # skip the wait
    expected = [min(60_000, 500 * 2 ** n) for n in range(11)]
    assert expected[-4:] == [60_000] * 4  # the cap reached from the 8th failure on
    assert all(e <= w <= e + 100 for w, e in zip(waits, expected)), (waits, expected)


def test_a_stream_is_trimmed_and_expires(queue: RequestQueue) -> None:
    """A generation's stream keeps about MAXLEN entries, and expires TTL_S after its start
    or end whether or not anyone reads it."""
    from batchery.batching.streams import MAXLEN, TTL_S, StreamWriter
    writer = StreamWriter(queue.client, lambda request_id: queue.keys)
    writer.start("g", 1)
    writer.flush()
    key = queue.keys.stream("g")
    assert 0 < queue.client.ttl(key) <= TTL_S
    queue.client.persist(key)
    for chunk in range(3):
        for i in range(MAXLEN // 2):
            writer.text("g", f"t{i}", i)
        writer.flush()
    assert queue.client.ttl(key) == -1  # text entries leave the expiry alone
    writer.end("g", "length")
    writer.flush()
    assert MAXLEN <= queue.client.xlen(key) < MAXLEN + 200  # trimmed, approximately
    assert 0 < queue.client.ttl(key) <= TTL_S
    last = queue.client.xrevrange(key, count=1)[0][1]
    assert last == {"e": "end", "finish_reason": "length"}


def test_claim_keeps_padded_tokens_within_the_budget(queue: RequestQueue) -> None:
    """A batch costs its longest request x its size: with a budget of 250 padded tokens a
    claim takes two requests of 100 tokens, or the 100 alone beside a 200, never more."""
    queue.enqueue([Request.validated(id=f"e{i}", input=i, tokens=100) for i in range(4)], "c")
    assert [r.id for r in queue.claim("w#1", 10, 250, 0, 10).batch] == ["e0", "e1"]
    queue.enqueue([Request.validated(id="long", input=0, tokens=200)], "c")
    assert [r.id for r in queue.claim("w#2", 10, 250, 0, 10).batch] == ["e2", "e3"]
    assert [r.id for r in queue.claim("w#3", 10, 250, 0, 10).batch] == ["long"]


def test_alike_requests_are_taken_in_rank_order_while_they_fit(queue: RequestQueue) -> None:
    """Requests of one length and class, as many as a batch holds or all there are: a
    claim takes them in rank order while they fit the budget (the head always), and a
    batch the budget cut short goes at once; one the lookahead or the queue cut short
    waits for company."""
    queue.enqueue([Request.validated(id=f"e{i}", input=i, tokens=100) for i in range(10)], "c")
    # max_size 4, lookahead 4: the first 4 read, 2 of them fit 250 padded tokens
    cut = queue.claim("w#1", 4, 250, 60_000, 4)
    assert [r.id for r in cut.batch] == ["e0", "e1"] and cut.wait_ms == 0
    assert [r.id for r in queue.claim("w#2", 4, 10_000, 60_000, 4).batch] == ["e2", "e3", "e4", "e5"]
    assert [r.id for r in queue.claim("w#3", 4, 50, 60_000, 4).batch] == ["e6"]  # over, alone
    held = queue.claim("w#4", 4, 10_000, 60_000, 2)  # 2 read, both fit, room for 2 more
    assert held.batch == [] and 50_000 < held.wait_ms <= 60_000
    assert [r.id for r in queue.claim("w#5", 4, 10_000, 0, 2).batch] == ["e7", "e8"]
    # fewer pending than a batch's worth, all read: the same rule
    queue.enqueue([Request.validated(id=f"g{i}", input=i, tokens=100) for i in range(3)], "c")
    assert [r.id for r in queue.claim("w#6", 8, 250, 60_000, 8).batch] == ["e9", "g0"]
    held = queue.claim("w#7", 8, 10_000, 60_000, 8)
    assert held.batch == [] and 50_000 < held.wait_ms <= 60_000
    assert [r.id for r in queue.claim("w#8", 8, 10_000, 0, 8).batch] == ["g1", "g2"]
    assert set(queue.leases()) == {"w#1", "w#2", "w#3", "w#5", "w#6", "w#8"}


def test_a_partial_batch_waits_for_company_up_to_max_wait(queue: RequestQueue) -> None:
    """A batch that is not full is held until its head has waited --max-wait-ms; a full
    one goes at once."""
    queue.enqueue(requests("a"), "c")
    held = queue.claim("w#1", 2, 10_000, 60_000, 10)
    assert held.batch == [] and 50_000 < held.wait_ms <= 60_000
    queue.enqueue([Request.validated(id="b", input="b")], "c")
    assert sorted(r.id for r in queue.claim("w#2", 2, 10_000, 60_000, 10).batch) == ["b", "r0"]


def test_no_fill_from_slower_leaves_the_room_empty_and_runs_at_once(queue: RequestQueue) -> None:
    """With --no-fill-from-slower a realtime head takes no batch-class company: it runs
    alone, at once (the room left empty counts as full); with fill, both go together."""
    queue.enqueue(requests("rt", priority="realtime") +
                  [Request.validated(id="slow", input="b", priority="batch")], "c")
    queue.update_settings(fill_from_slower=False)
    assert [r.id for r in queue.claim("w#1", 10, 10_000, 60_000, 10).batch] == ["r0"]
    queue.enqueue([Request.validated(id="rt2", input="c", priority="realtime")], "c")
    queue.update_settings(fill_from_slower=True)
    assert [r.id for r in queue.claim("w#2", 10, 10_000, 0, 10).batch] == ["rt2", "slow"]


def test_each_script_names_its_fixed_keys_once_and_reads_them_by_name() -> None:
    """FIXED_KEYS is the one place a script's KEYS order is written: each name is a key
    that Keys makes, the script reads it as K.<name>, and no script indexes KEYS by a
    number (only past its fixed keys: KEYS[FIXED + i])."""
    import re
    from importlib import resources

    from batchery.batching.keys import Keys
    from batchery.batching.scripts import FIXED_KEYS, NAMES

    folder = resources.files("batchery.batching") / "lua"
    on_disk = {p.name[:-4] for p in folder.iterdir()
               if p.name.endswith(".lua") and not p.name.startswith("_")}
    assert set(NAMES) == on_disk
    for name, fixed in FIXED_KEYS.items():
        assert len(set(fixed)) == len(fixed), name
        assert all(hasattr(Keys, key) for key in fixed), name
        code = "\n".join(line for line in (folder / f"{name}.lua").read_text().splitlines()
                         if not line.lstrip().startswith("--"))
        assert not re.search(r"KEYS\[\d", code), f"{name}.lua indexes KEYS by number"
        assert set(re.findall(r"\bK\.(\w+)", code)) <= set(fixed), name
