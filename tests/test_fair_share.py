"""Weighted fair share between the tenants of a class (docs/fair-share.md), over real
claims against a real Redis: the service bound, no credit for idle time, and the
sub-queues kept in step with pending through cancel, release, retries and the reaper."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from batchery.batching.calls import Cancelled, Failed
from batchery.batching.messages import Result
from batchery.batching.keys import FAIR_MODE_FIELD
from batchery.batching.request import Request
from batchery.batching.queue import RequestQueue
from tests.conftest import RedisServer, examples, wait_for

MAX_SIZE, BUDGET = 8, 64  # a claim's max_batch_size and max_batch_tokens (padded)
TOKENS = itertools.count()  # a claim token names one claim: each claim gets its own


@pytest.fixture
def queue(rconn: redis.Redis, queue_name: str) -> RequestQueue:
    return RequestQueue(rconn, queue_name)


def enqueue(queue: RequestQueue, tenant: str, n: int, seed: int, priority: str = "batch") -> None:
    rng = random.Random(seed)
    queue.enqueue([Request.validated(id=f"{tenant}-{seed}-{i}", input="x", priority=priority,
                                     tokens=rng.randint(1, 16), tenant=tenant)
                   for i in range(n)])


def bound(weights: dict[str, float]) -> float:
    """The docs' bound for tenants that start level: Q + T / w_min, Q = T = the budget
    (no request is longer than it)."""
    return BUDGET + BUDGET / min(weights.values())


def claim_all(queue: RequestQueue, weights: dict[str, float], check_from: int = 0) -> list[float]:
    """Claim until the queue is empty; after each claim while every tenant is backlogged,
    record the largest gap between two tenants' weighted tokens served since claim number
    ``check_from``. Returns those gaps."""
    served = dict.fromkeys(weights, 0.0)
    left = {t: sum(1 for i in queue.client.zrange(queue.keys.pending, 0, -1) if i.startswith(t + "-"))
            for t in weights}
    gaps, n = [], 0
    while any(left.values()):
        reply = queue.claim(f"w#{next(TOKENS)}", MAX_SIZE, BUDGET, 0, 256)
        assert reply.batch, reply
        both = all(left.values())
        for r in reply.batch:
            left[r.tenant] -= 1
            if n >= check_from:
                served[r.tenant] += r.tokens / weights[r.tenant]
        if both and n >= check_from:
            gaps.append(max(served.values()) - min(served.values()))
        n += 1
    return gaps


@pytest.mark.parametrize("weights", [{"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 2.0},
                                     {"a": 1.0, "b": 1.0, "c": 2.0}])
def test_backlogged_tenants_served_tokens_stay_within_the_bound(queue: RequestQueue,
                                                                  weights: dict[str, float]) -> None:
    queue.update_settings(tenant_weights={t: w for t, w in weights.items() if w != 1})
    for seed, tenant in enumerate(weights):  # a first: unfair service would serve it alone
        enqueue(queue, tenant, 400, seed)
    gaps = claim_all(queue, weights)
    assert len(gaps) > 20 and max(gaps) <= bound(weights), (max(gaps), bound(weights))


def test_the_same_queue_without_tenants_serves_in_rank_order(queue: RequestQueue) -> None:
    """The counter-check: one tenant is served by age, so the first would be served alone."""
    enqueue(queue, "default", 50, 1)
    firsts = [r.id for r in queue.claim("w#1", MAX_SIZE, BUDGET, 0, 256).batch]
    assert all(i.startswith("default-") for i in firsts)


def test_idle_time_banks_no_credit(queue: RequestQueue) -> None:
    """a is served alone for a while; b, arriving later, shares from then on within the
    bound, not exclusively until it has caught up with a's tokens."""
    weights = {"a": 1.0, "b": 1.0}
    enqueue(queue, "a", 600, 1)
    for n in range(30):
        queue.claim(f"alone#{n}", MAX_SIZE, BUDGET, 0, 256)
    enqueue(queue, "b", 300, 2)
    gaps = claim_all(queue, weights)
    assert len(gaps) > 20 and max(gaps) <= bound(weights), max(gaps)


def test_a_tenant_back_from_idle_starts_at_the_class_floor(queue: RequestQueue) -> None:
    """The class empties, a tenant never seen comes: it starts where the class was, so the
    next one back (with a high counter) is not starved while it catches up."""
    weights = {"a": 1.0, "b": 1.0}
    enqueue(queue, "a", 100, 1)
    claim_all(queue, weights)  # a alone: its counter is ~100 x 8.5 tokens
    enqueue(queue, "b", 200, 2)
    enqueue(queue, "a", 200, 3)
    gaps = claim_all(queue, weights)
    assert max(gaps) <= bound(weights), max(gaps)


def fair_ids(queue: RequestQueue) -> set[str]:
    return {m.split("\t")[3] for m in queue.client.zrange(queue.keys.fair, 0, -1)}


def test_sub_queues_follow_pending_through_cancel_release_retry_and_reap(
        queue: RequestQueue) -> None:
    queue.update_settings(lease_seconds=1)
    enqueue(queue, "a", 20, 1, priority="normal")
    enqueue(queue, "b", 20, 2, priority="normal")
    pending = lambda: set(queue.client.zrange(queue.keys.pending, 0, -1))  # noqa: E731
    queue.cancel(["a-1-0", "b-2-5"])
    assert fair_ids(queue) == pending() and len(pending()) == 38
    first = queue.claim("w#1", MAX_SIZE, BUDGET, 0, 256).batch
    assert fair_ids(queue) == pending() and len(pending()) == 38 - len(first)
    queue.release([(r.id, r.lease_token) for r in first[:2]])
    failing = first[2:4]
    queue.fail([(r.id, r.lease_token, Result(r.id, "dead", error={"type": "E", "message": "m"})
                 .to_json()) for r in failing])
    assert fair_ids(queue) == pending()
    time.sleep(1.1)  # the rest of the batch's lease lapses; the retries become due
    assert len(queue.reap().requeued) == len(first) - 4
    queue.claim("w#2", 1, 1, 10**6, 1)  # held back (max_wait): nothing taken, retries due
    assert fair_ids(queue) == pending() and {r.id for r in failing} <= pending()
    while queue.claim("w#drain", MAX_SIZE, BUDGET, 0, 256).batch:
        pass
    assert not pending() and not fair_ids(queue)
    assert queue.client.zcard(queue.keys.fair_tenants) == 0
    assert queue.depth() == {"normal": 0}
    served = queue.client.hgetall(queue.keys.served)
    assert set(served) == {"a", "b"} and all(int(v) > 0 for v in served.values())


def test_a_fair_batch_is_overtaken_only_by_what_is_more_urgent_than_the_class(
        queue: RequestQueue) -> None:
    """A worker gives back a batch claimed ahead when a more urgent request is pending
    (workers/claiming.py): a tenant's batch chosen over another's older requests of the
    same class is not overtaken by those, only by a request ranked before them."""
    enqueue(queue, "a", 20, 1)
    a_enqueued = queue.head_rank() - 60_000  # its rank less the batch class's delay
    wait_for(lambda: (lambda t: t[0] * 1000 + t[1] // 1000)(queue.client.time()) > a_enqueued,
             5, 0.001, message="the Redis clock to move on")  # b ranks after a
    enqueue(queue, "b", 20, 2)
    first = queue.claim("w#a", 1, BUDGET, 0, 256).batch  # batches of one: one tenant each
    second = queue.claim("w#b", 1, BUDGET, 0, 256).batch
    assert {r.tenant for r in first} == {"a"} and {r.tenant for r in second} == {"b"}
    against = min(r.chosen_against or r.rank for r in second)
    assert queue.head_rank() < min(r.rank for r in second)  # a's older ones wait...
    assert queue.head_rank() >= against                      # ...and do not overtake it
    queue.enqueue([Request.validated(id="urgent", input="x", priority="realtime", tokens=1)])
    assert queue.head_rank() < against


def test_a_tenant_over_its_token_rate_is_passed_over_and_nothing_else(queue: RequestQueue) -> None:
    """Over its rate, a tenant's requests wait (in the fair claim, by the global lookahead,
    at the head of the queue or behind it); the others are served; when only its requests
    are left, the claim says when its bucket refills (not "nothing pending")."""
    queue.update_settings(tenant_token_rates={"a": 50.0})  # a bucket of 50 tokens
    enqueue(queue, "a", 40, 1, priority="realtime")        # a heads the queue
    enqueue(queue, "b", 10, 2)
    enqueue(queue, "c", 10, 3)
    taken: dict[str, int] = {}
    for n in range(40):
        reply = queue.claim(f"w#rate-{n}", MAX_SIZE, BUDGET, 0, 256)
        for r in reply.batch:
            taken[r.tenant] = taken.get(r.tenant, 0) + r.tokens
        if not reply.batch:
            break
    assert taken["b"] and taken["c"] and not queue.client.hget(queue.keys.depth, "tenant:b")
    assert 0 < taken["a"] <= 50 + BUDGET, taken  # its burst, and one batch past it at most
    assert reply.wait_ms > 0 and not reply.batch  # a waits for its bucket
    queue.update_settings(tenant_token_rates={"a": 0.0})  # no limit, at once
    assert queue.claim("w#rate-lifted", MAX_SIZE, BUDGET, 0, 256).batch


def test_token_rates_are_checked() -> None:
    from batchery.batching.settings import DEFAULTS
    from batchery.errors import ConfigError
    for bad in (-1.0, float("nan"), 1e12):
        with pytest.raises(ConfigError, match="token rate for 'a'"):
            DEFAULTS.updated(tenant_token_rates={"a": bad})


def test_the_share_holds_across_shards(rconn: redis.Redis, queue_name: str) -> None:
    """Four shards, each with its own counters; a claim goes to the shard with the most
    urgent head. a's backlog is older than b's by twice the shards' ceiling slack (by age
    a would be served alone for a while); both kept backlogged (each claim's requests
    enqueued again), they are served 1 : 2 by weight, within each shard's bound summed."""
    from batchery.batching.sharded import open_queue
    shards, weights = 4, {"a": 1.0, "b": 2.0}
    sharded = open_queue(rconn, queue_name)
    sharded.update_settings(shards=shards, tenant_weights={"b": 2.0})
    rng, made = random.Random(7), itertools.count()

    def add(tenant: str, n: int) -> None:
        sharded.enqueue([Request.validated(id=f"{tenant}-{next(made)}", input="x",
                                           priority="batch", tokens=rng.randint(1, 16),
                                           tenant=tenant) for _ in range(n)])
    add("a", 800)
    time.sleep(0.5)  # b's ranks come 500 ms after a's: twice SHARD_SLACK_MS
    add("b", 800)
    served, gaps = dict.fromkeys(weights, 0.0), []
    for _ in range(300):
        taken = dict.fromkeys(weights, 0)
        for r in sharded.claim(f"w#{next(TOKENS)}", MAX_SIZE, BUDGET, 0, 256).batch:
            served[r.tenant] += r.tokens / weights[r.tenant]
            taken[r.tenant] += 1
        for tenant, n in taken.items():
            add(tenant, n)
        gaps.append(abs(served["a"] - served["b"]))
    assert max(gaps) <= shards * bound(weights), (max(gaps), shards * bound(weights))
    share_b = served["b"] * 2 / (served["a"] + served["b"] * 2)
    assert abs(share_b - 2 / 3) < 0.03, share_b  # b's share of the tokens served: 2/3


# -- sub-queues only once shared (lua/_common.lua FAIR_MODE) ----------------------------

def listing(queue: RequestQueue) -> dict[str, Any]:
    """What the queue keeps of its sub-queues: its mode ('listed', 'sole\\tTENANT',
    'listing\\tRANK' or None), the listed members by id, the pending ids and entries, fair_tenants' (class,
    tenant) pairs."""
    c, k = queue.client, queue.keys
    pending = c.zrange(k.pending, 0, -1)
    return {"mode": c.hget(k.vtc, FAIR_MODE_FIELD),
            "members": {m.split("\t")[3]: m for m in c.zrange(k.fair, 0, -1)},
            "pending": dict(zip(pending, c.hmget(k.sched, pending) if pending else [])),
            "tenants": {tuple(m.split("\t")[::2]) for m in c.zrange(k.fair_tenants, 0, -1)}}


def check_listing(queue: RequestQueue) -> str:
    """The rule of the sub-queues, whatever came before: listed, every pending request is
    in its (class, tenant) sub-queue at its rank and nothing else is, and the backlogged
    tenants are those with work pending; listing, so are those ranked before where the
    listing has come to, and nothing listed is not pending; else nothing is listed and the
    pending work is one tenant's, the sole one, backlogged in each class it has work in.
    Returns the mode."""
    state = listing(queue)
    # tokens:expire:enqueued:rank:class:client:tenant
    entries = {i: s.split(":") for i, s in state["pending"].items()}
    pairs = {(e[4], e[6]) for e in entries.values()}
    members = {i: f"{e[4]}\t{e[6]}\t{int(e[3]):015d}\t{i}" for i, e in entries.items()}
    if (state["mode"] or "").startswith("listing\t"):
        upto = float(state["mode"].split("\t")[1])
        assert state["members"].items() <= members.items()
        assert {i for i, e in entries.items() if int(e[3]) < upto} <= state["members"].keys()
        return "listing"
    if state["mode"] == "listed" or (state["mode"] is None and state["members"]):
        assert state["members"] == members
        assert state["tenants"] == pairs
        return "listed"
    assert not state["members"]
    if state["mode"] is None:
        assert not entries
        return "new"
    sole = state["mode"].removeprefix("sole\t")
    assert {tenant for _, tenant in pairs} <= {sole} and pairs <= state["tenants"]
    assert {tenant for _, tenant in state["tenants"]} <= {sole}
    return "sole"


def test_one_tenant_lists_nothing_until_another_has_work_pending_beside_it(
        queue: RequestQueue) -> None:
    """A's work alone: nothing listed, however it is claimed. B's work beside it: the whole
    backlog is listed and shared from the next claim on. Once the queue is empty, the
    next tenant alone lists nothing again."""
    enqueue(queue, "a", 300, 1)
    assert check_listing(queue) == "sole"
    for n in range(5):
        queue.claim(f"w#a{n}", MAX_SIZE, BUDGET, 0, 256)
        assert check_listing(queue) == "sole"
    enqueue(queue, "b", 40, 2)
    assert check_listing(queue) == "listed"  # a's backlog too (check_listing: all pending)
    assert {m.split("\t")[1] for m in listing(queue)["members"].values()} == {"a", "b"}
    firsts = [queue.claim(f"w#ab{n}", MAX_SIZE, BUDGET, 0, 256).batch for n in range(4)]
    assert {r.tenant for batch in firsts for r in batch} == {"a", "b"}  # shared, not a's alone
    assert check_listing(queue) == "listed"
    while queue.claim(f"w#{next(TOKENS)}", MAX_SIZE, BUDGET, 0, 256).batch:
        assert check_listing(queue) in ("listed", "new")
    assert check_listing(queue) == "new" and not listing(queue)["tenants"]
    enqueue(queue, "b", 10, 3)
    assert check_listing(queue) == "sole"


def test_a_deep_backlog_is_listed_a_step_per_call_and_then_shared(queue: RequestQueue) -> None:
    """z's backlog is over two listing steps deep: the switching call lists one step, each
    call after it (an enqueue, a claim) one more, the global lookahead serving by age
    meanwhile (b, level with z and first by name, would lead a fair claim); requests given
    back or cancelled meanwhile keep the rule; once all is listed, z and b share the class
    within the bound."""
    for lo in range(0, 25_000, 500):  # as Client.map sends them: 500 a call, one rank each
        queue.enqueue([Request.validated(id=f"z-{i}", input="x", priority="batch",
                                         tokens=1 + i % 16, tenant="z")
                       for i in range(lo, lo + 500)])
    enqueue(queue, "b", 300, 2)
    assert check_listing(queue) == "listing"
    listed_z = sum(m.startswith("z-") for m in listing(queue)["members"])
    assert 0 < listed_z <= 10_000  # a step (the ranks past its last one: the next step's)
    given_back = queue.claim("w#back", MAX_SIZE, BUDGET, 0, 256).batch
    assert {r.tenant for r in given_back} == {"z"}  # by age while listing: z's oldest
    queue.release([(r.id, r.lease_token) for r in given_back])  # back below the listing's rank
    queue.cancel(["z-0", "z-24999"])  # one listed, one not yet
    assert check_listing(queue) == "listing"
    for n in range(10):  # each claim lists a step first; the one that ends it shares
        batch = queue.claim(f"w#listing{n}", MAX_SIZE, BUDGET, 0, 256).batch
        if check_listing(queue) == "listed":
            break
        assert {r.tenant for r in batch} == {"z"}  # by age while listing: z's oldest
    assert check_listing(queue) == "listed"
    gaps = claim_all(queue, {"z": 1.0, "b": 1.0})
    assert len(gaps) > 20 and max(gaps) <= bound({"z": 1.0, "b": 1.0}), max(gaps)


@pytest.mark.parametrize("back", ["release", "reaper", "retry due"])
def test_another_tenants_request_back_in_pending_lists_the_queue(queue: RequestQueue,
                                                                 back: str) -> None:
    """a's request is running when b becomes the sole tenant (a had nothing else pending);
    when a's request comes back to pending (given back, its lease lapsed, its retry due)
    beside b's work, the queue is listed: a is not served by age behind b's backlog."""
    enqueue(queue, "a", 1, 1)
    running = queue.claim("w#a", MAX_SIZE, BUDGET, 0, 256).batch
    enqueue(queue, "b", 30, 2)
    assert check_listing(queue) == "sole" and listing(queue)["mode"] == "sole\tb"
    r = running[0]
    if back == "release":
        queue.release([(r.id, r.lease_token)])
    elif back == "reaper":
        queue.client.zadd(queue.keys.lease_expiry, {r.lease_token: 0})  # its lease lapsed
        assert queue.reap().requeued == [r.id]
    else:
        queue.fail([(r.id, r.lease_token, Result(id=r.id, status="dead", error={
            "type": "E", "message": "m"}).to_json())])
        queue.client.zadd(queue.keys.delayed, {r.id: 0})  # its backoff over
        queue.claim("w#due", 1, BUDGET, 0, 256)  # moves it back to pending, claims one
        assert queue.client.zscore(queue.keys.delayed, r.id) is None
    assert check_listing(queue) == "listed"


def test_only_tenants_with_work_stay_backlogged_across_sole_tenants_and_the_switch(
        queue: RequestQueue) -> None:
    """a alone, then drained: b alone is the sole tenant and a is backlogged nowhere. a's
    work in two classes, one drained: when c's work comes beside it, a is backlogged in
    the class it has work in only (or c would start level with a's old counter there)."""
    enqueue(queue, "a", 3, 1)
    taken = queue.claim("w#a", MAX_SIZE, 10**6, 0, 256).batch
    queue.complete([(r.id, r.lease_token, Result(id=r.id, status="ok", attempts=1).to_json())
                    for r in taken], {"requests": len(taken)})
    enqueue(queue, "b", 3, 2)
    assert check_listing(queue) == "sole" and listing(queue)["tenants"] == {("batch", "b")}
    while queue.claim(f"w#{next(TOKENS)}", MAX_SIZE, 10**6, 0, 256).batch:
        pass
    enqueue(queue, "a", 3, 3, priority="normal")
    enqueue(queue, "a", 3, 4, priority="batch")
    assert {r.priority for r in queue.claim("w#normal", 3, 10**6, 0, 256).batch} == {"normal"}
    assert check_listing(queue) == "sole" and ("normal", "a") in listing(queue)["tenants"]
    enqueue(queue, "c", 1, 5, priority="normal")
    assert check_listing(queue) == "listed"  # backlogged: (batch, a) and (normal, c)
    assert listing(queue)["tenants"] == {("batch", "a"), ("normal", "c")}


def test_the_switch_lists_what_it_can_read(queue: RequestQueue) -> None:
    """A schedule entry damaged in Redis is not listed when the queue switches (no
    sub-queue to put it in); the others are, and the damaged one is still handed to a
    worker to fail alone."""
    enqueue(queue, "a", 20, 1)
    sched = queue.client.hgetall(queue.keys.sched)
    tail = sched["a-1-4"][sched["a-1-4"].index(":"):]
    damaged = {"a-1-3": "x" + sched["a-1-3"], "a-1-4": "123456789" + tail,  # 9 digits
               "a-1-5": sched["a-1-5"].replace(":batch:", "::")}              # no class
    queue.client.hset(queue.keys.sched, mapping=damaged)
    enqueue(queue, "b", 5, 2)
    members = listing(queue)["members"]
    assert listing(queue)["mode"] == "listed" and len(members) == 25 - len(damaged)
    assert not set(damaged) & set(members)
    handed = set()
    while batch := queue.claim(f"w#{next(TOKENS)}", MAX_SIZE, BUDGET, 0, 256).batch:
        handed |= {r.id for r in batch if r.invalid}
    assert handed == set(damaged)


def check_leases(queue: RequestQueue) -> None:
    """The leases, one per claim, whatever came before: each holds at least one request
    (none is left behind) and has an expiry; no request is held by two, and a held one
    is neither pending nor waiting out a retry, and still has its request."""
    conn, k = queue.client, queue.keys
    leases = queue.leases()
    assert set(conn.zrange(k.lease_expiry, 0, -1)) == set(leases)
    held = [i for ids in leases.values() for i in ids]
    assert all(leases.values()) and len(held) == len(set(held)), leases
    queued = set(conn.zrange(k.pending, 0, -1)) | set(conn.zrange(k.delayed, 0, -1))
    assert not queued & set(held), (queued & set(held), leases)
    assert all(conn.hmget(k.requests, held)) if held else True


OPS = st.lists(st.one_of(
    st.tuples(st.just("enqueue"), st.sampled_from("abc"), st.integers(1, 6),
              st.sampled_from(["normal", "batch"])),
    st.tuples(st.just("claim"), st.integers(1, 5)),
    st.tuples(st.sampled_from(["release", "fail", "due", "lapse", "complete", "complete_one",
                               "reclaim", "revive"])),
    st.tuples(st.just("cancel"), st.integers(0, 10**6))), max_size=40)
LISTING_RUNS = itertools.count()


@given(OPS, st.integers(1, 3))
@settings(max_examples=examples(60), deadline=None)
def test_the_sub_queues_follow_any_mix_of_tenants_and_paths(
        redis_server: RedisServer, ops: list[tuple], attempts: int) -> None:
    """Enqueues of any tenants, claims, releases, failures retried (their backoff over),
    leases lapsing (the reaper), dead letters revived, cancels, commits (of part of a
    claim too) and claims sent again under a token whose memory lapsed, in any order:
    after each, the sub-queues follow the rule of check_listing and the leases that of
    check_leases; drained (the dead letters revived first), every request ran once or was
    cancelled, and no lease is left. The queue's max_attempts (1 to 3) sets how soon a
    failure or a lapse dead-letters."""
    conn = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = RequestQueue(conn, f"listing-{next(LISTING_RUNS)}")
    queue.update_settings(max_attempts=attempts)
    made: list[str] = []
    held: list[Any] = []
    done, cancelled, dead = set(), set(), set()

    def finish(batch: list) -> None:
        queue.complete([(r.id, r.lease_token, Result(id=r.id, status="ok", attempts=1).to_json())
                        for r in batch], {"requests": len(batch)})
        done.update(r.id for r in batch)
    for n, op in enumerate(ops):
        if op[0] == "enqueue":
            ids = [f"{op[1]}-{n}-{i}" for i in range(op[2])]
            queue.enqueue([Request.validated(id=i, input="x", priority=op[3], tokens=1 + len(i) % 5,
                                             tenant=op[1]) for i in ids])
            made += ids
        elif op[0] == "claim":
            held += queue.claim(f"w#{n}", op[1], 10**6, 0, 64).batch
        elif op[0] == "release" and held:
            queue.release([(r.id, r.lease_token) for r in held])
            held = []
        elif op[0] == "fail" and held:
            r = held.pop(0)
            if queue.fail([(r.id, r.lease_token, Result(id=r.id, status="dead", error={
                    "type": "E", "message": "m"}).to_json())])[0] == Failed.DEAD:
                dead.add(r.id)
        elif op[0] == "due":  # the retries' backoff over: the next claim moves them back
            for i in conn.zrange(queue.keys.delayed, 0, -1):
                conn.zadd(queue.keys.delayed, {i: 0})
            held += queue.claim(f"w#due{n}", 1, 10**6, 0, 64).batch
        elif op[0] == "lapse" and held:  # the leases expire: the reaper takes them back
            conn.zadd(queue.keys.lease_expiry, {r.lease_token: 0 for r in held}, xx=True)
            dead.update(queue.reap().dead)  # (a third lapse dead-letters it)
            held = []
        elif op[0] == "complete" and held:
            finish(held)
            held = []
        elif op[0] == "complete_one" and held:  # a part of a claim: its lease holds the rest
            finish([held.pop(0)])
        elif op[0] == "reclaim" and held:  # a claim sent again after its memory lapsed
            token = held[0].lease_token
            conn.delete(queue.keys.claim(token))
            held += queue.claim(token, 2, 10**6, 0, 64).batch
        elif op[0] == "revive" and dead:  # `batchery queue dead retry --all`: pending again
            assert queue.revive(everything=True) == len(dead)
            dead.clear()
        elif op[0] == "cancel" and made:
            victim = made[op[1] % len(made)]
            if queue.cancel([victim])[0] in (Cancelled.QUEUED, Cancelled.RUNNING):
                cancelled.add(victim)
        check_listing(queue)
        check_leases(queue)
    finish(held)
    for i in conn.zrange(queue.keys.delayed, 0, -1):
        conn.zadd(queue.keys.delayed, {i: 0})
    assert queue.revive(everything=True) == len(dead)  # the dead run too, once revived
    check_listing(queue)
    while batch := queue.claim(f"w#drain{len(done)}", 8, 10**6, 0, 64).batch:
        finish(batch)
        check_listing(queue)
        check_leases(queue)
    lost = set(made) - done - cancelled
    assert not lost, lost
    assert not conn.hlen(queue.keys.lease_ids) and not conn.zcard(queue.keys.lease_expiry)
    conn.close()
