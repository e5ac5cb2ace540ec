"""Batch formation: the pure rule's invariants, and the Lua claim agreeing with it."""

from __future__ import annotations

import itertools
import json

import redis
from hypothesis import example, given, settings
from hypothesis import strategies as st

from batchery.batching.keys import Keys
from batchery.batching.settings import DEFAULT_CLASS_DELAYS
from batchery.batching.request import Request
from batchery.batching.policy import (Backlog, Candidate, charged, fair_lookahead, padded_tokens,
                                      planned_after, rank, select_batch, settled_by)
from batchery.batching.queue import RequestQueue
from tests.conftest import RedisServer

NOW = 1_800_000_000_000
LATER = 10 ** 13  # a "now" past every wait: the rule's choice when a claim leases at once


@st.composite
def lookaheads(draw: st.DrawFn) -> tuple[list[Candidate], int, int, int]:
    n = draw(st.integers(0, 40))
    # a third of the cases alike: one length, no deadline, realtime and normal only (a claim
    # whose candidates are alike and none less urgent than the head takes its own path)
    alike = draw(st.sampled_from([False, False, True]))
    tokens = draw(st.integers(1, 600))
    drawn = []
    for _ in range(n):
        enqueued = NOW - draw(st.integers(0, 70_000))
        if alike:
            delay = draw(st.sampled_from([0, 5000]))
        else:
            delay = draw(st.sampled_from([0, 5000, 60_000, 7]))  # classes, and an integer priority
            tokens = draw(st.integers(1, 600))
        drawn.append((enqueued + delay, enqueued, tokens,
                      0 if alike else draw(st.sampled_from([0, 0, 0, NOW - 1, NOW + 1000]))))
    drawn.sort(key=lambda c: c[0])  # rank order; ties: by id, as Redis orders them
    candidates = [Candidate(id=f"r{i:02d}", tokens=tokens, enqueued_ms=enqueued,
                            expire_ms=expire, rank=rank)
                  for i, (rank, enqueued, tokens, expire) in enumerate(drawn)]
    return (candidates, draw(st.integers(1, 16)), draw(st.integers(1, 4096)),
            draw(st.sampled_from([0, 50, 500])))


@given(lookaheads())
@settings(max_examples=500, deadline=None)
def test_budgets_hold_and_head_is_included(case: tuple) -> None:
    candidates, max_size, max_tokens, max_wait = case
    chosen = select_batch(candidates, NOW, max_size, max_tokens, max_wait)
    by_id = {c.id: c for c in candidates}
    live = [c for c in candidates if not 0 < c.expire_ms <= NOW]
    assert set(chosen.expired) == {c.id for c in candidates if 0 < c.expire_ms <= NOW}
    assert not set(chosen.batch) & set(chosen.expired)
    assert len(chosen.batch) == len(set(chosen.batch)) <= max_size
    if chosen.batch:
        assert chosen.batch[0] == live[0].id  # the head, always
        assert chosen.wait_ms == 0
        if len(chosen.batch) > 1:  # a lone head may exceed the budget; a batch never does
            assert padded_tokens([by_id[i].tokens for i in chosen.batch]) <= max_tokens
    elif live:
        assert 0 < chosen.wait_ms <= max_wait  # held back, and only while under max_wait


@given(lookaheads())
@settings(max_examples=200, deadline=None)
def test_repeated_claims_take_everything_exactly_once(case: tuple) -> None:
    candidates, max_size, max_tokens, _ = case
    remaining, taken = list(candidates), []
    while remaining:
        chosen = select_batch(remaining, NOW, max_size, max_tokens, 0)
        step = chosen.batch + chosen.expired
        assert step, "a claim with candidates and no wait must take something"
        taken += step
        remaining = [c for c in remaining if c.id not in set(step)]
    assert sorted(taken) == sorted(c.id for c in candidates)


def test_a_full_batch_goes_at_once_and_a_partial_one_waits() -> None:
    fresh = [Candidate(f"r{i}", 10, NOW) for i in range(4)]
    assert select_batch(fresh, NOW, 4, 1000, 50).batch == ["r0", "r1", "r2", "r3"]
    assert select_batch(fresh[:3], NOW, 4, 1000, 50).wait_ms == 50
    assert select_batch(fresh[:3], NOW + 50, 4, 1000, 50).batch == ["r0", "r1", "r2"]
    # over the token budget counts as full: waiting would not add anything that fits
    assert select_batch(fresh[:3], NOW, 4, 25, 50).batch == ["r0", "r1"]


def test_similar_lengths_are_preferred() -> None:
    lengths = [100, 10, 95, 12, 105, 11]
    candidates = [Candidate(f"r{i}", t, NOW - 100) for i, t in enumerate(lengths)]
    assert select_batch(candidates, NOW, 3, 10_000, 0).batch == ["r0", "r2", "r4"]


def test_a_more_urgent_class_joins_before_better_fitting_less_urgent_ones() -> None:
    # realtime requests of varied length, then batch-class ones exactly the head's length
    realtime = [Candidate(f"rt{i}", t, NOW + i, rank=NOW + i) for i, t in enumerate([50, 10, 200, 90])]
    flood = [Candidate(f"b{i}", 50, NOW - 59_000, rank=NOW + 1000 + i) for i in range(10)]
    chosen = select_batch(realtime + flood, NOW, 4, 10_000, 0).batch
    assert chosen == ["rt0", "rt1", "rt2", "rt3"]
    # with room left, the less urgent fill it by length; unless the queue says not to
    assert select_batch(realtime[:2] + flood, NOW, 4, 10_000, 0).batch == ["rt0", "rt1", "b0", "b1"]
    alone = select_batch(realtime[:2] + flood, NOW, 4, 10_000, 0, fill_from_slower=False)
    assert alone.batch == ["rt0", "rt1"]
    # left out on purpose, the room counts as full: with slower work waiting, holding the
    # head for company would only idle the model
    assert select_batch(realtime[:2] + flood, NOW, 4, 10_000, 10, fill_from_slower=False).batch == \
        ["rt0", "rt1"]
    assert select_batch(realtime[:2], NOW, 4, 10_000, 10, fill_from_slower=False).wait_ms == 10
    # an aged batch-class head still takes faster requests: they are in its first tier
    aged = Candidate("old", 50, NOW - 70_000, rank=NOW - 10_000)
    assert select_batch([aged, *realtime], NOW, 3, 10_000, 0, fill_from_slower=False).batch == \
        ["old", "rt0", "rt1"]


def test_under_an_endless_realtime_flood_a_batch_request_still_runs() -> None:
    """A worker that serves 10 requests/s, a realtime flood of 20/s (the backlog grows
    without end) and one batch-class request among them: strict priority would starve it;
    with aging it runs once the realtime requests that arrived before its delay ran out
    have run, and no realtime request that arrived later runs before it."""
    delays = {c: int(s * 1000) for c, s in DEFAULT_CLASS_DELAYS.items()}
    pending: list[Candidate] = []
    arrived: dict[str, int] = {}
    ran: list[str] = []
    now = 0
    while "old" not in ran:
        assert now < 300_000, "the batch request starved"
        new = [("old", "batch")] if now == 1000 else []
        new += [(f"rt{now}-{i}", "realtime") for i in range(2)]
        for rid, cls in new:
            arrived[rid] = now
            pending.append(Candidate(rid, 10, now, rank=rank(now, delays[cls])))
        pending.sort(key=lambda c: (c.rank, c.id))
        chosen = select_batch(pending[:64], now, 1, 10_000, 0).batch
        ran += chosen
        pending = [c for c in pending if c.id not in chosen]
        now += 100
    before = ran[:ran.index("old")]
    ranked_ahead = [r for r, t in arrived.items() if r != "old" and t < 1000 + delays["batch"]]
    assert sorted(before) == sorted(ranked_ahead)  # exactly those, and none that came later


@st.composite
def claim_cases(draw: st.DrawFn) -> tuple:
    """A lookahead case plus, per candidate, where it sits: queued, a retry whose backoff is
    over or not, or an orphan (pending with no state); and how far the claim looks ahead."""
    candidates, max_size, max_tokens, max_wait = draw(lookaheads())
    alike = len({(c.tokens, c.expire_ms) for c in candidates}) == 1
    kinds = (["queued"] * len(candidates) if alike and draw(st.booleans()) else
             [draw(st.sampled_from(["queued", "queued", "queued", "due", "not due", "orphan"]))
              for _ in candidates])
    estimated = [draw(st.booleans()) for _ in candidates]
    lookahead = draw(st.integers(1, len(candidates) + 1))
    return candidates, kinds, estimated, max_size, max_tokens, max_wait, lookahead


CLASS_OF_DELAY = {0: "realtime", 5000: "normal", 60_000: "batch", 7: "p7"}


@given(claim_cases(), st.booleans())
@settings(max_examples=80, deadline=None)
def test_lua_claim_agrees_with_the_python_rule(redis_server: RedisServer, case: tuple,
                                               fill_from_slower: bool) -> None:
    candidates, kinds, estimated, max_size, max_tokens, max_wait, lookahead = case
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = RequestQueue(client, "policy-agreement")
    k: Keys = queue.keys
    client.delete(*[getattr(k, name) for name in ("pending", "sched", "requests", "lease_ids",
                                                    "lease_expiry", "delayed", "depth",
                                                    "attempts", "plan")],
                 k.claim("w#1"))  # a token names one claim: a replay would return its batch
    client.hset(k.settings, "fill_from_slower", int(fill_from_slower))
    server_now = int(client.time()[0]) * 1000
    shift = server_now - NOW  # the same offsets from "now", on the server's clock
    shifted = [Candidate(c.id, c.tokens, c.enqueued_ms + shift,
                         c.expire_ms + shift if c.expire_ms else 0, c.rank + shift)
               for c in candidates]
    for c, kind, mark in zip(shifted, kinds, estimated):
        if kind in ("queued", "orphan"):
            client.zadd(k.pending, {c.id: c.rank})
        else:  # a retry in backoff: due in the past, or a minute from now
            client.zadd(k.delayed, {c.id: server_now - 1 if kind == "due" else server_now + 60_000})
        if kind != "orphan":
            cls = CLASS_OF_DELAY[c.delay_ms]
            client.hset(k.sched, c.id, f"{'~' * mark}{c.tokens}:{c.expire_ms}:{c.enqueued_ms}:"
                                       f"{c.rank}:{cls}:")
            client.hset(k.requests, c.id, json.dumps({"input": c.id}))
    reply = queue.claim("w#1", max_size, max_tokens, max_wait, lookahead=lookahead)
    # the rule the claim implements around select_batch: due retries rejoin at their rank,
    # the lookahead is the first `lookahead` pending ids (orphans, with no schedule entry,
    # included: leased with the batch, before it, for the worker to fail each alone)
    window = [c for c, kind in zip(shifted, kinds) if kind != "not due"][:lookahead]
    orphans = {c.id for c, kind in zip(shifted, kinds) if kind == "orphan"}
    # ... read lazily: no further than a batch's worth when those settle the batch
    if settled_by([None if c.id in orphans else c for c in window], reply.now_ms, max_size):
        window = window[:max_size]
    expected = select_batch([c for c in window if c.id not in orphans], reply.now_ms, max_size,
                            max_tokens, max_wait, fill_from_slower)
    unreadable = [c.id for c in window if c.id in orphans]
    assert [r.id for r in reply.expired] == expected.expired
    assert [r.id for r in reply.batch] == unreadable + expected.batch
    assert all(r.invalid for r in reply.batch[:len(unreadable)])
    if not window:  # nothing pending: -1, or the time until the first retry is due
        assert reply.nothing_pending if "not due" not in kinds else 0 < reply.wait_ms <= 60_000
    elif not expected.batch and not expected.expired:  # orphans only (0), or held back
        assert reply.wait_ms == expected.wait_ms
    taken = set(expected.batch) | set(expected.expired) | set(unreadable)
    assert set(queue.leases().get("w#1", [])) == taken  # held by the claim's one lease
    assert client.zrange(k.lease_expiry, 0, -1) == (["w#1"] if taken else [])
    still_pending = set(client.zrange(k.pending, 0, -1))
    assert not still_pending & taken
    assert {c.id for c, kind in zip(shifted, kinds) if kind == "queued" or kind == "due"} - taken \
        <= still_pending  # nothing queued lost: untaken ones (due retries too) wait in pending
    assert set(client.zrange(k.delayed, 0, -1)) == \
        {c.id for c, kind in zip(shifted, kinds) if kind == "not due"}
    client.close()


def test_a_settled_claim_reads_no_further_than_its_batch(redis_server: RedisServer) -> None:
    """Equal lengths at the head: the claim reads a batch's worth, not the lookahead (an
    orphan further back, which a read would lease to be failed, stays); a longer head
    reads on."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = RequestQueue(client, "policy-lazy")
    k: Keys = queue.keys
    for tokens in ((5, 5, 5), (9, 5, 5)):
        client.delete(k.pending, k.sched, k.requests)
        now = int(client.time()[0]) * 1000
        for n, t in enumerate(tokens):
            client.zadd(k.pending, {f"r{n}": now + n})
            client.hset(k.sched, f"r{n}", f"{t}:0:{now + n}:{now + n}:realtime:")
            client.hset(k.requests, f"r{n}", json.dumps({"input": n}))
        client.zadd(k.pending, {"orphan": now + 10})
        reply = queue.claim(f"w#{tokens[0]}", 2, 10_000, 0, lookahead=10)
        read_on = tokens[0] != 5
        assert [r.id for r in reply.batch] == ["orphan"] * read_on + ["r0", "r1"]
        assert client.zscore(k.pending, "orphan") == (None if read_on else now + 10)
    client.close()


def leases_and_plans(read: list[Candidate], most: int, budget: int,
                     lookahead: int) -> tuple[list[str], list[list[str]]]:
    """What a claim that reads ``read`` (the lookahead, in rank order) leases at once, and
    the batches it plans after it."""
    chosen = select_batch(read, LATER, most, budget, 0)
    return chosen.batch, planned_after(read, chosen, LATER, most, budget, lookahead)


def test_a_claim_that_read_its_lookahead_plans_the_next_batches_and_they_yield(
        redis_server: RedisServer) -> None:
    """Varied lengths, a lookahead of 16, batches of 4: the first claim reads all 16 and
    plans the next batches from them (planned_after: two, while at least 8 are left); the
    next claims take them in turn: a member cancelled since is left out, one whose entry
    was damaged is leased with its batch to be failed alone. A more urgent arrival drops a
    plan: the claim after it reads again, headed by that request."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = RequestQueue(client, f"policy-plans-{next(FAIR_RUNS)}")
    size, budget, lookahead = 4, 10_000, 16

    def enqueue(rid: str, tokens: int, priority: str) -> Candidate:
        queue.enqueue([Request.validated(id=rid, input=0, priority=priority, tokens=tokens)])
        fields = client.hget(queue.keys.sched, rid).split(":")
        return Candidate(rid, tokens, int(fields[2]), rank=int(fields[3]))
    queued = [enqueue(f"r{i:02d}", (i * 7) % 13 + 1, "batch") for i in range(40)]

    def claim(n: int, most: int = size) -> list[str]:
        reply = queue.claim(f"w#{n}", most, budget, 0, lookahead)
        for r in reply.batch:
            queued[:] = [c for c in queued if c.id != r.id]
        return [r.id for r in reply.batch]

    def read_now(most: int = size) -> tuple[list[str], list[list[str]]]:
        read = sorted(queued, key=lambda c: (c.rank, c.id))[:lookahead]
        return leases_and_plans(read, most, budget, lookahead)

    batch, plans = read_now()
    assert claim(1) == batch and len(plans) == 2  # 12 left, then 8 (half the lookahead)
    assert claim(2) == plans[0]
    cancelled, damaged = plans[1][-1], plans[1][1]
    assert queue.cancel([cancelled]) == [1]
    queued[:] = [c for c in queued if c.id != cancelled]
    client.hset(queue.keys.sched, damaged, "damaged")
    third = queue.claim("w#3", size, budget, 0, lookahead)
    assert [r.id for r in third.batch] == [damaged] + [i for i in plans[1] if i not in (cancelled, damaged)]
    assert third.batch[0].invalid and not any(r.invalid for r in third.batch[1:])
    queued[:] = [c for c in queued if c.id not in {r.id for r in third.batch}]
    batch, plans = read_now()  # the plan is spent: the next claim reads, and plans again
    assert claim(4) == batch and plans
    queued.append(enqueue("urgent", 3, "realtime"))
    batch, plans = read_now()
    assert batch[0] == "urgent" and claim(5) == batch and plans
    batch, _ = read_now(3)  # another shape (batches of 3): the plan is not its to take
    assert claim(6, 3) == batch
    batch, _ = read_now()  # ... and it is gone
    assert claim(7) == batch
    client.close()


def test_a_claim_that_does_not_take_the_plan_drops_it(redis_server: RedisServer) -> None:
    """A plan of one batch, then a more urgent arrival whose claim takes some of its
    members, not its head, and plans nothing itself (too few left): the plan goes with that
    claim, so the next one reads again instead of leasing those members a second time."""
    size, budget, lookahead = 4, 10_000, 16
    lengths = [(i * 7) % 13 + 1 for i in range(12)]

    def claimed(read: list[Candidate]) -> tuple[list[str], list[list[str]]]:
        return leases_and_plans(read, size, budget, lookahead)
    backlog = [Candidate(f"r{i:02d}", t, 0, rank=1) for i, t in enumerate(lengths)]
    first, plans = claimed(backlog)
    left = [c for c in backlog if c.id not in first]
    for urgent in range(1, 14):  # an arrival's length that makes the case
        second, replanned = claimed([Candidate("urgent", urgent, 0, rank=0)] + left)
        if len(plans) == 1 and not replanned and plans[0][0] not in second \
                and set(plans[0]) & set(second):
            break
    else:
        raise AssertionError("no arrival's length takes planned members but not the head")
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = RequestQueue(client, f"policy-plans-{next(FAIR_RUNS)}")
    queue.enqueue([Request.validated(id=c.id, input=0, priority="batch", tokens=c.tokens)
                   for c in backlog])  # one call: one rank, in id order
    leased = [r.id for r in queue.claim("w#1", size, budget, 0, lookahead).batch]
    assert leased == first
    queue.enqueue([Request.validated(id="urgent", input=0, priority="realtime", tokens=urgent)])
    leased += [r.id for r in queue.claim("w#2", size, budget, 0, lookahead).batch]
    assert leased[len(first):] == second
    third, _ = claimed([c for c in left if c.id not in second])
    assert [r.id for r in queue.claim("w#3", size, budget, 0, lookahead).batch] == third
    assert not set(third) & set(leased)
    client.close()


@st.composite
def claim_runs(draw: st.DrawFn) -> tuple:
    """A backlog of varied lengths and two classes, enqueued 10 ms or a second apart (the
    classes interleave in rank), a worker's shape, the batches its claims may lease, and
    what happens before each claim: nothing, a more urgent arrival, a cancel, or a damaged
    entry."""
    n = draw(st.integers(1, 60))
    backlog = [(draw(st.integers(1, 40)), draw(st.sampled_from([0, 0, 5000]))) for _ in range(n)]
    events = draw(st.lists(st.sampled_from(["", "", "", "urgent", "cancel", "damage"]),
                           max_size=40))
    return (backlog, events, draw(st.integers(1, 8)), draw(st.integers(1, 200)),
            draw(st.integers(1, 40)), draw(st.booleans()), draw(st.sampled_from([1, 2])),
            draw(st.sampled_from([10, 1000])))


@given(claim_runs())
# a deep queue's alike first read whose second batch's worth is headed by a faster class
@example(case=([(1, 5000)] * 6 + [(1, 0)] + [(1, 5000)] * 9, [], 2, 200, 8, True, 2, 1000))
@settings(max_examples=60, deadline=None)
def test_lua_claims_in_a_row_agree_with_the_python_rule_and_its_plans(
        redis_server: RedisServer, case: tuple) -> None:
    """Claims until the queue is empty, each compared with the rule: a claim that read past
    a batch's worth plans the next batches (planned_after), and the next claims take them
    while each one's head is the queue's head; a more urgent arrival drops the plan, a
    cancelled member is left out, a member whose entry was damaged is leased to be failed
    alone. Every request is leased once or cancelled, none lost. A claim that may lease two
    batches leases, while the queue holds more than its lookahead past them, the one the
    next claim would lease too, under the lease token + "+": it reads two batches' worth
    first, and the next batch is the next batch's worth of them when those are alike to
    their own head, else the first one it plans."""
    backlog, events, max_size, max_tokens, lookahead, fill_from_slower, batches, spacing = case
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = RequestQueue(client, f"policy-runs-{next(FAIR_RUNS)}")
    k: Keys = queue.keys
    client.hset(k.settings, "fill_from_slower", int(fill_from_slower))
    now = int(client.time()[0]) * 1000
    pending: dict[str, Candidate] = {}
    added: list[str] = []

    def add(rid: str, tokens: int, delay: int, rank_ms: int) -> None:
        c = Candidate(rid, tokens, rank_ms - delay, 0, rank_ms)
        pending[rid] = c
        added.append(rid)
        client.zadd(k.pending, {rid: c.rank})
        client.hset(k.sched, rid, f"{tokens}:0:{c.enqueued_ms}:{c.rank}:"
                                  f"{CLASS_OF_DELAY[delay]}:")
        client.hset(k.requests, rid, json.dumps({"input": rid}))
    for i, (tokens, delay) in enumerate(backlog):
        add(f"r{i:02d}", tokens, delay, now - 70_000 + spacing * i + delay)
    damaged: set[str] = set()
    plan: list[list[str]] = []
    leased: list[str] = []
    cancelled: set[str] = set()
    for n, event in enumerate(events + [""] * 200):  # then claims alone, until it is empty
        if not pending:
            break
        order = sorted(pending.values(), key=lambda c: (c.rank, c.id))
        if event == "urgent":  # before everything: the head changes
            add(f"u{n:02d}", 1 + n % 40, 0, order[0].rank - 1)
        elif event == "cancel":
            victim = order[n % len(order)].id
            assert queue.cancel([victim]) == [1]  # cancelled while queued
            cancelled.add(victim)
            del pending[victim]
        elif event == "damage":
            victim = order[n % len(order)].id
            client.hset(k.sched, victim, "damaged")
            damaged.add(victim)
        order = sorted(pending.values(), key=lambda c: (c.rank, c.id))
        if not order:
            break
        reply = queue.claim(f"w#{n}", max_size, max_tokens, 0, lookahead, batches=batches)
        following: list[str] = []  # a deep queue's next batch
        if plan and plan[0][0] == order[0].id:  # the next planned batch, less what is gone
            members = [rid for rid in plan.pop(0) if rid in pending]
            expected = [rid for rid in members if rid in damaged] + \
                       [rid for rid in members if rid not in damaged]
        else:
            window = min(max_size, lookahead)
            deep = batches == 2 and len(order) > lookahead + 2 * window
            first_read = min(2 * window, lookahead) if deep else window
            read = [None if c.id in damaged else c for c in order[:lookahead]]
            settled = settled_by(read, reply.now_ms, first_read)
            if settled:
                read = read[:first_read]
            chosen = select_batch([c for c in read if c is not None], reply.now_ms, max_size,
                                  max_tokens, 0, fill_from_slower)
            plan = planned_after(read, chosen, reply.now_ms, max_size, max_tokens, lookahead,
                                 fill_from_slower)
            if deep and settled:  # alike: the next batch's worth, when alike to their head
                rest = [c for c in read if c.id not in set(chosen.batch)]
                n_chosen = len(chosen.batch)
                if len(rest) >= n_chosen and settled_by(rest, reply.now_ms, n_chosen):
                    following = select_batch(rest, reply.now_ms, max_size, max_tokens, 0,
                                             fill_from_slower).batch
                plan = []
            elif deep and chosen.full:  # what it would plan first, leased now
                rest = [c for c in read if c is not None and c.id not in set(chosen.batch)]
                after = select_batch(rest, reply.now_ms, max_size, max_tokens, 0,
                                     fill_from_slower)
                if 2 * len(rest) >= lookahead and after.full:
                    following = after.batch
                    plan = plan[1:]
            expected = [c.id for c in order[:len(read)] if c.id in damaged] + chosen.batch
        assert [r.id for r in reply.batch] == expected + following, (n, event, plan)
        assert [r.lease_token for r in reply.batch] == (
            [f"w#{n}"] * len(expected) + [f"w#{n}+"] * len(following))
        assert all(bool(r.invalid) == (r.id in damaged) for r in reply.batch)
        for rid in expected + following:
            del pending[rid]
        leased += expected + following
    assert not pending
    assert len(set(leased)) == len(leased) and not set(leased) & cancelled  # each once
    assert set(leased) | cancelled == set(added)  # none lost
    client.close()


@st.composite
def tenant_cases(draw: st.DrawFn) -> tuple[list[list[int]], list[float], int, int, int]:
    """Two or three tenants' requests (token counts), their weights, and a worker's
    max_batch_size, max_batch_tokens and lookahead."""
    n = draw(st.integers(2, 3))
    queues = [draw(st.lists(st.integers(1, 40), min_size=1, max_size=25)) for _ in range(n)]
    weights = [draw(st.sampled_from([1.0, 1.0, 2.0, 0.5])) for _ in range(n)]
    return (queues, weights, draw(st.integers(1, 8)), draw(st.integers(1, 200)),
            draw(st.integers(1, 30)))


@given(tenant_cases())
@settings(max_examples=60, deadline=None)
def test_lua_fair_claims_agree_with_the_python_rule(redis_server: RedisServer, case: tuple) -> None:
    """Tenants enqueued together, claimed until empty: each claim leases what
    select_batch chooses from fair_lookahead over the counters charged() so far; once one
    tenant is left, from the global lookahead, which plans (planned_after)."""
    token_lists, weights, max_size, max_tokens, lookahead = case
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    queue = RequestQueue(client, f"policy-fair-{next(FAIR_RUNS)}")
    tenants = [f"t{i}" for i in range(len(token_lists))]
    queue.update_settings(tenant_weights=dict(zip(tenants, weights)))
    queued: dict[str, list[Candidate]] = {}
    for tenant, tokens in zip(tenants, token_lists):
        queue.enqueue([Request.validated(id=f"{tenant}-{i:02d}", input=i, priority="batch",
                                         tokens=t, tenant=tenant) for i, t in enumerate(tokens)])
        sched = client.hmget(queue.keys.sched, [f"{tenant}-{i:02d}" for i in range(len(tokens))])
        queued[tenant] = [Candidate(id=f"{tenant}-{i:02d}", tokens=t, enqueued_ms=int(s.split(":")[2]),
                                    rank=int(s.split(":")[3]))
                          for i, (t, s) in enumerate(zip(tokens, sched))]
    counters = dict.fromkeys(tenants, 0.0)
    plan: list[list[str]] = []  # one tenant left: the global lookahead, which plans
    for n in range(200):
        backlogs = [Backlog(t, counters[t], queued[t]) for t in tenants if queued[t]]
        if not backlogs:
            break
        if len(backlogs) >= 2:
            candidates = fair_lookahead(backlogs, max_tokens, lookahead)
        else:
            candidates = backlogs[0].queued[:lookahead]
        reply = queue.claim(f"w#{n}", max_size, max_tokens, 0, lookahead)
        if len(backlogs) == 1 and plan and plan[0][0] == candidates[0].id:
            assert [r.id for r in reply.batch] == plan.pop(0), (n, counters)
        else:
            if settled_by(candidates, reply.now_ms, max_size):
                candidates = candidates[:max_size]
            expected = select_batch(candidates, reply.now_ms, max_size, max_tokens, 0)
            assert [r.id for r in reply.batch] == expected.batch, (n, counters)
            plan = planned_after(candidates, expected, reply.now_ms, max_size, max_tokens,
                                 lookahead) if len(backlogs) == 1 else []
        for r in reply.batch:
            counters[r.tenant] = charged(counters[r.tenant], r.tokens, weights[tenants.index(r.tenant)])
            queued[r.tenant] = [c for c in queued[r.tenant] if c.id != r.id]
    client.close()


FAIR_RUNS = itertools.count()
